"""When the learner snapshots (``SnapshotSchedule``: every N updates, and every interval of
wall time since the store's newest time-based one) and going back to a known-good version
(``rollback``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from learner.snapshots.base import SnapshotStore
from learner.snapshots.format import Snapshot, SnapshotError


def newest_timed_ms(store: SnapshotStore) -> int | None:
    """Save time (wall clock, ms) of the store's newest time-based snapshot; None if it has none."""
    for version in sorted(store.timed(), reverse=True):
        with contextlib.suppress(SnapshotError):  # an unreadable record: the one before it
            return store.ref(version).created_at_ms
    return None


class SnapshotSchedule:
    """When the learner snapshots: every ``every`` updates (0: never), and once ``interval_s``
    seconds of ``clock`` have passed since the last time-based one (0: never). The first
    time-based snapshot is due ``interval_s`` after ``last_timed_s`` (the store's newest, so a
    restart keeps the cadence; None: from now).
    """

    def __init__(self, every: int, interval_s: float, clock: Callable[[], float] = time.time,
                 last_timed_s: float | None = None) -> None:
        if every < 0 or interval_s < 0:
            raise ValueError("snapshot every and interval must be >= 0")
        self.every, self.interval_s, self.clock = every, interval_s, clock
        self.last_timed_s = clock() if last_timed_s is None else last_timed_s

    def due(self, updates: int) -> tuple[bool, bool]:
        """``(by updates, by time)`` after update number ``updates``."""
        by_count = bool(self.every) and updates % self.every == 0
        by_time = bool(self.interval_s) and self.clock() - self.last_timed_s >= self.interval_s
        return by_count, by_time

    def taken(self, timed: bool) -> None:
        """A snapshot was saved now (``timed``: as a time-based one)."""
        if timed:
            self.last_timed_s = self.clock()


def rollback(store: SnapshotStore, to_version: int, *, with_state: bool = False, pin: bool = False) -> Snapshot:
    """Weights (and meta) of ``to_version``, verified, for republishing a known-good policy.

    The learner republishes them as a *new* version (versions stay monotonic;
    ``parent_version=to_version``). ``with_state`` also loads the learner state
    (slower); ``pin`` protects ``to_version`` from retention.
    """
    weights, meta = store.load(to_version)
    state = store.load_state(to_version) if with_state else None
    if pin:
        store.pin(to_version)
    return Snapshot(to_version, weights, meta, state)
