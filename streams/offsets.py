"""The offset ledger: what a consumer may commit. One rule, kept here once for the processor
shells (``streams.shell``: ``ShellCore``, ``InOrderAcks``; ``streams.worker``) and the learner
(``learner.learner``, through its ``streams.events.EventConsumer``): **commit nothing past the
lowest record still held**.

Per partition (any hashable key: a partition number, or ``(topic, partition)``) the ledger
knows how far records were read (``upto``: the offset after the highest one read, or where
reading starts) and which of them are still held (read, not done: buffered for reordering,
waiting for an update, in flight). ``safe(p)`` is the lowest held offset, or ``upto`` when
nothing is held: every record before it is done, so it may be committed or snapshotted.

    ledger = OffsetLedger()
    ledger.start(p, committed)       # (re)assigned: reading starts here, nothing is held
    ledger.read(p, offset)           # a record was read ...
    ledger.hold(p, offset, item)     # ... and is kept (``item``: whatever the caller keeps with it)
    item = ledger.release(p, offset) # ... and is done (trained, written, dead-lettered)
    consumer.commit(ledger.commit_due())   # safe offsets past the last commit_due
    ledger.forget(revoked)           # a rebalance took them: their records go to the new owner

``upto`` only moves forward (a record read again after a rewind does not lower it); only
``start`` sets it back.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import Any, Generic, TypeVar

P = TypeVar("P", bound=Hashable)


class OffsetLedger(Generic[P]):
    """Read-up-to and held offsets per partition; see the module docstring."""

    def __init__(self) -> None:
        self._upto: dict[P, int] = {}  # partition -> offset after the highest record read
        self._held: dict[P, dict[int, Any]] = {}  # partition -> offset -> item, of records held
        self._committed: dict[P, int] = {}  # partition -> what commit_due last returned

    # -- reading --------------------------------------------------------------------------
    def start(self, partition: P, offset: int) -> None:
        """Reading ``partition`` (newly assigned, or set back) starts at ``offset``; nothing of
        it is held."""
        self._upto[partition] = int(offset)
        self._held.pop(partition, None)

    def read(self, partition: P, offset: int) -> None:
        """The record at ``offset`` was read."""
        if offset + 1 > self._upto.get(partition, 0):
            self._upto[partition] = offset + 1

    def upto(self, partition: P) -> int | None:
        """The offset after the highest record read (or where reading starts); None: unknown."""
        return self._upto.get(partition)

    # -- holding --------------------------------------------------------------------------
    def hold(self, partition: P, offset: int, item: Any = None) -> None:
        """The record at ``offset`` is held (not done) until ``release``; a second hold of it
        replaces its ``item``."""
        self._held.setdefault(partition, {})[int(offset)] = item

    def release(self, partition: P, offset: int, default: Any = None) -> Any:
        """The record at ``offset`` is done: its item (``default`` if it was not held)."""
        part = self._held.get(partition)
        if part is None or offset not in part:
            return default
        item = part.pop(offset)
        if not part:
            del self._held[partition]
        return item

    def holds(self, partition: P, offset: int) -> bool:
        return offset in self._held.get(partition, ())

    def held(self, partition: P | None = None) -> list[tuple[P, int]]:
        """(partition, offset) of every record held (of ``partition``), in offset order."""
        parts = self._held if partition is None else {partition: self._held.get(partition, {})}
        return [(p, o) for p, offs in parts.items() for o in sorted(offs)]

    def __len__(self) -> int:
        """How many records are held."""
        return sum(len(offs) for offs in self._held.values())

    def lowest_held(self, partition: P) -> int | None:
        part = self._held.get(partition)
        return min(part) if part else None

    # -- committing -----------------------------------------------------------------------
    def safe(self, partition: P) -> int | None:
        """The offset before which every record read of ``partition`` is done: the lowest held
        one, or ``upto`` when none is held (None: nothing known of it)."""
        low, upto = self.lowest_held(partition), self._upto.get(partition)
        if low is None:
            return upto
        return low if upto is None else min(low, upto)

    def offsets(self) -> dict[P, int]:
        """``safe`` of every partition known: what may be committed, or recorded in a snapshot."""
        out = {}
        for p in [*self._upto, *(p for p in self._held if p not in self._upto)]:
            out[p] = self.safe(p)
        return out

    def commit_due(self) -> dict[P, int]:
        """The safe offsets past those this last returned (past 0 at first): what to commit now."""
        due = {p: o for p, o in self.offsets().items() if o > self._committed.get(p, 0)}
        self._committed.update(due)
        return due

    # -- ownership ------------------------------------------------------------------------
    def forget(self, partitions: Iterable[P]) -> None:
        """``partitions`` are no longer read here (a rebalance took them): forget them."""
        for p in partitions:
            self._upto.pop(p, None)
            self._held.pop(p, None)
            self._committed.pop(p, None)

    def clear(self) -> None:
        self._upto.clear()
        self._held.clear()
        self._committed.clear()


def next_offsets(records: Iterable[Any], key: Any = None) -> dict[Any, int]:
    """Per ``(topic, partition)`` (or ``key(record)``), the offset after the highest of
    ``records``: what committing exactly those records commits."""
    out: dict[Any, int] = {}
    for r in records:
        tp = (r.topic, r.partition) if key is None else key(r)
        if r.offset + 1 > out.get(tp, 0):
            out[tp] = r.offset + 1
    return out


def commit_targets(records: Iterable[Any] | None, offsets: Mapping[Any, int] | None,
                   polled: Mapping[Any, int]) -> dict[Any, int]:
    """What a consumer's ``commit`` covers: the ``offsets`` given, else exactly ``records``,
    else everything it has polled."""
    if offsets is not None:
        return dict(offsets)
    return dict(polled) if records is None else next_offsets(records)
