"""A broker paused (SIGSTOP) in the middle of a bounded read, on a private real broker: the reader
returns the whole range or raises ``IncompleteReadError`` naming the gap, never a short range
(issue 39, part 1).

The reader's client is held to small fetches with almost no prefetch, so the range takes many
fetches; the broker is stopped right after the reader's first records arrived (a hook on its
first non-empty poll), and either resumed after a few empty polls of the reader (it must then
finish the range) or left stopped until the reader gives up (it must raise)."""

from __future__ import annotations

import os
import signal

import pytest

from streams.bus.base import IncompleteReadError
from streams.bus.kafka import KafkaBus
from streams.policy.tail import _read_range, tail_offsets
from streams.topics import TopicSpec

pytestmark = [pytest.mark.kafka]

TOPIC = "t-partial-reads"
N = 150
#: one record per fetch, and next to nothing fetched ahead of the reader
SMALL_FETCHES = {"fetch.max.bytes": 1024, "message.max.bytes": 1024, "max.partition.fetch.bytes": 1024,
                 "queued.max.messages.kbytes": 1, "queued.min.messages": 1, "fetch.queue.backoff.ms": 0,
                 "fetch.wait.max.ms": 10}


class _Hooked:
    def __init__(self, inner, bus: "PausingReader") -> None:
        self.inner, self.bus = inner, bus

    def poll(self, timeout: float = 1.0, max_records: int = 500):
        recs = self.inner.poll(timeout, max_records)
        b = self.bus
        if recs and not b.stopped_at and not b.resumed:
            os.kill(b.pid, signal.SIGSTOP)
            b.stopped_at = sum(1 for _ in recs)
        elif not recs and b.stopped_at and not b.resumed:
            b.empty_polls += 1
            if b.resume_after is not None and b.empty_polls >= b.resume_after:
                os.kill(b.pid, signal.SIGCONT)
                b.resumed = True
        return recs

    def __getattr__(self, name):
        return getattr(self.inner, name)


class PausingReader(KafkaBus):
    """A KafkaBus whose readers SIGSTOP the broker after their first records, and SIGCONT it after
    ``resume_after`` empty polls (None: the test resumes it)."""

    def __init__(self, bootstrap: str, pid: int, resume_after: int | None) -> None:
        super().__init__(bootstrap, client_id="partial-reader", consumer_config=SMALL_FETCHES)
        self.pid, self.resume_after = pid, resume_after
        self.stopped_at = self.empty_polls = 0
        self.resumed = False

    def consumer(self, group, topics, start="earliest"):
        return _Hooked(super().consumer(group, topics, start), self)


def _fill(bootstrap: str) -> dict[int, int]:
    with KafkaBus(bootstrap, client_id="filler", producer_config={"linger.ms": 0, "batch.num.messages": 1}) as bus:
        bus.create_topics([TopicSpec(TOPIC, key="test", partitions=1)])
        for i in range(N):
            bus.produce(TOPIC, b"%c%04d" % (b"pq"[i % 2], i) + b"." * 600, key=b"k")
        bus.flush()
        return bus.end_offsets(TOPIC)


@pytest.fixture
def broker(private_kafka):
    """The private broker, filled; resumed at the end whatever the test did to it."""
    ends = _fill(private_kafka.bootstrap)
    assert ends == {0: N}
    try:
        yield private_kafka, ends
    finally:
        os.kill(private_kafka.kafka.pid, signal.SIGCONT)


@pytest.mark.parametrize("read", ["range", "read_all"])
def test_a_broker_paused_mid_read_and_resumed_gives_the_whole_range(broker, read):
    kafka, ends = broker
    bus = PausingReader(kafka.bootstrap, kafka.kafka.pid, resume_after=5)
    try:
        bus.end_offsets(TOPIC)  # metadata before the pause: the read itself meets it
        if read == "range":
            got = [r.offset for r in _read_range(bus, TOPIC, 0, 0, N, ends, timeout=60.0)]
        else:
            got = [r.offset for r in bus.read_all(TOPIC, timeout=60.0)]
        assert 0 < bus.stopped_at < N and bus.resumed, "the broker was not paused mid-read"
        assert got == list(range(N))
    finally:
        bus.close()


@pytest.mark.parametrize("read", ["range", "tail", "read_all"])
def test_a_broker_paused_past_the_readers_deadline_is_an_error_naming_the_gap(broker, read):
    kafka, ends = broker
    bus = PausingReader(kafka.bootstrap, kafka.kafka.pid, resume_after=None)
    got: list[int] = []
    try:
        bus.end_offsets(TOPIC)
        with pytest.raises(IncompleteReadError) as e:
            if read == "range":
                got = [r.offset for r in _read_range(bus, TOPIC, 0, 0, N, ends, timeout=3.0)]
            elif read == "tail":  # the oldest "p" record: every window back to offset 0
                tail_offsets(bus, TOPIC, lambda r: r.value[:1] == b"p", timeout=3.0, count=N)
            else:
                got.extend(r.offset for r in bus.read_all(TOPIC, timeout=3.0))
        assert 0 < bus.stopped_at < N, "the broker was not paused mid-read"
        err = e.value
        assert err.topic == TOPIC and err.partition == 0 and err.reached < err.expected_end
        assert f"{TOPIC}[0] reached offset {err.reached}, not the end offset {err.expected_end}" in str(err)
        assert got == list(range(len(got)))  # what read_all yielded before the error: a prefix, in order
    finally:
        os.kill(kafka.kafka.pid, signal.SIGCONT)
        bus.close(timeout=30)
