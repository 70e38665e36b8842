"""Retriable Kafka errors are retried inside the bus, with a deadline; ``create_topics`` returns
only once every partition has a leader."""

from __future__ import annotations

import time
import uuid

import pytest
from confluent_kafka import KafkaError, KafkaException

from streams.bus.base import BusError
from streams.bus.kafka import KafkaBus
from streams.bus.kafka.errors import is_retriable, retrying
from streams.topics import TopicSpec


FAST_GROUP = {"heartbeat.interval.ms": 500, "session.timeout.ms": 6000}  # notice rebalances fast


@pytest.mark.parametrize("code", [
    KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE, KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaError.NOT_COORDINATOR,
    KafkaError.REQUEST_TIMED_OUT, KafkaError._TIMED_OUT, KafkaError._TRANSPORT,
])
def test_settling_cluster_errors_are_retriable(code):
    assert is_retriable(KafkaError(code))
    assert not is_retriable(KafkaError(code, fatal=True))


@pytest.mark.parametrize("code", [
    KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.INVALID_REPLICATION_FACTOR, KafkaError.INVALID_CONFIG,
    KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.TOPIC_ALREADY_EXISTS, KafkaError._AUTHENTICATION,
])
def test_errors_of_a_wrong_request_are_not(code):
    assert not is_retriable(KafkaError(code))


def _failing(errors, result="ok"):
    """A call that raises (or returns) each of ``errors`` in turn, then returns ``result``."""
    left = list(errors)
    calls = []

    def call(timeout):
        calls.append(timeout)
        if left:
            err = left.pop(0)
            if isinstance(err, tuple):  # returned in place of a result (per-partition errors)
                return err[0]
            raise KafkaException(err)
        return result
    return call, calls


def test_retrying_rides_out_retriable_errors():
    call, calls = _failing([KafkaError(KafkaError.NOT_LEADER_FOR_PARTITION),
                            (KafkaError(KafkaError.COORDINATOR_LOAD_IN_PROGRESS),),
                            KafkaError(KafkaError.LEADER_NOT_AVAILABLE)])
    assert retrying("read offsets", call, timeout=30) == "ok"
    assert len(calls) == 4 and all(0 < t <= 30 for t in calls)


def test_each_attempt_gets_at_most_its_cap_of_what_remains():
    """A request to a dead leader waits out the seconds it is given: with ``attempt`` each try
    is cut short and asked again (where fresh metadata points), within the same deadline."""
    call, calls = _failing([KafkaError(KafkaError._TIMED_OUT)] * 2)
    assert retrying("read offsets", call, timeout=30, attempt=2.5) == "ok"
    assert len(calls) == 3 and all(0 < t <= 2.5 for t in calls)
    call, calls = _failing([])
    assert retrying("read offsets", call, timeout=30) == "ok" and calls[0] > 2.5  # no cap: what remains


def test_retrying_raises_other_errors_at_once():
    call, calls = _failing([KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)])
    with pytest.raises(BusError, match="read offsets.*TOPIC_AUTHORIZATION_FAILED"):
        retrying("read offsets", call, timeout=30)
    assert len(calls) == 1


def test_retrying_gives_up_at_its_deadline():
    """It retries, then gives up by its 0.5 s deadline, long before the 10,000 failures run out
    (a deadline poll: a retrying that ignored its deadline fails here at 5 s)."""
    import threading

    from testbed.wait import wait_for

    call, calls = _failing([KafkaError(KafkaError.NOT_LEADER_FOR_PARTITION)] * 10_000)
    out: dict = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            out["result"] = retrying("read offsets", call, timeout=0.5)
        except BusError as e:
            out["error"] = e
        out["took"] = time.monotonic() - t0

    threading.Thread(target=run, daemon=True).start()
    wait_for(lambda: "took" in out, 5, "retrying to give up at its 0.5 s deadline", every=0.02)
    assert "NOT_LEADER_FOR_PARTITION" in str(out.get("error")), out
    assert len(calls) > 1, out


@pytest.mark.kafka
def test_fresh_topics_are_usable_at_once(kafka_bootstrap):
    """Offsets, produce, consume, group offsets right after create_topics: no retriable error
    reaches the caller (several topics of several partitions, so leaders are elected late)."""
    names = [f"t-fresh-{uuid.uuid4().hex[:10]}" for _ in range(6)]
    with KafkaBus(kafka_bootstrap, client_id="rlstream-test", consumer_config=FAST_GROUP) as bus:
        try:
            bus.create_topics([TopicSpec(n, key="test", partitions=4) for n in names])
            with KafkaBus(kafka_bootstrap, client_id="rlstream-test-2") as other:  # knows nothing cached
                for n in names:
                    assert other.end_offsets(n) == {0: 0, 1: 0, 2: 0, 3: 0}
                    assert other.group_lag(f"g-{n}", n) == 0
            for n in names:
                for p in range(4):
                    bus.produce(n, b"x", key=b"k", partition=p)
            bus.flush()
            for n in names:
                assert bus.end_offsets(n) == {0: 1, 1: 1, 2: 1, 3: 1}
            with bus.consumer(f"g-{names[0]}", [names[0]]) as c:
                got: list = []
                deadline = time.monotonic() + 60
                while len(got) < 4 and time.monotonic() < deadline:
                    got += c.poll(0.5)
                assert len(got) == 4
                c.commit(got)
                assert c.committed() == {(names[0], p): 1 for p in range(4)}
            assert bus.group_lag(f"g-{names[0]}", names[0]) == 0
        finally:
            bus.delete_topics(names)
