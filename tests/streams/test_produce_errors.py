"""The broker's produce error codes, from librdkafka's ``MSGSET`` debug lines (the only report of
an error it retries), counted by name and handed to a role's metrics."""

from __future__ import annotations

from runtime.metrics import Metrics
from streams.bus.kafka.clients import PRODUCER_DEFAULTS
from streams.bus.kafka.produce_errors import PRODUCE_DEBUG, ProduceErrors

LINE = ("127.0.0.1:29094/2: ns.rl.samples.raw [0]: MessageSet with 1 message(s) (MsgId 2, BaseSeq 1) "
        "encountered error: {} (actions Retry,MsgNotPersisted)")


def test_codes_by_name_and_the_metric_moves():
    errors, m = ProduceErrors(), Metrics(role="actor", gpu=False)
    errors.listen(m.count_produce_error)
    errors.listen(m.count_produce_error)  # once per method
    assert errors.note("MSGSET", LINE.format("Broker: Not enough in-sync replicas")) == "NOT_ENOUGH_REPLICAS"
    assert errors.note("MSGSET", LINE.format("Broker: Message(s) written to insufficient number of in-sync "
                                             "replicas")) == "NOT_ENOUGH_REPLICAS_AFTER_APPEND"
    assert errors.note("MSGSET", LINE.format("Broker: Request timed out")) == "REQUEST_TIMED_OUT"
    assert errors.note("MSGSET", "ns.rl.samples.raw [0]: MessageSet with 1 message(s) (MsgId 1) delivered") is None
    assert errors.note("FAIL", LINE.format("Broker: Not enough in-sync replicas")) is None  # another facility
    assert errors.counts() == {"NOT_ENOUGH_REPLICAS": 1, "NOT_ENOUGH_REPLICAS_AFTER_APPEND": 1, "REQUEST_TIMED_OUT": 1}
    text = m.render().decode()
    assert 'rlstream_produce_errors_total{code="NOT_ENOUGH_REPLICAS",role="actor"} 1.0' in text
    del m  # held weakly: a dropped Metrics is no longer told
    errors.note("MSGSET", LINE.format("Broker: Not enough in-sync replicas"))
    assert errors.counts()["NOT_ENOUGH_REPLICAS"] == 2


def test_producers_run_with_the_context_that_reports_them():
    assert PRODUCER_DEFAULTS["debug"] == PRODUCE_DEBUG == "msg"
