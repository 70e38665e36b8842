"""Two real Faust workers in one group on a 2-partition rl.samples.raw; one is SIGKILLed
mid-stream. Its partitions move to the survivor together with the per-actor state (the
``actor-state`` table's changelog), so the raw records it had prepared but not committed,
redelivered to the survivor, are recognised as duplicates: every sample ends prepared once,
or dead-lettered with a reason; none is prepared twice."""

from __future__ import annotations

import json
import uuid
from collections import Counter

import pytest

from schemas.codec import Codec
from schemas.events import DeadLetter, PreparedBatch
from streams.topics import DEADLETTER, POLICY_VERSIONS, SAMPLES_PREPARED, SAMPLES_RAW, STREAMS_GROUP
from tests.streams.shells import open_shell
from tests.streams.test_shell_scenarios import make_batch, policy_version
from tests.support import wait_for
from tests.support.kafka import committed

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

CODEC = Codec()
ACTORS = 8
PER_PHASE = 12  # batches per actor in each phase
SESSION_TIMEOUT_S = 30


def changelog_state(inner_bus, app_id: str) -> dict[str, dict]:
    """The newest per-actor state in the table's changelog topic (what a new owner restores)."""
    state: dict[str, dict] = {}
    for r in inner_bus.read_all(f"{app_id}-actor-state-changelog", timeout=5):
        key = json.loads(r.key)
        if r.value is None or r.value in (b"", b"null"):
            state.pop(key, None)
        else:
            state[key] = json.loads(r.value)
    return state


def test_sigkilled_worker_hands_its_partitions_and_actor_state_to_the_survivor(kafka_bootstrap, tmp_path):
    from schemas.events import now_ms

    run = uuid.uuid4().hex[:8]
    pid = f"policy-{run}"
    # The victim is SIGSTOPped while the test reads the topics; a pause past the session timeout
    # would expel it and let it write on as a zombie once resumed (a duplicate only the learner's
    # batch-id check catches), which is not what this test is about: a session long enough for
    # any pause under load, the takeover after the SIGKILL waiting for it.
    env = {"RLSTREAM_ALGO": "ppo", "RLSTREAM_STALENESS_K": "1000000", "RLSTREAM_STALENESS_MS": "none",
           "RLSTREAM_POLICY_ID": pid, "BROKER_SESSION_TIMEOUT": str(SESSION_TIMEOUT_S)}
    actors = [f"actor-{i}" for i in range(ACTORS)]  # fixed keys: the same actors on each partition every run
    with open_shell("faust", env, tmp_path, lambda: kafka_bootstrap, raw_partitions=2) as shell:
        bus, ns = shell.bus, shell.bus.ns
        app_id, raw_topic = ns.group(STREAMS_GROUP), ns.topic(SAMPLES_RAW)
        bus.produce(POLICY_VERSIONS, CODEC.encode(policy_version(pid, 0)), key=pid.encode())
        bus.flush()

        def produce(seqs) -> None:
            for s in seqs:
                for a in actors:
                    bus.produce(SAMPLES_RAW, CODEC.encode(make_batch(a, s, 0, now_ms())), key=a.encode())
            bus.flush()

        victim, _ = shell.start(), shell.start()
        shell.follows(0)
        wait_for(lambda: [len(shell.stats_doc(i)["partitions"]) for i in (0, 1)] == [1, 1], 180,
                 "both workers to own one partition each", every=0.5, ignore=(OSError, ValueError, KeyError),
                 on_timeout=shell.logs)
        produce(range(PER_PHASE))
        lost = set(shell.stats_doc(0)["partitions"])
        assert lost and bus.end_offsets(SAMPLES_RAW)[next(iter(lost))] > 0  # the victim has work

        def frozen_with_uncommitted_but_remembered_output() -> bool:
            """SIGSTOP the victim where one of its partitions has prepared outputs whose raw
            records are uncommitted and whose state is in the changelog; else let it go on."""
            victim.pause()
            done = committed(kafka_bootstrap, app_id, raw_topic)
            out = [CODEC.decode(r.value, PreparedBatch) for r in bus.read_all(SAMPLES_PREPARED, timeout=5)]
            ahead = [p for p in out if p.source_partition in lost and p.source_offset >= done.get(p.source_partition, 0)]
            state = changelog_state(bus.inner, app_id)
            remembered = all(p.sample.batch_id in state.get(p.sample.actor_id, {}).get("ids", ()) for p in out
                             if p.source_partition in lost)
            if ahead and remembered:
                return True
            victim.resume()
            return False

        wait_for(frozen_with_uncommitted_but_remembered_output, 180,
                 "the victim with an uncommitted prepared record", every=0.05, on_timeout=shell.logs)
        victim.kill()
        at_kill = committed(kafka_bootstrap, app_id, raw_topic), bus.end_offsets(SAMPLES_RAW)
        wait_for(lambda: shell.stats_doc(1)["partitions"] == [0, 1], 180,
                 "the survivor to take over both partitions", every=0.5, ignore=(OSError, ValueError, KeyError),
                 on_timeout=shell.logs)
        at_takeover = committed(kafka_bootstrap, app_id, raw_topic), bus.end_offsets(SAMPLES_RAW)
        print("rl.samples.raw committed/end offsets at the kill", at_kill, "at the takeover", at_takeover)
        produce(range(PER_PHASE, 2 * PER_PHASE))
        shell.settle()
        print("rl.samples.raw committed/end offsets settled", committed(kafka_bootstrap, app_id, raw_topic), bus.end_offsets(SAMPLES_RAW))
        raw_ids = [CODEC.decode(r.value).batch_id for r in bus.read_all(SAMPLES_RAW)]
        seen: dict = {}

        def every_record_accounted_for() -> bool:
            """A committed raw record's output may still sit in Faust's producer: poll until every
            raw record is prepared or dead-lettered (the deadline turns a real loss into a failure)."""
            seen["prepared"] = Counter(CODEC.decode(r.value, PreparedBatch).sample.batch_id
                                       for r in bus.read_all(SAMPLES_PREPARED))
            seen["dead"] = [CODEC.decode(r.value, DeadLetter) for r in bus.read_all(DEADLETTER)]
            dead_ids = {CODEC.decode(d.value).batch_id for d in seen["dead"]}
            return set(raw_ids) <= set(seen["prepared"]) | dead_ids

        wait_for(every_record_accounted_for, 60, "every raw record prepared or dead-lettered", every=1.0,
                 on_timeout=lambda: f"missing: {sorted(set(raw_ids) - set(seen['prepared']))}")
        stats = shell.stats(1)
        prepared, dead = seen["prepared"], seen["dead"]

    assert len(raw_ids) == len(set(raw_ids)) == 2 * PER_PHASE * ACTORS
    twice = {b: n for b, n in prepared.items() if n > 1}
    assert twice == {}, f"prepared twice: {twice}"
    dead_ids = {CODEC.decode(d.value).batch_id: d.reason for d in dead}
    assert all(d.reason for d in dead)
    missing = set(raw_ids) - set(prepared) - set(dead_ids)
    assert missing == set(), f"neither prepared nor dead-lettered: {sorted(missing)}"
    # the survivor saw the victim's uncommitted records again and dropped them by the moved state
    assert stats["drops"].get("duplicate", 0) >= 1, stats
