"""The bus contract (``streams.bus.base``): one suite, run against every backend.

Every test takes ``bus`` (parametrised: memory, kafka) and ``new_topic``. Waits poll until the
expected records arrived or a deadline passed; "nothing more" is checked with ``lag() == 0``
(position at the log end), never by sleeping.
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from collections import defaultdict

import numpy as np
import pytest

from schemas.codec import MAGIC, Codec
from schemas.events import DeadLetter, SampleBatch
from schemas.examples import example_events, sample_batch
from streams.bus.base import BusError, Record, RecordTooLargeError
from streams.events import EventBus

WAIT = 30.0  # seconds: Kafka group joins take a few; memory returns at once
MAX = 16 * 1024 * 1024


def collect(consumer, n: int, timeout: float = WAIT, max_records: int = 500) -> list[Record]:
    """Poll until ``n`` records came (never more than ``n``) or ``timeout`` passed."""
    out: list[Record] = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += consumer.poll(0.2, max_records=min(max_records, n - len(out)))
    return out


def wait_for(cond, consumers=(), timeout: float = WAIT) -> list[Record]:
    """Poll ``consumers`` (so group protocol callbacks run) until ``cond()``; returns what they polled."""
    got: list[Record] = []
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met in {timeout}s")
        for c in consumers:
            got += c.poll(0.05)
    return got


def group() -> str:
    return f"g-{uuid.uuid4().hex[:10]}"


def ids(records) -> list[tuple[int, int]]:
    return [(r.partition, r.offset) for r in records]


def produce_keyed(bus, topic, keys, per_key):
    """per_key records per key, interleaved: value b"key:i"."""
    for i in range(per_key):
        for k in keys:
            bus.produce(topic, f"{k}:{i}".encode(), key=k.encode())
    bus.flush()


# -- ordering and offsets -----------------------------------------------------------------------

def test_order_per_key_and_offsets_from_zero(bus, new_topic):
    topic = new_topic(partitions=4)
    keys = [f"actor-{i}" for i in range(6)]
    produce_keyed(bus, topic, keys, per_key=20)
    assert sum(bus.end_offsets(topic).values()) == 120
    c = bus.consumer(None, [topic])
    recs = collect(c, 120)
    assert len(recs) == 120
    assert c.lag() == {(topic, p): 0 for p in range(4)}
    c.close()

    by_key: dict[str, list[int]] = defaultdict(list)
    partition_of: dict[str, set[int]] = defaultdict(set)
    by_partition: dict[int, list[int]] = defaultdict(list)
    for r in recs:
        key, i = r.value.decode().split(":")
        assert r.key == key.encode()
        by_key[key].append(int(i))
        partition_of[key].add(r.partition)
        by_partition[r.partition].append(r.offset)
    for k in keys:
        assert by_key[k] == list(range(20)), f"order of {k} broken"
        assert len(partition_of[k]) == 1, f"{k} spread over partitions {partition_of[k]}"
    assert len(by_partition) > 1, "six keys all landed on one partition"
    ends = bus.end_offsets(topic)
    for p, offsets in by_partition.items():
        assert offsets == list(range(ends[p])), f"partition {p} offsets not 0..n-1"


def test_explicit_partition_and_unkeyed(bus, new_topic):
    topic = new_topic(partitions=3)
    for i in range(5):
        bus.produce(topic, b"p2-%d" % i, partition=2)
    bus.produce(topic, b"nokey")
    bus.flush()
    ends = bus.end_offsets(topic)
    assert ends[2] >= 5 and sum(ends.values()) == 6
    recs = list(bus.read_all(topic))
    assert [r.value for r in recs if r.partition == 2 and r.value.startswith(b"p2")] == [b"p2-%d" % i for i in range(5)]
    assert [r.key for r in recs if r.value == b"nokey"] == [None]


# -- groups -------------------------------------------------------------------------------------

def test_two_groups_each_see_every_record(bus, new_topic):
    topic = new_topic(partitions=2)
    produce_keyed(bus, topic, ["a", "b", "c"], per_key=10)
    c1, c2 = bus.consumer(group(), [topic]), bus.consumer(group(), [topic])
    r1, r2 = collect(c1, 30), collect(c2, 30)
    assert sorted(ids(r1)) == sorted(ids(r2)) and len(set(ids(r1))) == 30
    c1.close()
    c2.close()


def test_consumers_of_one_group_share_partitions(bus, new_topic):
    topic = new_topic(partitions=4)
    g = group()
    c1, c2 = bus.consumer(g, [topic]), bus.consumer(g, [topic])
    every = {(topic, p) for p in range(4)}

    def split() -> bool:
        a, b = set(c1.assignment()), set(c2.assignment())
        return bool(a) and bool(b) and not a & b and a | b == every

    assert wait_for(split, [c1, c2]) == []  # nothing produced yet
    keys = [f"actor-{i}" for i in range(16)]
    produce_keyed(bus, topic, keys, per_key=5)
    got1, got2 = [], []
    deadline = time.monotonic() + WAIT
    while len(got1) + len(got2) < 80 and time.monotonic() < deadline:
        got1 += c1.poll(0.05)
        got2 += c2.poll(0.05)
    assert len(got1) + len(got2) == 80
    assert got1 and got2, "one member got no records: the keys do not spread over the partitions"
    assert not set(ids(got1)) & set(ids(got2)), "a record went to both members"
    assert {(r.topic, r.partition) for r in got1} <= set(c1.assignment())
    assert {(r.topic, r.partition) for r in got2} <= set(c2.assignment())

    # c2 commits and leaves; c1 (which never committed) takes every partition over: it resumes
    # c2's at c2's commit and keeps its own position on the partitions it had.
    c2.commit()
    c2.close()
    stray = wait_for(lambda: set(c1.assignment()) == every, [c1])
    assert stray == [], "after the rebalance c1 re-read records it or c2 had consumed"
    bus.produce(topic, b"after", key=b"actor-0")
    bus.flush()
    more = collect(c1, 1)
    assert [r.value for r in more] == [b"after"]
    assert all(v == 0 for v in c1.lag().values())
    c1.close()


# -- replay, commit, resume ---------------------------------------------------------------------

def test_replay_from_zero_after_restart(bus, new_topic):
    topic = new_topic(partitions=2)
    produce_keyed(bus, topic, ["a", "b", "c", "d"], per_key=5)
    g = group()
    c = bus.consumer(g, [topic])
    first = collect(c, 20)
    c.commit()
    c.close()

    # The committed group resumes at the end; a replay (group=None) and read_all start at 0.
    c = bus.consumer(g, [topic])
    wait_for(lambda: len(c.assignment()) == 2, [c])
    assert c.committed() == {(topic, p): e for p, e in bus.end_offsets(topic).items() if e}
    assert all(v == 0 for v in c.lag().values())
    c.close()
    replay = bus.consumer(None, [topic], start="earliest")
    again = collect(replay, 20)
    replay.commit()  # an ephemeral reader never commits: a no-op
    replay.close()
    assert sorted(ids(again)) == sorted(ids(first))
    assert {r.offset for r in again if r.partition == again[0].partition} >= {0}
    everything = list(bus.read_all(topic))
    assert sorted(ids(everything)) == sorted(ids(first))
    for p in (0, 1):
        offs = [r.offset for r in everything if r.partition == p]
        assert offs == list(range(len(offs)))
    assert [r.value for r in everything] == [r.value for r in sorted(first, key=lambda r: (r.partition, r.offset))]


def test_commit_halfway_then_resume_exactly(bus, new_topic):
    topic = new_topic(partitions=2)
    produce_keyed(bus, topic, ["a", "b", "c", "d"], per_key=6)  # 24 records
    g = group()
    c1 = bus.consumer(g, [topic])
    polled = collect(c1, 24)
    assert len(polled) == 24
    by_p = defaultdict(list)
    for r in polled:
        by_p[r.partition].append(r)
    assert len(by_p) == 2
    half = [r for recs in by_p.values() for r in recs[: len(recs) // 2]]  # a prefix per partition
    c1.commit(half)
    expect_committed = {}
    for r in half:
        expect_committed[(r.topic, r.partition)] = max(expect_committed.get((r.topic, r.partition), 0), r.offset + 1)
    assert c1.committed() == expect_committed
    c1.commit([by_p[0][0], by_p[1][0]])  # an older commit never moves the group back
    assert c1.committed() == expect_committed
    if hasattr(bus, "bootstrap"):  # Kafka: the broker agrees, asked by a plain confluent_kafka Consumer
        from tests.support.kafka import committed

        assert {(topic, p): o for p, o in committed(bus.bootstrap, g, topic).items()} == expect_committed
    c1.close()

    c2 = bus.consumer(g, [topic], start="latest")  # start applies only without a commit
    rest = collect(c2, 24 - len(half))
    assert sorted(ids(rest)) == sorted(set(ids(polled)) - set(ids(half))), "resume lost or repeated records"
    assert all(v == 0 for v in c2.lag().values())
    c2.commit(rest)
    c2.close()
    c3 = bus.consumer(g, [topic])
    bus.produce(topic, b"new", key=b"a")
    bus.flush()
    assert [r.value for r in collect(c3, 1)] == [b"new"]
    assert all(v == 0 for v in c3.lag().values())
    c3.close()


def test_start_latest_sees_only_new_records(bus, new_topic):
    topic = new_topic(partitions=2)
    produce_keyed(bus, topic, ["a", "b"], per_key=5)
    grouped = bus.consumer(group(), [topic], start="latest")
    reader = bus.consumer(None, [topic], start="latest")
    produce_keyed(bus, topic, ["x", "y", "z"], per_key=1)
    for c in (grouped, reader):
        new = collect(c, 3)
        assert sorted(r.value for r in new) == [b"x:0", b"y:0", b"z:0"]
        assert all(v == 0 for v in c.lag().values())
        c.close()


def test_explicit_start_offsets_apply_regardless_of_commits(bus, new_topic):
    topic = new_topic(partitions=1)
    for i in range(10):
        bus.produce(topic, b"%d" % i)
    bus.flush()
    c = bus.consumer(None, [topic], start={topic: 4})
    assert [r.offset for r in collect(c, 6)] == [4, 5, 6, 7, 8, 9]
    c.close()

    g = group()
    c = bus.consumer(g, [topic])
    c.commit(collect(c, 8))
    c.close()
    c = bus.consumer(g, [topic], start={(topic, 0): 2})  # seeks back past the commit
    assert [r.value for r in collect(c, 8)] == [b"%d" % i for i in range(2, 10)]
    c.seek(topic, 0, 7)
    assert [r.offset for r in collect(c, 3)] == [7, 8, 9]
    c.close()

    c = bus.consumer(None, [topic], start={topic: 1000})  # past the end: clamped to the end
    assert c.lag() == {(topic, 0): 0}
    bus.produce(topic, b"10")
    bus.flush()
    assert [r.offset for r in collect(c, 1)] == [10]
    with pytest.raises(BusError):
        c.seek(topic, 5, 0)  # not assigned
    c.close()
    c = bus.consumer(None, [topic])
    c.seek(topic, 0, 8)  # before the first poll (Kafka: the partition is not fetching yet)
    assert [r.offset for r in collect(c, 3)] == [8, 9, 10]
    c.close()
    with pytest.raises(ValueError):
        bus.consumer(None, [topic], start={"other-topic": 0})
    with pytest.raises(ValueError):
        bus.consumer(None, [topic], start="middle")


def test_lag_counts_records_behind(bus, new_topic):
    topic = new_topic(partitions=1)
    tp = (topic, 0)
    for i in range(10):
        bus.produce(topic, b"%d" % i)
    bus.flush()
    c = bus.consumer(None, [topic])
    assert c.assignment() == [tp]
    assert c.lag() == {tp: 10}
    assert len(collect(c, 4, max_records=4)) == 4
    assert c.lag() == {tp: 6}
    assert len(collect(c, 6)) == 6
    assert c.lag() == {tp: 0}
    for _ in range(3):
        bus.produce(topic, b"x")
    bus.flush()
    assert c.lag() == {tp: 3}
    c.close()

    g = group()
    c = bus.consumer(g, [topic])
    c.commit(collect(c, 5))
    c.close()
    c = bus.consumer(g, [topic])
    got = collect(c, 2, max_records=1)
    assert [r.offset for r in got] == [5, 6]
    assert c.lag() == {tp: 13 - 7}
    c.close()


# -- payloads -----------------------------------------------------------------------------------

def test_large_payload_round_trip(bus, new_topic):
    topic = new_topic(partitions=1)
    big = os.urandom(3 * 1024 * 1024 + 17)
    bus.produce(topic, big, key=b"k", headers={"h": b"v"})
    bus.produce(topic, b"small")
    bus.flush()
    c = bus.consumer(None, [topic])
    got = collect(c, 2)
    c.close()
    assert got[0].value == big and got[0].headers == {"h": b"v"}
    assert got[1].value == b"small"


def test_oversize_record_is_refused_whole(bus, new_topic):
    topic = new_topic(partitions=1)
    with pytest.raises(RecordTooLargeError) as e:
        bus.produce(topic, bytes(MAX + 1024))
        bus.flush()
    assert topic in str(e.value) and "bytes" in str(e.value)

    # A topic's own max.message.bytes (the schema topic's is 1 MiB) counts as well.
    small = new_topic(partitions=1, config={"max.message.bytes": str(1024 * 1024)})
    with pytest.raises(RecordTooLargeError) as e:
        bus.produce(small, bytes(1536 * 1024))
        bus.flush()
    assert small in str(e.value)
    assert bus.end_offsets(topic) == {0: 0} and bus.end_offsets(small) == {0: 0}

    bus.produce(topic, b"fine")
    bus.produce(small, b"fine")
    bus.flush()  # the failure was raised once; the bus goes on
    for t in (topic, small):
        assert [(r.offset, r.value) for r in bus.read_all(t)] == [(0, b"fine")]


def test_headers_keys_and_empty_values_round_trip(bus, new_topic):
    topic = new_topic(partitions=1)
    headers = {"rl-schema": b"rlstream.SampleBatch/1", "empty": b"", "bin": bytes(range(256))}
    bus.produce(topic, b"v", key=b"k", headers=headers)
    bus.produce(topic, b"", key=None)
    bus.produce(topic, bytearray(b"ba"))
    bus.flush()
    got = list(bus.read_all(topic))
    assert [(r.key, r.value, r.headers) for r in got] == [(b"k", b"v", headers), (None, b"", {}), (None, b"ba", {})]
    assert all(r.timestamp_ms > 1_600_000_000_000 for r in got)
    with pytest.raises(TypeError):
        bus.produce(topic, "not bytes")


def test_unknown_topic_is_created_on_first_use(bus, new_topic):
    topic = new_topic(create=False)  # a name nobody created
    c = bus.consumer(None, [topic])
    assert c.assignment() == [(topic, 0)] and bus.end_offsets(topic) == {0: 0}
    bus.produce(topic, b"first")
    bus.flush()
    assert [r.value for r in collect(c, 1)] == [b"first"]
    c.close()


def test_delivery_failure_is_raised_not_lost(bus, new_topic):
    topic = new_topic(partitions=1)
    with pytest.raises(BusError):
        bus.produce(topic, b"x", partition=7)  # no such partition
        bus.flush()
    bus.produce(topic, b"ok")
    bus.flush()  # raised once, then the bus goes on
    assert [r.value for r in bus.read_all(topic)] == [b"ok"]
    if bus.name == "kafka":  # failed at delivery, counted (memory refuses it in produce)
        assert bus.delivery_failures == 1


def test_on_delivery_reports_each_record_once_acknowledged_or_failed(bus, new_topic):
    """A record's ``on_delivery`` hears once of it: the error's text when its delivery failed
    (raised by the flush), None when the log holds it (settled by the flush that returns)."""
    topic = new_topic(partitions=1)
    reports: list[tuple[int, str | None]] = []
    if bus.name == "kafka":  # (memory refuses a bad partition in produce itself: no record, no report)
        with pytest.raises(BusError):  # the producer has no metadata of it yet: fails at delivery
            bus.produce(topic, b"x", partition=7, on_delivery=lambda err: reports.append((7, err)))
            bus.flush()
        assert [i for i, _ in reports] == [7] and "PARTITION" in (reports[0][1] or "").upper(), reports
        assert bus.delivery_failures == 1  # the bus's own accounting still sees it
        reports.clear()
    for i in range(5):
        bus.produce(topic, b"v%d" % i, on_delivery=lambda err, i=i: reports.append((i, err)))
    bus.flush()
    assert sorted(reports) == [(i, None) for i in range(5)]
    assert [r.value for r in bus.read_all(topic)] == [b"v%d" % i for i in range(5)]


def test_closed_bus_refuses_produce(bus, new_topic):
    topic = new_topic(partitions=1)
    bus.close()
    with pytest.raises(BusError):
        bus.produce(topic, b"late")


def test_commit_of_unpolled_or_foreign_partitions_is_ignored(bus, new_topic):
    topic = new_topic(partitions=1)
    bus.produce(topic, b"0")
    bus.flush()
    g = group()
    c = bus.consumer(g, [topic])
    got = collect(c, 1)
    foreign = Record("some-other-topic", 0, 41, None, b"")
    c.commit([foreign])
    c.commit([])
    assert c.committed() == {}
    c.commit(got)
    assert c.committed() == {(topic, 0): 1}
    c.close()
    with pytest.raises(BusError):
        c.poll(0)


# -- typed events and dead letters --------------------------------------------------------------

def test_event_bus_dead_letters_bad_records_and_keeps_going(bus, new_topic):
    topic, dlq = new_topic(partitions=1), new_topic(partitions=1, tag="dlq")
    codec = Codec()
    events = EventBus(bus, codec, dead_letter_topic=dlq)
    good = [sample_batch(seq=i, seed=i) for i in range(3)]
    encoded = codec.encode(good[0])
    grad = next(e for e in example_events() if type(e).__name__ == "GradientStep")
    nan = dataclasses.replace(good[0], rewards=np.full_like(good[0].rewards, np.nan), seq=9)
    bad = {
        "garbage": (b"\x00\x01garbage bytes that are no event", "corrupt"),
        "truncated": (encoded[: len(encoded) // 2], "corrupt"),
        "unknown": (MAGIC + b"\xde\xad\xbe\xef\x00\x00\x00\x01" + encoded[10:], "unknown_schema"),
        "wrong_type": (codec.encode(grad), "wrong_type"),
        "nan": (codec.encode(nan), "invalid"),
    }
    events.publish(topic, good[0], key="actor-0")
    for value, _ in bad.values():
        bus.produce(topic, value, key=b"actor-0")
    events.publish(topic, good[1], key=b"actor-0")
    events.flush()

    c = events.consumer(group(), [topic], stage="test", expect=SampleBatch)
    seen = []
    deadline = time.monotonic() + WAIT
    while len(seen) < 2 and time.monotonic() < deadline:
        seen += c.poll(0.2)
    assert [ev.seq for _, ev in seen] == [0, 1]
    assert [rec.offset for rec, _ in seen] == [0, 6]
    events.publish(topic, good[2], key="actor-0")  # still running after the bad ones
    events.flush()
    later = []
    deadline = time.monotonic() + WAIT
    while not later and time.monotonic() < deadline:
        later += c.poll(0.2)
    assert [ev.seq for _, ev in later] == [2]
    c.commit()
    c.close()

    letters = [codec.decode(r.value, DeadLetter) for r in bus.read_all(dlq)]
    assert [(d.offset, d.reason) for d in letters] == [(i + 1, reason) for i, (_, reason) in enumerate(bad.values())]
    for d, (value, _) in zip(letters, bad.values(), strict=True):
        assert d.topic == topic and d.partition == 0 and d.value == value and d.key == b"actor-0"
        assert d.stage == "test" and d.error_class.endswith("Error") and d.detail
    assert events.dead_letters.counts == {"corrupt": 2, "unknown_schema": 1, "wrong_type": 1, "invalid": 1}


def test_group_lag_counts_what_the_group_has_not_committed(bus, new_topic):
    topic = new_topic()
    for i in range(5):
        bus.produce(topic, b"v%d" % i, key=b"k")
    bus.flush()
    assert bus.group_lag(f"never-joined-{uuid.uuid4().hex[:6]}", topic) == 5
    group = f"lagger-{uuid.uuid4().hex[:6]}"
    c = bus.consumer(group, [topic], start="earliest")
    got = []
    deadline = time.monotonic() + 20
    while len(got) < 3 and time.monotonic() < deadline:
        got += c.poll(0.5, max_records=3 - len(got))
    c.commit(got[:3])
    assert bus.group_lag(group, topic) == 2
    c.close()
