"""In-process bus: an append-only log per topic partition, with offsets, consumer groups and
replay. The co-located default: no server, records are handed over by reference (no copy).

Partition assignment within a group is range-by-member (sorted member ids), recomputed when
a member joins or leaves; positions of a newly assigned partition come from the group's
committed offset, else the consumer's ``start`` policy — the same rule Kafka applies.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from config.limits import MAX_MESSAGE_BYTES
from streams.bus.filelog import FileLog
from streams.bus.base import (
    TP,
    Bus,
    BusError,
    Consumer,
    Record,
    RecordTooLargeError,
    StartAt,
    explicit_offset,
    normalise_start,
)
from streams.offsets import commit_targets
from streams.topics import TOPICS, TopicSpec

DEFAULT_MAX_MESSAGE_BYTES = MAX_MESSAGE_BYTES


def partition_for(key: bytes | None, partitions: int, counter: itertools.count) -> int:
    if partitions == 1:
        return 0
    if key is None:
        return next(counter) % partitions
    return zlib.crc32(key) % partitions


class _Partition:
    __slots__ = ("records", "base")

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.base = 0  # offset of records[0] (retention may drop the oldest)

    @property
    def end(self) -> int:
        return self.base + len(self.records)


@dataclass
class _Group:
    committed: dict[TP, int] = field(default_factory=dict)
    members: dict[int, "MemoryConsumer"] = field(default_factory=dict)
    generation: int = 0


class MemoryBus(Bus):
    name = "memory"

    def __init__(self, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, auto_create: bool = True,
                 path: str | os.PathLike | None = None, fsync: bool = False) -> None:
        """``path``: keep the log in files there too (and load what is there), so the history
        and the groups' commits survive the process; None: purely in memory."""
        self.max_message_bytes = max_message_bytes
        self.auto_create = auto_create
        self._topics: dict[str, list[_Partition]] = {}
        self._max_bytes: dict[str, int] = {}  # per-topic max.message.bytes, where a spec sets it
        self._groups: dict[str, _Group] = {}
        self._cond = threading.Condition(threading.Lock())
        self._rr = itertools.count()
        self._member_ids = itertools.count()
        self._closed = False
        self._log: FileLog | None = None
        if path is not None:
            self._log = FileLog(Path(path), fsync=fsync)
            self._load()

    def _load(self) -> None:
        log = self._log
        for name, meta in log.topics().items():
            parts = self._topics[name] = [_Partition() for _ in range(int(meta["partitions"]))]
            if meta.get("max_message_bytes") is not None:
                self._max_bytes[name] = int(meta["max_message_bytes"])
            for i, part in enumerate(parts):
                for r in log.records(name, i):
                    if r.offset != part.end:
                        raise BusError(f"{log.dir}/{name}/{i}.log: offset {r.offset} where {part.end} was expected")
                    part.records.append(r)
        for group, committed in log.groups().items():
            self._groups[group] = _Group(committed=dict(committed))

    # -- topics -----------------------------------------------------------------------------
    def create_topics(self, specs: Iterable) -> None:
        with self._cond:
            for s in specs:
                self._create(s)
            for g in self._groups.values():
                self._rebalance(g)

    def _create(self, spec) -> list[_Partition]:
        """Add a topic unless it exists (caller holds the lock); honours ``max.message.bytes``."""
        parts = self._topics.get(spec.name)
        if parts is None:
            parts = self._topics[spec.name] = [_Partition() for _ in range(max(1, spec.partitions))]
            limit = spec.config.get("max.message.bytes")
            if limit is not None:
                self._max_bytes[spec.name] = int(limit)
            if self._log is not None:
                self._log.add_topic(spec.name, len(parts), self._max_bytes.get(spec.name))
        return parts

    def _parts(self, topic: str) -> list[_Partition]:
        parts = self._topics.get(topic)
        if parts is None:
            if not self.auto_create:
                raise BusError(f"unknown topic {topic!r}")
            # As the Kafka bus: a known topic gets its spec, any other one partition.
            parts = self._create(TOPICS.get(topic) or TopicSpec(topic, key="", partitions=1))
            for g in self._groups.values():
                self._rebalance(g)
        return parts

    def partitions(self, topic: str) -> int:
        with self._cond:
            return len(self._parts(topic))

    def end_offsets(self, topic: str) -> dict[int, int]:
        with self._cond:
            return {i: p.end for i, p in enumerate(self._parts(topic))}

    def log_start(self, topic: str, partition: int) -> int:
        """The partition's oldest offset still held (retention moves it up)."""
        with self._cond:
            return self._parts(topic)[partition].base

    # -- produce ----------------------------------------------------------------------------
    def produce(self, topic, value, key=None, headers=None, partition=None, on_delivery=None) -> None:
        if self._closed:
            raise BusError("bus is closed")
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"value must be bytes, not {type(value).__name__}")
        size = len(value) + (len(key) if key else 0)
        if size > self.max_message_bytes:
            raise RecordTooLargeError(
                f"record of {size} bytes exceeds max_message_bytes={self.max_message_bytes} on {topic}"
            )
        with self._cond:
            parts = self._parts(topic)
            limit = self._max_bytes.get(topic)
            if limit is not None and size > limit:
                raise RecordTooLargeError(f"record of {size} bytes exceeds {topic}'s max.message.bytes={limit}")
            p = partition if partition is not None else partition_for(key, len(parts), self._rr)
            if not 0 <= p < len(parts):
                raise BusError(f"partition {p} out of range for {topic} ({len(parts)} partitions)")
            part = parts[p]
            rec = Record(topic, p, part.end, key, bytes(value), dict(headers or {}), time.time_ns() // 1_000_000)
            part.records.append(rec)
            if self._log is not None:
                self._log.append(rec)
            self._cond.notify_all()
        if on_delivery is not None:  # the append is the log: acknowledged at once
            on_delivery(None)

    def flush(self, timeout: float = 30.0) -> None:
        """Appends are synchronous in memory; with a ``path``, this writes the files out."""
        if self._log is not None:
            with self._cond:
                self._log.flush()

    # -- consume ----------------------------------------------------------------------------
    def consumer(self, group: str | None, topics: list[str], start: StartAt = "earliest") -> "MemoryConsumer":
        policy, offsets = normalise_start(start, topics)
        with self._cond:
            for t in topics:
                self._parts(t)
            c = MemoryConsumer(self, next(self._member_ids), group, list(topics), policy, offsets)
            if group is None:
                c._assign([(t, i) for t in topics for i in range(len(self._topics[t]))])
            else:
                g = self._groups.setdefault(group, _Group())
                g.members[c.member_id] = c
                self._rebalance(g)
            return c

    def _rebalance(self, g: _Group) -> None:
        """Spread every subscribed partition over the members (caller holds the lock)."""
        g.generation += 1
        members = sorted(g.members.values(), key=lambda m: m.member_id)
        by_member: dict[int, list[TP]] = {m.member_id: [] for m in members}
        topics = sorted({t for m in members for t in m.topics})
        for t in topics:
            subs = [m for m in members if t in m.topics]
            for i in range(len(self._topics.get(t, []))):
                by_member[subs[i % len(subs)].member_id].append((t, i))
        for m in members:
            m._assign(by_member[m.member_id])

    def _leave(self, c: "MemoryConsumer") -> None:
        with self._cond:
            if c.group is not None:
                g = self._groups.get(c.group)
                if g and g.members.pop(c.member_id, None) is not None:
                    self._rebalance(g)
            self._cond.notify_all()

    def group_lag(self, group: str, topic: str) -> int:
        """Records in ``topic`` not yet committed by ``group`` (all of them if it never committed)."""
        with self._cond:
            g = self._groups.get(group)
            committed = g.committed if g else {}
            return sum(p.end - committed.get((topic, i), p.base) for i, p in enumerate(self._parts(topic)))

    def _save_groups(self) -> None:
        """Persist the groups' commits (caller holds the lock)."""
        if self._log is not None:
            self._log.flush()  # a commit never points past records that are not in the files
            self._log.save_groups({name: g.committed for name, g in self._groups.items() if g.committed})

    def close(self) -> None:
        with self._cond:
            if self._log is not None and not self._closed:
                self._save_groups()
                self._log.close()
            self._closed = True
            self._cond.notify_all()

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {t: sum(len(p.records) for p in parts) for t, parts in self._topics.items()}


class MemoryConsumer(Consumer):
    def __init__(self, bus: MemoryBus, member_id: int, group: str | None, topics: list[str],
                 policy: str, offsets: dict) -> None:
        self.bus = bus
        self.member_id = member_id
        self.group = group
        self.topics = topics
        self.policy = policy
        self.offsets = offsets
        self._positions: dict[TP, int] = {}
        self._polled: dict[TP, int] = {}  # next offset after the last record returned
        self._closed = False

    def _assign(self, tps: list[TP]) -> None:
        """New assignment (caller holds the bus lock)."""
        g = self.bus._groups.get(self.group) if self.group is not None else None
        new: dict[TP, int] = {}
        for tp in tps:
            if tp in self._positions:
                new[tp] = self._positions[tp]
                continue
            explicit = explicit_offset(self.offsets, *tp)
            part = self.bus._topics[tp[0]][tp[1]]
            if explicit is not None:
                pos = explicit
            elif g is not None and tp in g.committed:
                pos = g.committed[tp]
            else:
                pos = part.base if self.policy == "earliest" else part.end
            new[tp] = max(part.base, min(pos, part.end))
        self._positions = new
        self._polled = {tp: o for tp, o in self._polled.items() if tp in new}

    def poll(self, timeout: float = 1.0, max_records: int = 500) -> list[Record]:
        if self._closed:
            raise BusError("consumer is closed")
        deadline = time.monotonic() + max(0.0, timeout)
        bus = self.bus
        with bus._cond:
            while True:
                out: list[Record] = []
                for tp, pos in self._positions.items():
                    part = bus._topics[tp[0]][tp[1]]
                    if pos < part.end:
                        i = pos - part.base
                        chunk = part.records[i: i + (max_records - len(out))]
                        out.extend(chunk)
                        self._positions[tp] = pos + len(chunk)
                        self._polled[tp] = pos + len(chunk)
                        if len(out) >= max_records:
                            break
                if out or bus._closed:
                    return out
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return out
                bus._cond.wait(remaining)

    def commit(self, records: Iterable[Record] | None = None, *, offsets: dict[TP, int] | None = None) -> None:
        if self.group is None:
            return
        upto = commit_targets(records, offsets, self._polled)
        with self.bus._cond:
            g = self.bus._groups[self.group]
            for tp, off in upto.items():
                if tp in self._positions:  # a partition revoked by a rebalance is no longer ours
                    g.committed[tp] = max(g.committed.get(tp, 0), off)
            self.bus._save_groups()

    def committed(self) -> dict[TP, int]:
        if self.group is None:
            return {}
        with self.bus._cond:
            g = self.bus._groups[self.group]
            return {tp: g.committed[tp] for tp in self._positions if tp in g.committed}

    def seek(self, topic: str, partition: int, offset: int) -> None:
        with self.bus._cond:
            tp = (topic, partition)
            if tp not in self._positions:
                raise BusError(f"{tp} is not assigned to this consumer")
            part = self.bus._topics[topic][partition]
            self._positions[tp] = max(part.base, min(offset, part.end))

    def assignment(self) -> list[TP]:
        with self.bus._cond:
            return sorted(self._positions)

    def position(self, topic: str, partition: int) -> int | None:
        with self.bus._cond:
            return self._positions.get((topic, partition))

    def lag(self) -> dict[TP, int]:
        with self.bus._cond:
            return {tp: self.bus._topics[tp[0]][tp[1]].end - pos for tp, pos in self._positions.items()}

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.bus._leave(self)
