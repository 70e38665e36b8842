"""Per-actor reorder buffer: releases each actor's batches in ``seq`` order, drops duplicates.

    rb = ReorderBuffer(max_buffered=32, timeout_ms=1000)
    res = rb.push(batch, tag=(partition, offset))   # -> ReorderResult(released, rejected)
    res = rb.expire()                               # call periodically: gaps that timed out
    res = rb.drain()                                # shutdown: release everything buffered

Every pushed batch comes out exactly once: released (in order) or rejected, never silently lost.
``tag`` is opaque and travels with the batch (the pipeline passes the source offset).

Rules, per ``actor_id``:

* **duplicate**: a ``batch_id`` already seen (bounded LRU of ``dedup_capacity`` ids, optional
  TTL) is rejected with reason ``duplicate`` -- an idempotent drop of a redelivery.
* **in order**: ``seq == next`` is released at once, with every buffered successor.
* **gap**: ``seq > next`` is buffered. When the oldest buffered batch has waited
  ``timeout_ms``, the buffer skips ahead to its lowest seq (counting the missing seqs) and
  releases what is contiguous.
* **overflow**: more than ``max_buffered`` batches waiting for one actor skips ahead the same
  way at once (counted as an overflow): memory per actor is bounded.
* **late**: ``seq < next`` (it arrived after we skipped past it) is rejected, reason ``late``.
* **seq conflict**: a different batch_id with a seq already buffered, reason ``seq_conflict``.
* **first contact**: an actor never seen starts at seq 0 if that is what arrives; a first batch
  with ``seq > 0`` (this processor started mid-stream) waits like a gap, then the buffer starts
  from the lowest seq it has -- nothing below it is counted as missing.

**Actor restarts.** A restarted actor starts again at seq 0 under the same ``actor_id``. It is
recognised by a seq *regression with newer data*: ``seq < next`` and
``created_at_ms`` newer than every batch seen from that actor. A genuinely late batch was
created before the batches that overtook it, so it cannot look newer; a restart's batches are
created after everything its previous incarnation sent. On a restart the previous
incarnation's buffered batches are released in order, and the actor starts afresh (first
contact rules); stragglers created no later than the newest batch of the previous incarnation
are then ``late``. Actors that put an incarnation into ``actor_id`` (``actor-3.<uuid>``) get a
fresh key and never need this rule. Limits: a wall clock stepped backwards across a restart
makes the new incarnation look late (its batches are rejected as ``late`` until it passes the
old seq); a restarted actor whose first batches overtake each other can have its seq 0
rejected as late.

Idle actors (empty buffer, no batch for ``actor_idle_ms``) are forgotten; past ``max_actors``
the least recently active actor is forgotten (its buffer released first).

**Durable per-actor state.** What must outlive this process for an actor -- its next seq, the
newest ``created_at_ms`` seen, the restart floor and the ids of its last ``state_ids`` batches
that left the buffer -- is written, as a JSON-serialisable dict (``{"p": partition, "next",
"max_created", "floor", "ids"}``), to the ``state`` mapping after every change, and read back
the first time an actor shows up. A dict by default; the Faust shell passes a Faust Table, so
the state moves with the actor's partition. Buffered batches are not part of it: their records
are uncommitted and are redelivered. ``forget_where`` (a partition left) keeps the state;
forgetting an idle or evicted actor deletes it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from schemas.events import SampleBatch, now_ms
from streams.dedup import SeenIds

REASON_LATE = "late"
REASON_DUPLICATE = "duplicate"
REASON_SEQ_CONFLICT = "seq_conflict"


@dataclass(frozen=True, slots=True)
class Rejected:
    reason: str
    batch: SampleBatch
    tag: Any
    detail: str = ""


@dataclass(slots=True)
class ReorderResult:
    released: list[tuple[SampleBatch, Any]] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)

    def extend(self, other: "ReorderResult") -> None:
        self.released.extend(other.released)
        self.rejected.extend(other.rejected)

    def __bool__(self) -> bool:
        return bool(self.released or self.rejected)


@dataclass(slots=True)
class ReorderStats:
    pushed: int = 0
    released: int = 0
    reordered: int = 0  # released after waiting in the buffer
    rejected: dict[str, int] = field(default_factory=dict)
    timeouts: int = 0  # gaps given up on after timeout_ms
    overflows: int = 0  # gaps given up on because the window was full
    skipped_seqs: int = 0  # seqs never seen that the buffer skipped past
    restarts: int = 0  # actor restarts recognised
    actors_evicted: int = 0
    buffered: int = 0  # batches waiting now
    max_buffered_seen: int = 0  # most batches waiting at once (all actors)


class _Actor:
    __slots__ = ("next_seq", "buf", "waiting_since", "max_created_ms", "floor_ms", "last_ms", "last_tag", "ids")

    def __init__(self, now: int, ids: int = 128) -> None:
        self.next_seq: int | None = None  # None: first contact, base not known yet
        self.buf: dict[int, tuple[SampleBatch, Any, int]] = {}  # seq -> (batch, tag, arrived_ms)
        self.waiting_since: int | None = None  # arrival of the oldest buffered batch
        self.max_created_ms = -(1 << 62)
        self.floor_ms = -(1 << 62)  # batches created at or before this belong to a previous incarnation
        self.last_ms = now
        self.last_tag: Any = None
        self.ids: deque[str] = deque(maxlen=ids)  # batch ids that left the buffer, newest last

    def saved(self) -> dict[str, Any]:
        """The durable part (see the module docstring)."""
        tag = self.last_tag
        p = tag[0] if isinstance(tag, tuple) and tag else -1
        return {"p": int(p), "next": self.next_seq, "max_created": int(self.max_created_ms),
                "floor": int(self.floor_ms), "ids": list(self.ids)}


class ReorderBuffer:
    """See the module docstring.

    Args:
        max_buffered: most batches held per actor.
        timeout_ms: how long the oldest buffered batch waits for a gap to fill.
        dedup_capacity: how many batch ids to remember for duplicate detection.
        dedup_ttl_ms: forget ids older than this (None: only the capacity bounds them).
        max_actors: most actors tracked at once.
        actor_idle_ms: forget an actor with nothing buffered after this long without a batch.
        clock: ms clock.
        state: where each actor's durable state is kept (default: a dict).
        state_ids: how many batch ids of each actor the durable state keeps.
    """

    def __init__(
        self,
        max_buffered: int = 32,
        timeout_ms: int = 1000,
        dedup_capacity: int = 65536,
        dedup_ttl_ms: int | None = None,
        max_actors: int = 10000,
        actor_idle_ms: int = 600_000,
        clock: Callable[[], int] = now_ms,
        state: MutableMapping[str, dict] | None = None,
        state_ids: int = 128,
    ) -> None:
        if max_buffered < 1:
            raise ValueError("max_buffered must be >= 1")
        if timeout_ms < 0:
            raise ValueError("timeout_ms must be >= 0")
        if max_actors < 1:
            raise ValueError("max_actors must be >= 1")
        self.max_buffered = int(max_buffered)
        self.timeout_ms = int(timeout_ms)
        self.max_actors = int(max_actors)
        self.actor_idle_ms = int(actor_idle_ms)
        self.clock = clock
        self.seen = SeenIds(dedup_capacity, dedup_ttl_ms)
        self._actors: OrderedDict[str, _Actor] = OrderedDict()  # least recently active first
        self._waiting: set[str] = set()  # actors with a non-empty buffer
        self.state: MutableMapping[str, dict] = {} if state is None else state
        self.state_ids = int(state_ids)
        self.stats = ReorderStats()

    # -- introspection ----------------------------------------------------------------------
    @property
    def buffered(self) -> int:
        return self.stats.buffered

    def actors(self) -> int:
        return len(self._actors)

    def next_seq(self, actor_id: str) -> int | None:
        st = self._actors.get(actor_id)
        return None if st is None else st.next_seq

    def held(self) -> list[tuple[SampleBatch, Any]]:
        """Every buffered (batch, tag)."""
        return [(b, t) for st in self._actors.values() for (b, t, _) in st.buf.values()]

    def next_deadline(self) -> int | None:
        """Earliest time (ms) at which ``expire`` would release something, if any."""
        ts = [self._actors[a].waiting_since for a in self._waiting]
        ts = [t for t in ts if t is not None]
        return min(ts) + self.timeout_ms if ts else None

    # -- internals --------------------------------------------------------------------------
    def _reject(self, res: ReorderResult, reason: str, batch: SampleBatch, tag: Any, detail: str,
                st: _Actor | None = None) -> None:
        res.rejected.append(Rejected(reason, batch, tag, detail))
        self.stats.rejected[reason] = self.stats.rejected.get(reason, 0) + 1
        if st is not None:
            st.ids.append(batch.batch_id)

    def _restore(self, actor_id: str, now: int) -> None:
        """Load an actor this process does not track from the durable state, if it is there."""
        saved = self.state.get(actor_id) if actor_id not in self._actors else None
        if not saved:
            return
        st = self._actors[actor_id] = _Actor(now, self.state_ids)
        st.next_seq = saved.get("next")
        st.max_created_ms = int(saved.get("max_created", st.max_created_ms))
        st.floor_ms = int(saved.get("floor", st.floor_ms))
        st.ids.extend(saved.get("ids", ()))
        for bid in st.ids:
            self.seen.seen_or_add(bid, now)

    def _save(self, actor_id: str) -> None:
        st = self._actors.get(actor_id)
        if st is not None:
            self.state[actor_id] = st.saved()

    def _release_run(self, actor_id: str, st: _Actor, res: ReorderResult) -> None:
        """Release buffered batches from ``next_seq`` on while they are contiguous."""
        buf = st.buf
        n = 0
        while st.next_seq in buf:
            b, t, _ = buf.pop(st.next_seq)
            res.released.append((b, t))
            st.ids.append(b.batch_id)
            st.next_seq += 1
            n += 1
        if n:
            self.stats.released += n
            self.stats.reordered += n
            self.stats.buffered -= n
        self._refresh_waiting(actor_id, st)

    def _refresh_waiting(self, actor_id: str, st: _Actor) -> None:
        if st.buf:
            st.waiting_since = min(a for (_, _, a) in st.buf.values())
            self._waiting.add(actor_id)
        else:
            st.waiting_since = None
            self._waiting.discard(actor_id)

    def _skip_ahead(self, actor_id: str, st: _Actor, res: ReorderResult) -> None:
        """Give up on the current gap: continue from the lowest buffered seq."""
        low = min(st.buf)
        if st.next_seq is not None:
            self.stats.skipped_seqs += low - st.next_seq
        st.next_seq = low
        self._release_run(actor_id, st, res)

    def _flush_actor(self, actor_id: str, st: _Actor, res: ReorderResult) -> None:
        while st.buf:
            self._skip_ahead(actor_id, st, res)

    def _forget(self, actor_id: str, res: ReorderResult) -> None:
        st = self._actors.pop(actor_id)
        self._flush_actor(actor_id, st, res)
        self._waiting.discard(actor_id)
        self.state.pop(actor_id, None)
        self.stats.actors_evicted += 1

    def _evict(self, now: int, res: ReorderResult) -> None:
        while len(self._actors) > self.max_actors:
            self._forget(next(iter(self._actors)), res)
        cutoff = now - self.actor_idle_ms
        while self._actors:
            aid, st = next(iter(self._actors.items()))
            if st.last_ms >= cutoff:
                break
            self._forget(aid, res)

    # -- the API ----------------------------------------------------------------------------
    def push(self, batch: SampleBatch, tag: Any = None, now: int | None = None) -> ReorderResult:
        now = self.clock() if now is None else now
        res = ReorderResult()
        self.stats.pushed += 1
        self._restore(batch.actor_id, now)
        if self.seen.seen_or_add(batch.batch_id, now):
            self._reject(res, REASON_DUPLICATE, batch, tag, f"batch_id {batch.batch_id} already seen")
            return res
        self._push(batch, tag, now, res)
        self._save(batch.actor_id)
        if len(self._actors) > self.max_actors:
            self._evict(now, res)
        return res

    def _push(self, batch: SampleBatch, tag: Any, now: int, res: ReorderResult) -> None:
        aid = batch.actor_id
        seq = int(batch.seq)
        st = self._actors.get(aid)
        if st is None:
            st = self._actors[aid] = _Actor(now, self.state_ids)
        else:
            self._actors.move_to_end(aid)
        st.last_ms = now
        st.last_tag = tag

        if batch.created_at_ms <= st.floor_ms:
            self._reject(res, REASON_LATE, batch, tag,
                         f"seq {seq} of {aid} is from an incarnation before its restart", st)
            return
        if st.next_seq is not None and seq < st.next_seq:
            if batch.created_at_ms > st.max_created_ms:
                # a new incarnation of the actor: flush the old one, start afresh
                self._flush_actor(aid, st, res)
                st.next_seq = None
                st.floor_ms = st.max_created_ms
                self.stats.restarts += 1
            else:
                self._reject(res, REASON_LATE, batch, tag,
                             f"seq {seq} of {aid} arrived after the buffer moved past it (next {st.next_seq})", st)
                return
        if seq in st.buf:
            self._reject(res, REASON_SEQ_CONFLICT, batch, tag,
                         f"seq {seq} of {aid} is already buffered under batch_id {st.buf[seq][0].batch_id}", st)
            return
        if batch.created_at_ms > st.max_created_ms:
            st.max_created_ms = batch.created_at_ms
        if st.next_seq is None and seq == 0:
            st.next_seq = 0

        if seq == st.next_seq:
            res.released.append((batch, tag))
            st.ids.append(batch.batch_id)
            self.stats.released += 1
            st.next_seq = seq + 1
            if st.buf:
                self._release_run(aid, st, res)
        else:
            st.buf[seq] = (batch, tag, now)
            self.stats.buffered += 1
            if st.waiting_since is None:
                st.waiting_since = now
            self._waiting.add(aid)
            if len(st.buf) > self.max_buffered:
                if st.next_seq is not None:
                    self.stats.overflows += 1
                self._skip_ahead(aid, st, res)
            total = self.stats.buffered
            if total > self.stats.max_buffered_seen:
                self.stats.max_buffered_seen = total

    def expire(self, now: int | None = None) -> ReorderResult:
        """Release what waited ``timeout_ms`` for a gap; forget idle actors."""
        now = self.clock() if now is None else now
        res = ReorderResult()
        for aid in list(self._waiting):
            st = self._actors[aid]
            while st.buf and st.waiting_since is not None and now - st.waiting_since >= self.timeout_ms:
                if st.next_seq is not None:
                    self.stats.timeouts += 1
                self._skip_ahead(aid, st, res)
            self._save(aid)
        self._evict(now, res)
        return res

    def drain(self) -> ReorderResult:
        """Release everything buffered, in order per actor (shutdown of a co-located run)."""
        res = ReorderResult()
        for aid in list(self._waiting):
            self._flush_actor(aid, self._actors[aid], res)
            self._save(aid)
        return res

    def forget_where(self, pred: Callable[[Any], bool]) -> list[tuple[SampleBatch, Any]]:
        """Drop, without releasing, every actor whose last or buffered tag matches ``pred``
        (partitions revoked by a rebalance: their records are redelivered elsewhere, and the
        durable state goes with them). Returns the buffered (batch, tag) pairs dropped; their
        ids are forgotten, so a redelivery here is not taken for a duplicate."""
        dropped: list[tuple[SampleBatch, Any]] = []
        for aid in list(self._actors):
            st = self._actors[aid]
            if pred(st.last_tag) or any(pred(t) for (_, t, _) in st.buf.values()):
                dropped.extend((b, t) for (b, t, _) in st.buf.values())
                for b, _, _ in st.buf.values():
                    self.seen.discard(b.batch_id)
                self.stats.buffered -= len(st.buf)
                del self._actors[aid]
                self._waiting.discard(aid)
        return dropped
