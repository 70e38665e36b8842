"""SIGKILL the Kafka broker in the middle of a run and start it again on the same data.

Learner and actor are real ``rlstream learner|actor`` processes, the stream processors run
in this process (``conftest.Rig``). Training must carry on by itself once the broker is back:
no role exits, and after the run every SampleBatch in the log was trained exactly once
(``GradientStep.batch_ids`` against ``rl.samples.raw``), versions stayed monotonic.
"""

from __future__ import annotations

import json
import time

import pytest

from schemas.codec import Codec
from streams.topics import LEARNER_STEPS, SAMPLES_RAW

from .conftest import Ledger, TopicCounter, all_trained, check_trained_once, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
CODEC = Codec()


def test_broker_sigkill_and_restart_mid_run(private_kafka, rig):
    steps = TopicCounter(private_kafka.bootstrap, LEARNER_STEPS, CODEC.decode)
    raw = TopicCounter(private_kafka.bootstrap, SAMPLES_RAW, CODEC.decode)
    try:
        streams = rig.start_streams()
        learner = rig.learner()
        actor = rig.actor(0)
        wait_for(lambda: steps.poll() >= 3, 120, "3 updates before the crash", on_timeout=rig.logs)

        private_kafka.kafka.kill()  # SIGKILL: no controlled shutdown
        t_down = time.monotonic()
        time.sleep(3.0)  # the roles keep running against a dead broker
        private_kafka.kafka.start(timeout=120)
        outage_s = time.monotonic() - t_down
        before = steps.poll()
        wait_for(lambda: steps.poll() >= before + 3, 120, "3 updates after the broker came back",
                 on_timeout=lambda: rig.logs() + f"\nstreams errors: {streams.errors}")
        assert learner.alive() and actor.alive(), rig.logs()
        assert streams.alive and not streams.errors, streams.errors

        actor_summary = actor.stop()
        wait_for(lambda: all_trained(raw, steps), 90, "every produced batch trained", on_timeout=rig.logs)
        learner_summary = learner.stop()
        streams.stop()
    finally:
        steps.close()
        raw.close()
    ledger = Ledger.read(private_kafka.bootstrap)
    counts = check_trained_once(ledger)
    counts.update(outage_s=round(outage_s, 1), streams=rig.streams.stats(),
                  learner_duplicates_skipped=learner_summary.get("duplicates_skipped"),
                  actor_seq=actor_summary.get("seq"))
    print("FAULT broker-sigkill counts:", json.dumps(counts, sort_keys=True))
    assert counts["lost"] == 0 and counts["duplicates_trained"] == 0
    assert counts["dead_letters"] == {}
