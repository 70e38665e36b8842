"""A broker outage under a running producer and consumer logs a bounded number of lines: one
per error kind per interval with a count (``streams.bus.kafka.errors.ErrorLog``), and one line when
the connection recovers. A flush started during the outage waits for the broker past its own
timeout (``KafkaBus.outage_wait``) and delivers."""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections import Counter

import pytest

from streams.bus.base import BusError
from streams.bus.kafka import KafkaBus
from streams.bus.kafka.clients import OUTAGE_WAIT_S
from streams.bus.kafka.errors import ERRORS, LOG_INTERVAL_S
from streams.topics import TopicSpec

from .conftest import FAST_CONSUMER, wait_for

pytestmark = pytest.mark.kafka
LOGGERS = ("rlstream.librdkafka", "streams.bus.kafka")


def test_broker_outage_logs_few_lines_and_one_recovery(private_kafka, caplog):
    topic = f"t-outage-{uuid.uuid4().hex[:8]}"
    # outage_wait=0: a flush gives up at its timeout, so the loop keeps consuming meanwhile
    bus = KafkaBus(private_kafka.bootstrap, client_id="rlstream-test", consumer_config=FAST_CONSUMER,
                   outage_wait=0)
    bus.create_topics([TopicSpec(topic, key="test", partitions=1)])
    consumer = bus.consumer("g-outage", [topic])
    got: list = []
    patient_flush: list = []

    def step() -> None:
        """What a role does: produce, try to deliver, consume."""
        bus.produce(topic, b"x", key=b"k")
        try:
            bus.flush(0.3)
        except BusError:
            pass  # undelivered while the broker is down: librdkafka keeps them queued
        got.extend(consumer.poll(0.2))

    def outage_lines() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name in LOGGERS and r.levelno >= logging.WARNING]

    try:
        wait_for(lambda: step() or len(got) >= 3, 60, "records flowing before the outage", every=0)
        patient = KafkaBus(private_kafka.bootstrap, client_id="rlstream-test-patient")
        assert patient.partitions(topic) == 1  # it knows the topic before the outage
        caplog.clear()
        caplog.set_level(logging.WARNING)
        errors_before = ERRORS.count
        t_down = time.monotonic()
        private_kafka.kafka.kill()
        # Many client errors: every client reconnects again and again, librdkafka logs each.
        wait_for(lambda: step() or ERRORS.count - errors_before >= 60, 120,
                 "60 client errors during the outage", every=0)
        during = len(outage_lines())
        errors = ERRORS.count - errors_before
        # A role's flush (default outage_wait) outlasts its timeout while the broker is down.
        patient.produce(topic, b"during the outage", key=b"k")
        flusher = threading.Thread(target=lambda: patient_flush.append(_flush(patient, 1.0)))
        flusher.start()
        private_kafka.kafka.start(timeout=120)
        recovered = lambda: [r for r in outage_lines() if "recovered after" in r.getMessage()]  # noqa: E731
        wait_for(lambda: step() or recovered(), 120, "a 'recovered' line after the restart", every=0,
                 on_timeout=lambda: "\n".join(r.getMessage() for r in outage_lines()))
        outage_s = time.monotonic() - t_down
        n = len(got)
        wait_for(lambda: step() or len(got) > n, 60, "records flowing after the outage", every=0)
        flusher.join(OUTAGE_WAIT_S)
        patient.close(timeout=10)
    finally:
        consumer.close()
        bus.close(timeout=10)
    lines = outage_lines()
    print(f"OUTAGE client errors={errors} lines during outage={during} total lines={len(lines)}")
    print("\n".join(f"{r.name}: {r.getMessage()}" for r in lines))
    assert errors >= 60 and during <= errors // 5, (errors, during)
    # One line per error kind (client names and numbers aside) per interval, with its count.
    kinds = Counter(re.sub(r" \(\+\d+ more like it.*\)$|\[[^\]]*\]|\d+", "", r.getMessage()) for r in lines)
    per_kind = int(outage_s // LOG_INTERVAL_S) + 2
    assert max(kinds.values()) <= per_kind, kinds
    # The lines not logged are counted: in a later interval's "+N more like it", or at least in
    # the recovery line's "(N not logged)" when the outage ended within one interval.
    unlogged = [int(m[1]) for r in recovered() if (m := re.search(r"\((\d+) not logged\)", r.getMessage()))]
    assert any("more like it" in r.getMessage() for r in lines) or (unlogged and unlogged[0] > 0), unlogged
    assert len(recovered()) == 1
    assert patient_flush == ["delivered"], patient_flush


def _flush(bus: KafkaBus, timeout: float) -> str:
    try:
        bus.flush(timeout)
        return "delivered"
    except BusError as e:
        return f"failed: {e}"
