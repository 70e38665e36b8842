"""The bus: one small interface over an append-only partitioned log, two backends.

    bus = make_bus("memory")                      # or "kafka" with bootstrap servers
    bus.create_topics(all_topics())
    bus.produce(SAMPLES_RAW, value, key=b"actor-0", headers={"rl-schema": b"..."})
    c = bus.consumer("learner", [SAMPLES_PREPARED], start="earliest")
    while running:
        for rec in c.poll(timeout=0.1):
            handle(rec)
        c.commit()                                # commits what poll returned

Semantics both backends keep (tests/streams/test_bus_contract.py checks them):
- order is kept per partition; a key always maps to the same partition;
- each consumer group sees every record once per assignment; two groups are independent;
- ``start`` applies only where the group has no committed offset ("earliest", "latest"),
  or, as ``{(topic, partition): offset}`` / ``{topic: offset}``, seeks there regardless;
- ``commit`` stores the offset after the last record returned (per partition);
  a new consumer of the group resumes there;
- ``group=None`` is an ephemeral reader: it never commits (replay).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Union

from config.env import ENV_REPLICATION_FACTOR

StartAt = Union[str, dict]  # "earliest" | "latest" | {(topic, partition): offset} | {topic: offset}
TP = tuple[str, int]


class BusError(Exception):
    """The bus backend failed (broker unreachable, delivery failed, record too large...)."""


class IncompleteReadError(BusError):
    """A bounded read stopped short of the end offset it was asked to reach (the broker paused or
    slow past the reader's deadline): never returned as if it were the whole range."""

    def __init__(self, topic: str, partition: int, expected_end: int, reached: int, timeout: float) -> None:
        super().__init__(f"read of {topic}[{partition}] reached offset {reached}, not the end offset {expected_end} "
                         f"it was asked for: no progress for {timeout:.0f}s (offsets {reached}..{expected_end - 1} "
                         "missing; broker slow or unreachable)")
        self.topic, self.partition, self.expected_end, self.reached = topic, partition, expected_end, reached


class WriterFencedError(BusError):
    """A newer writer of the same transactional identity (a restarted learner) has taken over:
    the broker refuses this one's writes for good. Stop; a retry would fence the newer one."""


#: The exit status of a process stopped by ``WriterFencedError``: not restarted (the supervisor).
EXIT_FENCED = 4


class RecordTooLargeError(BusError):
    """A record exceeds the configured maximum message size."""


class BusAuthenticationError(BusError):
    """The broker refused this client's credentials (SASL / SSL): a setting to fix, not a
    fault to wait out."""


class ReplicationError(BusError):
    """Topics were to be made with more copies than the cluster has brokers: refused before the
    broker is asked, naming the setting, the factor and the broker count."""

    def __init__(self, factor: int, brokers: int, bootstrap: str, topics: list[str]) -> None:
        super().__init__(
            f"{ENV_REPLICATION_FACTOR}={factor} asks for {factor} copies of every topic, but the Kafka "
            f"cluster at {bootstrap} has {brokers} broker{'s' if brokers != 1 else ''} alive: cannot create "
            f"{', '.join(topics)}. Start a cluster of at least {factor} brokers (rlstream broker start "
            f"--nodes {factor}), or set {ENV_REPLICATION_FACTOR}={brokers} (docs/deploy.md)")
        self.factor, self.brokers, self.topics = factor, brokers, topics


@dataclass(frozen=True, slots=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    headers: dict[str, bytes] = field(default_factory=dict)
    timestamp_ms: int = 0


def normalise_start(start: StartAt, topics: Iterable[str]) -> tuple[str, dict[TP, int] | dict[str, int]]:
    """Split ``start`` into the reset policy and explicit offsets."""
    if isinstance(start, str):
        if start not in ("earliest", "latest"):
            raise ValueError(f"start must be 'earliest', 'latest' or an offsets dict, not {start!r}")
        return start, {}
    if isinstance(start, dict):
        topics = set(topics)
        for k in start:
            t = k[0] if isinstance(k, tuple) else k
            if t not in topics:
                raise ValueError(f"start offset for {k!r}, which is not subscribed")
        return "earliest", dict(start)
    raise TypeError(f"start must be a str or dict, not {type(start).__name__}")


def explicit_offset(offsets: dict, topic: str, partition: int) -> int | None:
    if (topic, partition) in offsets:
        return offsets[(topic, partition)]
    return offsets.get(topic)


class Consumer(ABC):
    @abstractmethod
    def poll(self, timeout: float = 1.0, max_records: int = 500) -> list[Record]:
        """Up to ``max_records`` records; waits up to ``timeout`` s for the first one."""

    @abstractmethod
    def commit(self, records: Iterable[Record] | None = None, *, offsets: dict[TP, int] | None = None) -> None:
        """Commit past ``records`` (their highest offset per partition), or the next-offsets
        ``offsets`` per partition, or (neither) past everything polled. Commits never move back."""

    @abstractmethod
    def committed(self) -> dict[TP, int]:
        """The group's committed next-offset per assigned partition."""

    @abstractmethod
    def seek(self, topic: str, partition: int, offset: int) -> None:
        ...

    @abstractmethod
    def assignment(self) -> list[TP]:
        ...

    def position(self, topic: str, partition: int) -> int | None:
        """The offset the next read of ``topic[partition]`` starts from (None: not known). On a
        log with transaction markers it moves past the markers, which no poll returns."""
        return None

    @abstractmethod
    def lag(self) -> dict[TP, int]:
        """Records between this consumer's position and the log end, per assigned partition."""

    @abstractmethod
    def close(self) -> None:
        ...

    def __enter__(self) -> "Consumer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Bus(ABC):
    """A partitioned append-only log with consumer groups."""

    name: str = "bus"

    @abstractmethod
    def create_topics(self, specs: Iterable) -> None:
        """Create topics (``streams.topics.TopicSpec``) that do not exist yet."""

    @abstractmethod
    def produce(
        self,
        topic: str,
        value: bytes,
        key: bytes | None = None,
        headers: dict[str, bytes] | None = None,
        partition: int | None = None,
        on_delivery: Callable[[str | None], None] | None = None,
    ) -> None:
        """Append a record. ``on_delivery``, if given, is called once for it: with None when the
        log holds it durably (Kafka: the broker acknowledged it, at the producer's ``acks``), or
        with the error's text when its delivery failed for good. Kafka calls it from inside a
        later ``produce``, ``flush`` or ``close`` of this bus (every record is settled by a
        ``flush`` that returns or raises); memory calls it before ``produce`` returns."""

    @abstractmethod
    def flush(self, timeout: float = 30.0) -> None:
        """Block until every produced record is durable in the log (raise BusError if not)."""

    @abstractmethod
    def consumer(self, group: str | None, topics: list[str], start: StartAt = "earliest") -> Consumer:
        ...

    @abstractmethod
    def end_offsets(self, topic: str) -> dict[int, int]:
        """Next offset to be written, per partition."""

    def log_start(self, topic: str, partition: int, timeout: float = 10.0) -> int:
        """The partition's oldest offset still held (retention moves it up). This default reads
        the first record there (``BusError`` if none comes within ``timeout``); the backends
        answer from their own bookkeeping."""
        import time

        ends = self.end_offsets(topic)
        if ends[partition] == 0:
            return 0
        c = self.consumer(None, [topic], start={(topic, q): (0 if q == partition else e) for q, e in ends.items()})
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                for r in c.poll(0.2, max_records=1):
                    if r.partition == partition:
                        return r.offset
        finally:
            c.close()
        raise BusError(f"the log start of {topic}[{partition}] was not read within {timeout:.0f}s")

    def group_lag(self, group: str, topic: str) -> int:
        """Records in ``topic`` that ``group`` has not committed yet (its backlog)."""
        raise NotImplementedError(f"{type(self).__name__} does not report group lag")

    @abstractmethod
    def close(self) -> None:
        ...

    def read_all(self, topic: str, timeout: float = 10.0) -> Iterator[Record]:
        """Every record now in ``topic``, from offset 0, in per-partition order (replay)."""
        ends = self.end_offsets(topic)
        if not any(ends.values()):
            return
        c = self.consumer(None, [topic], start="earliest")
        try:
            pending = {p: e for p, e in ends.items() if e > 0}
            reached = dict.fromkeys(pending, 0)
            import time

            deadline = time.monotonic() + timeout
            while pending:
                recs = c.poll(timeout=0.2)
                for r in recs:
                    if r.partition in pending and r.offset < pending[r.partition]:
                        yield r
                        reached[r.partition] = r.offset + 1
                for p in list(pending):  # the position also passes transaction markers
                    reached[p] = max(reached[p], c.position(topic, p) or 0)
                    if reached[p] >= pending[p]:
                        del pending[p]
                if not recs and time.monotonic() > deadline:
                    p = min(pending)
                    raise IncompleteReadError(topic, p, pending[p], reached[p], timeout)
                if recs:
                    deadline = time.monotonic() + timeout
        finally:
            c.close()

    def __enter__(self) -> "Bus":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
