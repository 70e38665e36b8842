"""``KafkaBus`` with a ``transactional_id`` over a scripted librdkafka producer: a flush commits
the records since the last one as one transaction; a retriable error is retried, an abortable
one aborts and writes the same records again, and a fenced writer stops with
``WriterFencedError`` (its close then raises nothing). The real broker's fencing:
``tests/faults/test_fenced_learner.py``."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException

from streams.bus.base import BusError, WriterFencedError
from streams.bus.kafka import KafkaBus

TOPIC = "t"


class ScriptedProducer:
    """The transactional calls of a librdkafka producer; ``commit_transaction`` raises the
    errors of ``commit_errors`` in turn, then succeeds."""

    def __init__(self, *commit_errors: KafkaError) -> None:
        self.commit_errors = list(commit_errors)
        self.calls: list[str] = []
        self.produced: list[bytes] = []

    def begin_transaction(self) -> None:
        self.calls.append("begin")

    def produce(self, topic, value=None, key=None, **kw) -> None:
        self.produced.append(value)

    def poll(self, timeout=0) -> int:
        return 0

    def commit_transaction(self, timeout) -> None:
        self.calls.append("commit")
        if self.commit_errors:
            raise KafkaException(self.commit_errors.pop(0))

    def abort_transaction(self, timeout) -> None:
        self.calls.append("abort")

    def __len__(self) -> int:
        return 0


def _bus(producer: ScriptedProducer) -> KafkaBus:
    bus = KafkaBus("127.0.0.1:1", transactional_id="ns.learner.policy.rank0", outage_wait=5.0)
    bus._producer_client = producer  # no broker: the scripted producer stands in
    bus._known[TOPIC] = 1
    return bus


def _publish(bus: KafkaBus, reports: list) -> None:
    for v in (b"version", b"step"):
        bus.produce(TOPIC, v, on_delivery=reports.append)
    bus.flush(1.0)


def test_records_between_flushes_are_one_transaction():
    p, reports = ScriptedProducer(), []
    bus = _bus(p)
    _publish(bus, reports)
    _publish(bus, reports)
    assert p.calls == ["begin", "commit", "begin", "commit"]
    assert reports == [None] * 4  # each record heard of once, when its transaction committed
    bus.close()


def test_a_retriable_commit_is_retried_and_an_abortable_one_written_again():
    timed_out = KafkaError(KafkaError._TIMED_OUT, "coordinator slow", retriable=True)
    expired = KafkaError(KafkaError._MSG_TIMED_OUT, "record timed out", txn_requires_abort=True)
    p, reports = ScriptedProducer(timed_out, expired), []
    bus = _bus(p)
    _publish(bus, reports)
    assert p.calls == ["begin", "commit", "commit", "abort", "begin", "commit"]
    assert p.produced == [b"version", b"step"] * 2  # the aborted transaction's records, once more
    assert reports == [None, None]  # not told of the aborted attempt
    bus.close()


def test_a_fenced_writer_stops_with_a_clear_error_and_closes_quietly():
    fenced = KafkaError(KafkaError._FENCED, "fenced by a newer instance", fatal=True)
    p, reports = ScriptedProducer(fenced), []
    bus = _bus(p)
    with pytest.raises(WriterFencedError, match="newer writer with transactional id 'ns.learner.policy.rank0'"):
        _publish(bus, reports)
    assert "abort" not in p.calls and reports == [reports[0]] * 2 and "fenced" in reports[0]
    bus.close()  # nothing it could deliver: no flush, no error


def test_a_commit_that_keeps_failing_gives_up_at_its_deadline():
    p = ScriptedProducer(*[KafkaError(KafkaError._TIMED_OUT, "no coordinator", retriable=True)] * 10_000)
    bus = _bus(p)
    bus.outage_wait = 0.3
    bus.produce(TOPIC, b"version")
    with pytest.raises(BusError, match="no coordinator"):
        bus.flush(0.2)
    assert p.calls[-1] == "abort"  # nothing left open
    bus._producer_client = None
    bus.close()
