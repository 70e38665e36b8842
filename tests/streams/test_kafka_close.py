"""``KafkaConsumer.close`` has a deadline: librdkafka's close (a group leave) can hang while the
broker is gone, and a role closing its consumers must not hang with it."""

from __future__ import annotations

import logging
import threading

from streams.bus.kafka import consumer as consumer_module
from streams.bus.kafka.consumer import KafkaConsumer
from streams.bus.kafka.errors import ErrorLog


class _HangingClient:
    """A librdkafka consumer whose ``close`` blocks until released."""

    def __init__(self) -> None:
        self.release, self.entered, self.closed = threading.Event(), threading.Event(), threading.Event()

    def close(self) -> None:
        self.entered.set()
        self.release.wait()
        self.closed.set()


def _consumer(client) -> KafkaConsumer:
    c = KafkaConsumer.__new__(KafkaConsumer)  # no broker: only what close touches
    c.group, c.topics, c._closed, c._inflight, c._c = "g", ["t"], False, None, client
    return c


def test_close_returns_at_its_deadline_and_logs_once(caplog, monkeypatch):
    monkeypatch.setattr(consumer_module, "ERRORS", ErrorLog())  # no line of an earlier test held back
    client = _HangingClient()
    c = _consumer(client)
    with caplog.at_level(logging.WARNING, logger="streams.bus.kafka"):
        c.close(timeout=0.2)
        c.close(timeout=0.2)  # closed already: returns at once, no second line
    assert client.entered.is_set() and not client.closed.is_set()
    lines = [r.getMessage() for r in caplog.records if "not closed within" in r.getMessage()]
    assert len(lines) == 1 and "group g" in lines[0]
    client.release.set()  # the background close finishes on its own
    assert client.closed.wait(5)


def test_close_within_its_deadline_logs_nothing(caplog):
    client = _HangingClient()
    client.release.set()
    with caplog.at_level(logging.WARNING, logger="streams.bus.kafka"):
        _consumer(client).close(timeout=5)
    assert client.closed.is_set() and not caplog.records
