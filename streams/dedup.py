"""The one dedup store: a bounded set of recently seen ids, shared by the reorder buffer
(``streams.processors.reorder``) and the learner core (``learner.core``), neither of which
should depend on the other. No I/O, no imports above the standard library."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class SeenIds:
    """Bounded set of recently seen ids: LRU of ``capacity`` entries, optional TTL in ms."""

    def __init__(self, capacity: int = 65536, ttl_ms: int | None = None) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be > 0")
        self.capacity = int(capacity)
        self.ttl_ms = ttl_ms
        self._d: OrderedDict[Hashable, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._d

    def __iter__(self):
        """The ids remembered, oldest first."""
        return iter(self._d)

    def seen_or_add(self, key: Hashable, now: int) -> bool:
        """True if ``key`` was seen (within the TTL); otherwise remember it and return False."""
        d = self._d
        if self.ttl_ms is not None:
            cutoff = now - self.ttl_ms
            while d:
                k, t = next(iter(d.items()))
                if t >= cutoff:
                    break
                d.popitem(last=False)
        if key in d:
            d.move_to_end(key)
            return True
        d[key] = now
        if len(d) > self.capacity:
            d.popitem(last=False)
        return False

    def discard(self, key: Hashable) -> None:
        self._d.pop(key, None)
