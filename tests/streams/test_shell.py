"""The shell core's own rules (``streams.shell``), and the per-actor state it hands the
reorder buffer, without a bus."""

from __future__ import annotations

import json

from schemas.codec import Codec
from schemas.events import DeadLetter, PolicyVersion, PreparedBatch
from streams.bus.base import Record
from streams.events import DeadLetters
from config import PrepareConfig
from streams.processors.pipeline import Prepare
from streams.processors.reorder import ReorderBuffer
from streams.shell import PolicyRecords, ShellCore, policy_backlog, policy_starts
from streams.topics import DEADLETTER, POLICY_VERSIONS, SAMPLES_PREPARED, SAMPLES_RAW
from tests.streams.test_shell_scenarios import make_batch

CODEC = Codec()


class Clock:
    t = 1_000_000

    def __call__(self) -> int:
        return self.t


def core_with(clock, **cfg) -> ShellCore:
    prepare = Prepare.from_config(PrepareConfig(max_ms=None, importance=False, **cfg), clock=clock)
    return ShellCore(prepare, DeadLetters(None, CODEC), "streams.prepare", CODEC)


def raw(offset: int, batch) -> Record:
    return Record(SAMPLES_RAW, 0, offset, batch.actor_id.encode(), CODEC.encode(batch))


def policy(offset: int, version: int) -> Record:
    return Record(POLICY_VERSIONS, 0, offset, b"policy", CODEC.encode(PolicyVersion("policy", version, 0, "L", "ppo")))


def test_a_rejection_whose_record_is_no_longer_held_is_dead_lettered_from_its_batch():
    clock = Clock()
    core = core_with(clock, max_versions=1, reorder_timeout_ms=100)
    core.deliver(core.on_policy(policy(0, 0)), lambda s: None)
    b = make_batch("a", 1, 0, clock.t)
    assert core.on_sample(raw(7, b), handle="h7") == [] and core.ledger.held() == [(0, 7)]
    core.ledger.clear()  # e.g. a redelivery replaced it
    core.on_policy(policy(1, 5))  # the buffered batch is now 5 versions behind
    clock.t += 1000
    sends = core.tick()
    assert [(s.topic, s.reason, s.done) for s in sends] == [(DEADLETTER, "stale_versions", None)]
    dl = CODEC.decode(sends[0].value, DeadLetter)
    assert (dl.topic, dl.partition, dl.offset) == (SAMPLES_RAW, 0, 7)
    assert dl.value == CODEC.encode(b) and dl.key == b"a"


def test_a_failed_publish_dead_letters_the_raw_record_and_the_counts_say_so():
    clock = Clock()
    core = core_with(clock)
    rec = raw(3, make_batch("a", 0, 0, clock.t))
    written = []

    def produce(s):
        if s.topic == SAMPLES_PREPARED:
            raise RuntimeError("broker says no")
        written.append(s)

    core.deliver(core.on_sample(rec, handle="h"), produce)
    dl = CODEC.decode(written[0].value, DeadLetter)
    assert (dl.reason, dl.offset, dl.value, dl.detail) == ("processor_error", 3, rec.value, "RuntimeError: broker says no")
    assert written[0].done == "h" and core.counts() == {"published": 0, "dead_lettered": 1, "skipped": 0}
    assert len(core.ledger) == 0 and core.errors == 1 and core.prepare.stats.drops == {"processor_error": 1}


def test_bad_policy_records_are_skipped_not_dead_lettered_and_bad_weights_are_reported_against_their_record():
    clock = Clock()
    core = core_with(clock)
    assert [s.topic for s in core.on_policy(Record(POLICY_VERSIONS, 0, 0, None, b"junk"))] == [None]
    assert core.skipped == 1 and core.dead_letters.skipped == {(POLICY_VERSIONS, "corrupt"): 1}
    recs = PolicyRecords(keep=2)
    for v in range(4):
        recs.remember(v, policy(v, v))
    assert len(recs) == 2 and recs.pop(1) is None and recs.pop(3).offset == 3


def test_policy_reader_starts_k_plus_one_back_and_never_before_the_log_start():
    prepare = Prepare.from_config(PrepareConfig(max_versions=4))
    assert policy_backlog(prepare) == 5 and policy_backlog(prepare, 0) == 1
    assert policy_starts({0: 10, 1: 3, 2: 8}, 5, {2: 6}) == {0: 5, 1: 0, 2: 6}


def test_actor_state_is_json_and_a_new_buffer_continues_from_it():
    clock = Clock()
    state: dict = {}
    first = ReorderBuffer(timeout_ms=100, clock=clock, state=state)
    for s in range(3):
        first.push(make_batch("a", s, 0, clock.t), (1, s))
    first.push(make_batch("a", 5, 0, clock.t), (1, 5))  # buffered: not part of the state
    moved = json.loads(json.dumps(state))
    assert moved == {"a": {"p": 1, "next": 3, "max_created": clock.t, "floor": -(1 << 62),
                           "ids": ["a-0", "a-1", "a-2"]}}
    second = ReorderBuffer(timeout_ms=100, clock=clock, state=moved)
    again = second.push(make_batch("a", 2, 0, clock.t), (1, 2))  # a redelivery
    assert [r.reason for r in again.rejected] == ["duplicate"]
    nxt = second.push(make_batch("a", 3, 0, clock.t), (1, 3))
    assert [b.seq for b, _ in nxt.released] == [3] and moved["a"]["next"] == 4
    redelivered = second.push(make_batch("a", 5, 0, clock.t), (1, 5))  # the buffered one, redelivered
    assert redelivered.rejected == [] and second.buffered == 1


def test_a_prepared_output_goes_out_with_its_record_handle():
    clock = Clock()
    core = core_with(clock)
    sends = core.on_sample(raw(0, make_batch("a", 0, 0, clock.t)), handle="h0")
    assert [(s.topic, s.key, s.done) for s in sends] == [(SAMPLES_PREPARED, b"a", "h0")]
    assert CODEC.decode(sends[0].value, PreparedBatch).source_offset == 0


def test_in_order_acks_release_a_partition_only_up_to_its_lowest_open_record():
    from streams.shell import TAKE, InOrderAcks

    acks = InOrderAcks(lambda h: h)  # handles are (partition, offset)
    assert [acks.arrived(h) for h in [(0, 10), (0, 11), (0, 12), (1, 5)]] == [TAKE] * 4
    assert acks.done((0, 11)) == []  # 10 is still open: acking 11 would let the commit pass it
    assert acks.done((1, 5)) == [(1, 5)]  # partitions are independent
    assert acks.done((0, 10)) == [(0, 10), (0, 11)]
    assert acks.pending(0) == 1
    acks.forget([0])  # revoked: its records go to the new owner, nothing is acked here
    assert acks.done((0, 12)) == [] and acks.pending(0) == 0
    assert acks.arrived((0, 12)) == TAKE  # redelivered after it came back
    assert acks.done((0, 12)) == [(0, 12)]


def test_in_order_acks_seek_back_over_a_gap_and_take_each_record_once():
    from streams.shell import SEEK, SKIP, TAKE, InOrderAcks

    acks = InOrderAcks(lambda h: h, reseek_after=3)
    acks.expect(0, 40)  # the group committed 40
    assert acks.arrived((0, 43)) == SEEK and acks.next(0) == 40  # 40..42 were skipped by the consumer
    assert [acks.arrived((0, o)) for o in (44, 45)] == [SKIP, SKIP]  # fetched before the seek took effect
    assert acks.arrived((0, 41)) == SEEK  # restarted below what it skipped, still past 40: again
    assert [acks.arrived((0, o)) for o in (40, 41, 42)] == [TAKE] * 3
    assert acks.arrived((0, 41)) == SKIP  # a second delivery of a record taken
    assert acks.arrived((0, 43)) == TAKE and acks.rewinds == 2
    acks.expect(1, 0)
    assert acks.arrived((1, 7)) == SEEK
    assert [acks.arrived((1, o)) for o in (8, 9, 10)] == [SKIP] * 3
    assert acks.arrived((1, 11)) == SEEK  # reseek_after skips with no sign of the seek: seek again
    assert acks.done((0, 40)) == [(0, 40)]
