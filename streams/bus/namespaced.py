"""A bus seen through a run namespace (``streams.topics.Namespace``).

Roles name topics and groups by their logical names (``SAMPLES_RAW``, ``"learner"``); this
wrapper maps them to the namespace's scoped names on the way in and maps the topics of the
records, offsets and assignments it returns back to logical names. So every role, tool and
test runs unchanged in any namespace, and only ``streams.topics`` knows how names are scoped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from streams.bus.base import TP, Bus, Consumer, Record, StartAt
from streams.offsets import next_offsets
from streams.topics import Namespace


class NamespacedConsumer(Consumer):
    def __init__(self, inner: Consumer, ns: Namespace) -> None:
        self.inner = inner
        self.ns = ns

    def _out(self, tps: dict[TP, int]) -> dict[TP, int]:
        return {(self.ns.logical(t), p): o for (t, p), o in tps.items()}

    def poll(self, timeout: float = 1.0, max_records: int = 500) -> list[Record]:
        return [replace(r, topic=self.ns.logical(r.topic)) for r in self.inner.poll(timeout, max_records)]

    def commit(self, records: Iterable[Record] | None = None, *, offsets: dict[TP, int] | None = None) -> None:
        if records is not None:
            nxt = next_offsets(records, key=lambda r: (self.ns.topic(r.topic), r.partition))
            if not nxt:
                return
            self.inner.commit(offsets=nxt)
        elif offsets is not None:
            self.inner.commit(offsets={(self.ns.topic(t), p): o for (t, p), o in offsets.items()})
        else:
            self.inner.commit()

    def committed(self) -> dict[TP, int]:
        return self._out(self.inner.committed())

    def seek(self, topic: str, partition: int, offset: int) -> None:
        self.inner.seek(self.ns.topic(topic), partition, offset)

    def assignment(self) -> list[TP]:
        return [(self.ns.logical(t), p) for t, p in self.inner.assignment()]

    def position(self, topic: str, partition: int) -> int | None:
        return self.inner.position(self.ns.topic(topic), partition)

    def lag(self) -> dict[TP, int]:
        return self._out(self.inner.lag())

    def close(self) -> None:
        self.inner.close()


class NamespacedBus(Bus):
    """``inner`` with every topic and group scoped by ``ns`` (see the module docstring)."""

    def __init__(self, inner: Bus, ns: Namespace) -> None:
        if not ns.name:
            raise ValueError("the legacy (empty) namespace needs no wrapper: use the bus itself")
        self.inner = inner
        self.ns = ns
        self.name = f"{inner.name}[{ns.name}]"

    def create_topics(self, specs: Iterable) -> None:
        self.inner.create_topics([replace(s, name=self.ns.topic(s.name)) for s in specs])

    def produce(self, topic: str, value: bytes, key: bytes | None = None,
                headers: dict[str, bytes] | None = None, partition: int | None = None,
                on_delivery=None) -> None:
        self.inner.produce(self.ns.topic(topic), value, key=key, headers=headers, partition=partition,
                           on_delivery=on_delivery)

    def flush(self, timeout: float = 30.0) -> None:
        self.inner.flush(timeout)

    def consumer(self, group: str | None, topics: list[str], start: StartAt = "earliest") -> Consumer:
        if isinstance(start, dict):
            start = {((self.ns.topic(k[0]), k[1]) if isinstance(k, tuple) else self.ns.topic(k)): v
                     for k, v in start.items()}
        inner = self.inner.consumer(None if group is None else self.ns.group(group),
                                    [self.ns.topic(t) for t in topics], start)
        return NamespacedConsumer(inner, self.ns)

    def end_offsets(self, topic: str) -> dict[int, int]:
        return self.inner.end_offsets(self.ns.topic(topic))

    def log_start(self, topic: str, partition: int, timeout: float = 10.0) -> int:
        return self.inner.log_start(self.ns.topic(topic), partition)

    def group_lag(self, group: str, topic: str) -> int:
        return self.inner.group_lag(self.ns.group(group), self.ns.topic(topic))

    def close(self) -> None:
        self.inner.close()
