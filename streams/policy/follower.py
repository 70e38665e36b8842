"""THE follower: a policy's versions in log order from a ``StartRule``, decoded once each."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from agents.networks import Policy
from schemas.errors import CodecError
from schemas.events import PolicyVersion
from schemas.weights import sha256
from streams.bus.base import Consumer, Record
from streams.events import EventBus
from streams.topics import POLICY_VERSIONS, PUBLISHED_NS_HEADER

from streams.policy.blobs import Blobs
from streams.policy.loader import load_policy
from streams.policy.tail import decodes_as, tail_offsets

log = logging.getLogger(__name__)


# -- one decoded version --------------------------------------------------------------------------

@dataclass(frozen=True)
class PolicyUpdate:
    """One policy version, as a follower hands it back. ``policy`` is loaded on first use."""

    policy_id: str
    version: int
    parent_version: int | None
    created_at_ms: int
    algo: str
    learner_id: str
    metrics: dict[str, float]
    published_ns: int | None
    """When the learner produced it (``rl-published-ns`` header), if it said."""
    partition: int
    offset: int
    event: PolicyVersion = field(repr=False)
    record: Record | None = field(default=None, repr=False, compare=False)
    """The bus record it came from (for a dead letter when its weights do not load)."""
    blob_store: Blobs = field(default=None, repr=False, compare=False)
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, rec: Record, pv: PolicyVersion, blob_store: Blobs = None) -> "PolicyUpdate":
        sent = rec.headers.get(PUBLISHED_NS_HEADER)
        try:
            published = int(sent) if sent else None
        except ValueError:
            published = None
        return cls(policy_id=pv.policy_id, version=pv.version, parent_version=pv.parent_version,
                   created_at_ms=pv.created_at_ms, algo=pv.algo, learner_id=pv.learner_id,
                   metrics=dict(pv.metrics), published_ns=published, partition=rec.partition,
                   offset=rec.offset, event=pv, record=rec, blob_store=blob_store)

    @property
    def policy(self) -> Policy:
        """The torch module of this version (loaded once, then cached; eval mode).
        Raises ``PolicyLoadError`` if the weights do not load."""
        if "policy" not in self._cache:
            self._cache["policy"] = load_policy(self.event, self.blob_store)
        return self._cache["policy"]

    def load(self, into: Policy | None = None) -> Policy:
        """Load the weights into ``into`` (rebuilt if None or of another architecture)."""
        return self.policy if into is None else load_policy(self.event, self.blob_store, into)

    @property
    def weights_size(self) -> int:
        pv = self.event
        return len(pv.weights) if pv.weights is not None else (pv.weights_ref.size if pv.weights_ref else 0)

    @property
    def weights_sha256(self) -> str:
        if "sha" not in self._cache:
            pv = self.event
            self._cache["sha"] = sha256(pv.weights) if pv.weights is not None else (
                pv.weights_ref.sha256 if pv.weights_ref else "")
        return self._cache["sha"]

    def latency_s(self, now_ns: int | None = None) -> float | None:
        """Seconds from the learner publishing it to now (None if it did not say when)."""
        if self.published_ns is None:
            return None
        return max(0.0, ((now_ns or time.time_ns()) - self.published_ns) / 1e9)

    def describe(self) -> dict[str, Any]:
        """JSON-able summary (no weights: their size and sha256)."""
        pv = self.event
        weights: dict[str, Any] = {"format": pv.weights_format, "bytes": self.weights_size,
                                   "sha256": self.weights_sha256, "inline": pv.weights is not None}
        if pv.weights_ref is not None:
            weights["claim_check"] = {"store": pv.weights_ref.store, "key": pv.weights_ref.key}
        lat = self.latency_s()
        return {"event": "policy_version", "policy_id": self.policy_id, "version": self.version,
                "parent_version": self.parent_version, "created_at_ms": self.created_at_ms,
                "algo": self.algo, "learner_id": self.learner_id, "metrics": self.metrics,
                "weights": weights, "partition": self.partition, "offset": self.offset,
                "latency_s": None if lat is None else round(lat, 6)}


# -- THE follower -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class StartRule:
    """Where a follower starts (see the module docstring). Build with the class methods."""

    records_back: int = 0
    from_version: int | None = None

    @classmethod
    def newest(cls) -> "StartRule":
        return cls()

    @classmethod
    def back(cls, k: int) -> "StartRule":
        if k < 0:
            raise ValueError(f"k must be >= 0, not {k}")
        return cls(records_back=int(k))

    @classmethod
    def at_version(cls, v: int) -> "StartRule":
        if v < 0:
            raise ValueError(f"from_version must be >= 0, not {v}")
        return cls(from_version=int(v))


def start_offsets(events: EventBus, policy_id: str | None, rule: StartRule, *,
                  topic: str = POLICY_VERSIONS) -> dict[tuple[str, int], int]:
    """Per partition of ``topic``, where a reader of ``policy_id``'s versions (None: every
    policy's) starts by ``rule``'s ``newest``/``back`` part: the offset of the
    ``rule.records_back + 1``-th newest record of that policy (``tail_offsets``). What both
    processor shells and ``PolicyFollower`` start from; it opens no reader that outlives it."""
    def mine(pv: PolicyVersion) -> bool:
        return policy_id is None or pv.policy_id == policy_id

    return tail_offsets(events.bus, topic, decodes_as(events, PolicyVersion, mine), count=rule.records_back + 1)


class PolicyFollower:
    """Follows PolicyVersion records of ``policy_id`` (None: of every policy) from ``start``.

    ``read(timeout)`` returns ``(record, PolicyUpdate | CodecError)`` pairs in log order;
    ``poll(timeout)`` the updates only. Other policies' records are skipped (``ignored``);
    with ``monotonic`` (default) a version not newer than the last one handed out for its
    policy is skipped too (``skipped``). A record that does not decode is dead-lettered by
    ``events.dead_letters`` under ``stage`` (which only counts it where another role owns the
    topic's dead letters; ``dead_letter=False``: never) and counted in ``undecodable``.
    ``group``: read under this consumer group; its committed offset wins over ``start``.
    """

    def __init__(self, events: EventBus, policy_id: str | None = "policy", start: StartRule = StartRule(), *,
                 blobs: Blobs = None, topic: str = POLICY_VERSIONS, stage: str = "policy-follower",
                 dead_letter: bool = True, monotonic: bool = True, group: str | None = None,
                 join_timeout: float = 30.0) -> None:
        self.events = events
        self.policy_id = policy_id
        self.start = start
        self.blobs = blobs
        self.topic = topic
        self.stage = stage
        self.dead_letter_bad = dead_letter
        self.monotonic = monotonic
        self.group = group
        self.last_version: dict[str, int] = {}
        self.delivered = self.skipped = self.ignored = self.undecodable = 0
        self.last_error: CodecError | None = None
        self._buffer: list[Record] = []
        self.consumer: Consumer = self._open(join_timeout)

    def _mine(self, pv: PolicyVersion) -> bool:
        return self.policy_id is None or pv.policy_id == self.policy_id

    def start_offsets(self) -> dict[tuple[str, int], int]:
        """Per partition, where ``start`` says to begin (newest / back rules; ``start_offsets``)."""
        return start_offsets(self.events, self.policy_id, self.start, topic=self.topic)

    def _open(self, join_timeout: float) -> Consumer:
        bus = self.events.bus
        replay = self.start.from_version is not None
        if self.group is None:
            return bus.consumer(None, [self.topic], start="earliest" if replay else self.start_offsets())
        if replay:
            return bus.consumer(self.group, [self.topic], start="earliest")
        # the group's committed offset wins; a partition without one starts as ``start`` says,
        # which is known once the group assigned its partitions
        c = bus.consumer(self.group, [self.topic], start="latest")
        deadline = time.monotonic() + join_timeout
        while not c.assignment():
            if time.monotonic() > deadline:
                c.close()
                raise TimeoutError(f"consumer group {self.group} got no partition of {self.topic} "
                                   f"within {join_timeout:.0f}s")
            self._buffer.extend(c.poll(0.1, max_records=1000))
        committed = c.committed()
        fresh = [tp for tp in c.assignment() if tp not in committed]
        if fresh:
            starts = self.start_offsets()
            for tp in fresh:
                c.seek(tp[0], tp[1], starts[tp])
            self._buffer = [r for r in self._buffer if (r.topic, r.partition) not in fresh]
        return c

    def read(self, timeout: float = 0.0, max_records: int = 1000) -> list[tuple[Record, PolicyUpdate | CodecError]]:
        """Decoded updates and decode failures that arrived within ``timeout`` s, in log order."""
        recs, self._buffer = self._buffer, []
        if not recs:
            recs = self.consumer.poll(timeout, max_records=max_records)
        out: list[tuple[Record, PolicyUpdate | CodecError]] = []
        for rec in recs:
            try:
                pv = self.events.codec.decode_valid(rec.value, PolicyVersion, rec.topic)
            except CodecError as e:
                self.undecodable += 1
                self.last_error = e
                if self.dead_letter_bad:
                    self.events.dead_letters.send(rec, e.reason, e, self.stage)
                out.append((rec, e))
                continue
            if not self._mine(pv):
                self.ignored += 1
                continue
            if self.start.from_version is not None and pv.version < self.start.from_version:
                continue
            if self.monotonic and pv.version <= self.last_version.get(pv.policy_id, -1):
                self.skipped += 1
                continue
            self.last_version[pv.policy_id] = max(pv.version, self.last_version.get(pv.policy_id, -1))
            out.append((rec, PolicyUpdate.of(rec, pv, self.blobs)))
        return out

    def poll(self, timeout: float = 0.0) -> list[PolicyUpdate]:
        """Updates that arrived within ``timeout`` s (possibly none), oldest first."""
        ups = [x for _, x in self.read(timeout) if isinstance(x, PolicyUpdate)]
        self.delivered += len(ups)
        return ups

    def dead_letter(self, update: PolicyUpdate, error: CodecError) -> bool:
        """Dead-letter the record of a version whose weights do not load (or count it, where
        another role owns the topic's dead letters)."""
        if update.record is None:
            return False
        return self.events.dead_letters.send(update.record, error.reason, error, self.stage)

    def close(self) -> None:
        self.consumer.close()
