"""Bounded reads say they are complete only when they are (issue 39, part 1), on the memory bus.

The policy tail reader (``streams.policy.tail``) and ``Bus.read_all`` read up to end offsets they
asked for. A reader whose records stop coming (a paused broker) must either wait for them within
its deadline or raise ``IncompleteReadError`` naming the gap: never hand back a short range as
the whole. ``Stalling`` is a real ``MemoryBus`` whose readers stop receiving records after a
budget of them, as behind a broker paused mid-read, and optionally resume after some polls (the
reader's own polls, not the clock). The Kafka half, with a SIGSTOPped broker, is in
tests/faults/test_partial_reads.py."""

from __future__ import annotations

import threading

import pytest
import torch

from agents.networks import Policy
from schemas.codec import Codec
from streams.bus.base import IncompleteReadError
from streams.bus.memory import MemoryBus
from streams.events import EventBus
from streams.policies import make_policy_version, newest_version, publish_policy_version
from streams.policy.tail import decodes_as, tail_offsets
from schemas.events import PolicyVersion
from streams.topics import POLICY_VERSIONS, Namespace

torch.set_num_threads(1)


class _StallingConsumer:
    def __init__(self, bus: "Stalling", inner) -> None:
        self.bus, self.inner = bus, inner

    def poll(self, timeout: float = 1.0, max_records: int = 500):
        b = self.bus
        if b.budget is not None and b.delivered >= b.budget:
            b.stalled_polls += 1
            if b.resume_after is not None and b.stalled_polls >= b.resume_after:
                b.budget = None  # the broker answers again
            else:
                threading.Event().wait(timeout)  # a poll of a paused broker: nothing within its timeout
                return []
        limit = max_records if b.budget is None else min(max_records, b.budget - b.delivered)
        recs = self.inner.poll(timeout, max_records=limit)
        b.delivered += len(recs)
        return recs

    def __getattr__(self, name):
        return getattr(self.inner, name)


class Stalling(MemoryBus):
    """Readers get ``budget`` records in all, then none (paused) until ``resume_after`` polls of
    theirs came back empty (None: never)."""

    def __init__(self, budget: int | None = None, resume_after: int | None = None) -> None:
        super().__init__()
        self.budget, self.resume_after = budget, resume_after
        self.delivered = self.stalled_polls = 0

    def consumer(self, group, topics, start="earliest"):
        return _StallingConsumer(self, super().consumer(group, topics, start))


def _version(v: int, policy_id: str) -> PolicyVersion:
    torch.manual_seed(v)
    return make_policy_version(Policy(3, 1, hidden=(4,)), policy_id=policy_id, version=v, parent_version=None,
                               learner_id="L", algo="ppo")


def _events(bus: MemoryBus) -> EventBus:
    bus.create_topics(Namespace().topics())
    events = EventBus(bus, Codec())
    # p0..p3 at offsets 0..3, then 29 versions of another policy (4..32): the tail reader's
    # windows back from 33 are [32,33), [28,32), [12,28), [0,12); p's newest is in the last one
    for v in range(4):
        publish_policy_version(events, _version(v, "p"))
    for v in range(29):
        publish_policy_version(events, _version(v, "other"))
    return events


@pytest.mark.parametrize("budget", [27, 29])
def test_the_newest_version_read_that_stalls_mid_range_raises_naming_the_gap(budget):
    """A reader reads on to the log end: the first three windows take 1 + 5 + 21 records. 27: the
    last window gets nothing (the old reader said "no version"); 29: it gets offsets 0 and 1 (the
    old reader said version 1, as CI's "read 4 on a topic holding 0..32")."""
    bus = Stalling()
    events = _events(bus)
    assert newest_version(events, "p").version == 3  # the whole topic answers
    bus.budget, bus.delivered = budget, 0
    with pytest.raises(IncompleteReadError) as e:
        newest_version(events, "p", timeout=0.5)
    err = e.value
    assert (err.topic, err.partition, err.expected_end, err.reached) == (POLICY_VERSIONS, 0, 12, budget - 27)
    assert f"{POLICY_VERSIONS}[0] reached offset {budget - 27}, not the end offset 12" in str(err)


def test_a_stall_shorter_than_the_deadline_is_waited_out():
    bus = Stalling()
    events = _events(bus)
    bus.budget, bus.resume_after = 29, 3  # paused mid-window for 3 polls, deadline 10 s
    assert newest_version(events, "p", timeout=10.0).version == 3
    assert bus.stalled_polls == 3
    bus.budget, bus.delivered, bus.stalled_polls = 2, 0, 0
    match = decodes_as(events, PolicyVersion, lambda pv: pv.policy_id == "p")
    assert tail_offsets(bus, POLICY_VERSIONS, match, timeout=10.0, count=3) == {(POLICY_VERSIONS, 0): 1}


def test_read_all_that_stalls_raises_naming_the_gap():
    bus = Stalling()
    _events(bus)
    bus.budget = 10
    got = []
    with pytest.raises(IncompleteReadError) as e:
        for r in bus.read_all(POLICY_VERSIONS, timeout=0.5):
            got.append(r.offset)
    assert got == list(range(10))
    assert (e.value.expected_end, e.value.reached) == (33, 10)
    assert "reached offset 10, not the end offset 33" in str(e.value)


def test_offsets_retention_removed_are_not_waited_for():
    """A window wholly below the log start is empty, not a stall: the read ends at once."""
    bus = MemoryBus()
    events = _events(bus)
    part = bus._topics[POLICY_VERSIONS][0]
    del part.records[:20]  # retention: offsets 0..19 gone (p's versions among them)
    part.base = 20
    assert newest_version(events, "p", timeout=10.0) is None
