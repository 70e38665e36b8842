"""Actors started without ``--index`` get distinct ids from ``rl.actors`` (``actor.identity``),
and a SIGKILLed actor started again on the same host gets a new generation: its batches, seq
from 0 under the new id, are prepared and trained -- neither dropped as duplicates nor as late."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from config import Environment
from schemas.codec import Codec
from streams.topics import LEARNER_STEPS, SAMPLES_RAW

from .conftest import Ledger, TopicCounter, all_trained, check_acknowledged, check_trained_once, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
CODEC = Codec()


def test_actors_without_index_get_distinct_ids_and_a_restart_a_new_generation(private_kafka, rig):
    steps = TopicCounter(private_kafka.bootstrap, LEARNER_STEPS, CODEC.decode)
    raw = TopicCounter(private_kafka.bootstrap, SAMPLES_RAW, CODEC.decode)

    def ids() -> set[str]:
        raw.poll()
        return {b.actor_id for b in raw.items}

    def batches_of(actor_id: str) -> int:
        raw.poll()
        return sum(1 for x in raw.items if x.actor_id == actor_id)
    try:
        streams = rig.start_faust()
        learner = rig.learner()
        a = rig._spawn("actor-a", rig._cmd("actor"))  # no --index: both on this host, at once
        b = rig._spawn("actor-b", rig._cmd("actor"))
        wait_for(lambda: len(ids()) == 2 and steps.poll() >= 2, 180, "both actors publishing",
                 on_timeout=rig.logs)
        first_ids = ids()
        a.kill()
        c = rig._spawn("actor-a", rig._cmd("actor"))  # the same host, again
        wait_for(lambda: len(ids()) == 3, 120, "the restarted actor publishing", on_timeout=rig.logs)
        restarted = (ids() - first_ids).pop()
        n = batches_of(restarted)
        wait_for(lambda: batches_of(restarted) >= n + 2, 120,
                 "2 more batches of the restarted actor", on_timeout=rig.logs)
        acks = [b.stop(), c.stop()]  # (a was SIGKILLed: no summary, its batches are in the topic's count)
        wait_for(lambda: all_trained(raw, steps), 120, "every produced batch trained", on_timeout=rig.logs)
        learner.stop()
        assert not streams.errors, streams.errors
        stats = streams.stop()
    finally:
        steps.close()
        raw.close()
    host = Environment.read().hostname
    generations = sorted(int(i.removeprefix(f"{host}-")) for i in first_ids | {restarted})
    assert all(i.startswith(f"{host}-") for i in first_ids | {restarted}), (first_ids, restarted)
    assert len(set(generations)) == 3 and int(restarted.removeprefix(f"{host}-")) == generations[-1]
    ledger = Ledger.read(private_kafka.bootstrap)
    counts = check_trained_once(ledger)  # the restarted actor's batches too: none dropped
    assert ledger.dead_reasons() == {}, ledger.dead_reasons()
    assert stats["drops"] == {} and stats["reorder"]["restarts"] == 0, stats  # a new key, not a seq regression
    seqs = defaultdict(list)
    for x in ledger.raw:
        seqs[x.actor_id].append(x.seq)
    for actor, s in seqs.items():
        assert s == list(range(len(s))), (actor, s)
    counts["actors"] = check_acknowledged(ledger, acks)
    print("FAULT actor-ids counts:", json.dumps({**counts, "ids": sorted(seqs)}, sort_keys=True))
