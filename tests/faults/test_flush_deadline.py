"""A flush during a broker outage has a deadline and is not silent (issue 39, part 1): it waits
``outage_wait`` past its own timeout for the broker (records stay queued in librdkafka), says
every ``LOG_INTERVAL_S`` how many records are still waiting and when it gives up, then raises
``BusError`` naming both waits. (The synchronous commit's deadline: test_commit_errors.py.)"""

from __future__ import annotations

import logging
import threading
import time

import pytest

import streams.bus.kafka.producer as kafka_producer
from streams.bus.base import BusError
from streams.bus.kafka import KafkaBus
from streams.bus.kafka.errors import ERRORS
from streams.topics import TopicSpec

from .conftest import wait_for

pytestmark = pytest.mark.kafka
TOPIC = "t-flush-deadline"


def one_record_in_an_outage(private_kafka, client_id: str) -> KafkaBus:
    """A bus that delivered one record, then queued one more after the broker was killed, and
    has seen the outage."""
    bus = KafkaBus(private_kafka.bootstrap, client_id=client_id, outage_wait=4.0)
    bus.create_topics([TopicSpec(TOPIC, key="test", partitions=1)])
    bus.produce(TOPIC, b"before", key=b"k")
    bus.flush()
    private_kafka.kafka.kill()
    bus.produce(TOPIC, b"during", key=b"k")
    wait_for(lambda: bus._producer.poll(0.1) is not None and ERRORS.outage(), 60, "the producer to see the outage")
    return bus


def test_a_flush_in_an_outage_gives_up_by_its_deadline_and_says_so_meanwhile(private_kafka, monkeypatch, caplog):
    monkeypatch.setattr(kafka_producer, "LOG_INTERVAL_S", 1.0)
    # not closed at the end: its queued record can never be delivered (the broker stays down)
    bus = one_record_in_an_outage(private_kafka, "flush-deadline")
    caplog.clear()
    caplog.set_level(logging.WARNING, logger="streams.bus.kafka")
    t0 = time.monotonic()
    with pytest.raises(BusError) as e:
        bus.flush(1.0)
    took = time.monotonic() - t0
    assert 5.0 <= took < 20.0, f"gave up after {took:.1f}s, not at timeout + outage_wait"
    assert "1 record(s) not delivered within 1.0s" in str(e.value)
    assert "and 4s more while it was unreachable" in str(e.value)
    still = [r.getMessage() for r in caplog.records if "still not delivered" in r.getMessage()]
    assert 2 <= len(still) <= 5, still  # about one a second, not silent and not flooding
    assert all(m.startswith("1 record(s) still not delivered to ") and "giving up in" in m for m in still)


def test_a_recovery_elsewhere_in_the_process_does_not_cut_the_outage_wait_short(private_kafka, monkeypatch):
    """On a cluster below ``min.insync.replicas`` some nodes still answer: a round trip of another
    client of the process (a consumer, an offset read) recovers the process's error log while this
    bus's records still wait. The flush still waits out the outage (it counts the connection errors
    during it), not only the errors no round trip has recovered from yet (issue 39, part 3)."""
    monkeypatch.setattr(kafka_producer, "LOG_INTERVAL_S", 1.0)
    monkeypatch.setattr(ERRORS, "interval", 0.0)  # every recovery resets the log (not once per 10 s)
    bus = one_record_in_an_outage(private_kafka, "flush-recovered")
    live = threading.Event()

    def live_node() -> None:  # another client's round trips to a live node, all along
        while not live.wait(0.005):
            ERRORS.recovered()

    beside = threading.Thread(target=live_node, daemon=True)
    beside.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(BusError) as e:
            bus.flush(2.0)
    finally:
        live.set()
        beside.join(5)
    took = time.monotonic() - t0
    assert "and 4s more while it was unreachable" in str(e.value), f"gave up after {took:.1f}s: {e.value}"
    assert 6.0 <= took < 25.0, f"gave up after {took:.1f}s, not at timeout + outage_wait"
