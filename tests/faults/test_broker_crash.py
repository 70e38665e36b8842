"""SIGKILL the Kafka broker in the middle of a run and start it again on the same data.

Learner, actor and the stream processors are the processes production runs (``rlstream
learner``, ``rlstream actor``, ``faust -A streams worker``; ``conftest.Rig``). Training must carry
on by itself once the broker is back: no role exits, and after the run every SampleBatch in the
log was trained exactly once (``GradientStep.batch_ids`` against ``rl.samples.raw``), versions
stayed monotonic; a prepared batch the worker publishes again after the restart (its input's
offset was not committed yet) is skipped by the learner, never trained twice. The actor's own
account (its summary: the seqs the broker acknowledged) must match the samples topic exactly. The outage is
ended by conditions, not by a clock: the broker is down, and every role has logged since it
went down (each ran against the dead broker).
"""

from __future__ import annotations

import json

import pytest

from localkafka.probe import probe
from schemas.codec import Codec
from streams.topics import LEARNER_STEPS, SAMPLES_RAW, all_topics
from tests.support.kafka import leaders_ready

from .conftest import Ledger, TopicCounter, all_trained, check_acknowledged, check_trained_once, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
CODEC = Codec()


def test_broker_sigkill_and_restart_mid_run(private_kafka, rig):
    topics = [t.name for t in all_topics()]
    steps = TopicCounter(private_kafka.bootstrap, LEARNER_STEPS, CODEC.decode)
    raw = TopicCounter(private_kafka.bootstrap, SAMPLES_RAW, CODEC.decode)
    try:
        streams = rig.start_faust()
        learner = rig.learner()
        actor = rig.actor(0)
        wait_for(lambda: steps.poll() >= 3, 180, "3 updates before the crash", on_timeout=rig.logs)
        leaders_ready(private_kafka.bootstrap, topics)

        private_kafka.kafka.kill()  # SIGKILL: no controlled shutdown
        port = private_kafka.kafka.port
        assert not probe("127.0.0.1", port, timeout=2)["listening"]
        roles = [learner, actor, streams.current]
        sizes = {r.name: r.log.stat().st_size for r in roles}
        wait_for(lambda: all(r.log.stat().st_size > sizes[r.name] for r in roles), 120,
                 "every role to log while the broker is down", on_timeout=rig.logs)
        assert learner.alive() and actor.alive() and streams.alive, rig.logs()
        private_kafka.kafka.start(timeout=180)
        leaders_ready(private_kafka.bootstrap, topics, timeout=120)
        before = steps.poll()

        def progressed() -> bool:  # fails at once, with the logs, if a role died of the outage
            assert learner.alive() and actor.alive() and streams.alive, rig.logs()
            return steps.poll() >= before + 3

        wait_for(progressed, 180, "3 updates after the broker came back",
                 on_timeout=lambda: rig.logs() + f"\nstreams errors: {streams.errors}")
        assert learner.alive() and actor.alive(), rig.logs()
        assert streams.alive and not streams.errors, streams.errors

        actor_summary = actor.stop()
        wait_for(lambda: all_trained(raw, steps), 120, "every produced batch trained", on_timeout=rig.logs)
        learner_summary = learner.stop()
        streams_summary = streams.stop()
    finally:
        steps.close()
        raw.close()
    ledger = Ledger.read(private_kafka.bootstrap)
    counts = check_trained_once(ledger)
    assert streams_summary["emitted_batches"] >= counts["produced"] and "Traceback" not in streams.current.text()
    # the actor's own account: what the broker acknowledged to it is what the topic holds, trained once
    counts.update(streams=streams_summary, learner_duplicates_skipped=learner_summary.get("duplicates_skipped"),
                  actors=check_acknowledged(ledger, [actor_summary]))
    print("FAULT broker-sigkill counts:", json.dumps(counts, sort_keys=True))
    assert counts["lost"] == 0 and counts["duplicates_trained"] == 0
    # offsets the worker had not committed when the broker died are redelivered (at least once):
    # the learner skips each copy by batch_id, and that is the only dead letter
    copies = counts["prepared"] - counts["prepared_unique"]
    assert counts["dead_letters"] == ({"duplicate": copies} if copies else {})
    assert learner_summary["duplicates_skipped"] == copies
