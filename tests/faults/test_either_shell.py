"""The fault rig over either processor shell (``conftest.SHELL_CMDS``): the Faust worker and the
in-process worker as a process (``python -m rlstream.entry worker``). The shell is SIGKILLed mid-run and
restarted; every committed SampleBatch is trained exactly once either way."""

from __future__ import annotations

import json

import pytest

from schemas.codec import Codec
from streams.topics import LEARNER_STEPS, SAMPLES_RAW

from .conftest import SHELL_CMDS, Ledger, TopicCounter, all_trained, check_acknowledged, check_trained_once, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
CODEC = Codec()


@pytest.mark.parametrize("shell", sorted(SHELL_CMDS))
def test_shell_sigkill_and_restart_trains_every_batch_once(private_kafka, rig, shell):
    steps = TopicCounter(private_kafka.bootstrap, LEARNER_STEPS, CODEC.decode)
    raw = TopicCounter(private_kafka.bootstrap, SAMPLES_RAW, CODEC.decode)
    try:
        streams = rig.start_streams(shell)
        learner = rig.learner()
        actor = rig.actor(0)
        wait_for(lambda: steps.poll() >= 3, 180, "3 updates before the crash", on_timeout=rig.logs)
        streams.crash()
        n = steps.poll()
        wait_for(lambda: steps.poll() >= n + 3, 180, "3 updates after the restart", on_timeout=rig.logs)
        actor_summary = actor.stop()
        wait_for(lambda: all_trained(raw, steps), 120, "every produced batch trained", on_timeout=rig.logs)
        learner.stop()
        assert not streams.errors, streams.errors
        summary = streams.stop()
    finally:
        steps.close()
        raw.close()
    ledger = Ledger.read(private_kafka.bootstrap)
    counts = check_trained_once(ledger)
    counts["actors"] = check_acknowledged(ledger, [actor_summary])  # acknowledged to the actor = in the topic
    print(f"FAULT {shell}-shell-sigkill counts:", json.dumps(counts, sort_keys=True))
    assert counts["lost"] == 0 and counts["duplicates_trained"] == 0
    assert summary["role"] == "streams" and summary["published"] >= 1 and summary["dead_lettered"] == 0, summary
