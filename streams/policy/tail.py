"""Reading rl.policy.versions back from its end: where the newest records of one policy are."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from schemas.errors import CodecError
from schemas.events import PolicyVersion
from streams.bus.base import BusError, IncompleteReadError, Record
from streams.events import EventBus
from streams.topics import POLICY_VERSIONS


log = logging.getLogger(__name__)


# -- reading the topic back from its end --------------------------------------------------------------

def _read_range(bus: Any, topic: str, partition: int, start: int, stop: int, ends: dict[int, int],
                timeout: float) -> list[Record]:
    """Every record of ``topic[partition]`` with ``start <= offset < stop`` (ephemeral reader), or
    ``IncompleteReadError`` (topic, partition, ``stop``, the offset reached) once ``timeout`` s
    pass without progress short of ``stop``: a partial range is never returned as the whole.
    Offsets below the log start (retention) are gone and not waited for."""
    offsets = {(topic, p): (start if p == partition else e) for p, e in ends.items()}
    c = bus.consumer(None, [topic], start=offsets)
    out: list[Record] = []
    reached = start
    try:
        deadline = time.monotonic() + timeout
        while reached < stop:
            recs = [r for r in c.poll(0.2, max_records=1000) if r.partition == partition]
            for r in recs:
                if r.offset >= start and r.offset < stop:
                    out.append(r)
                reached = max(reached, r.offset + 1)
            position = c.position(topic, partition) or 0  # past transaction markers too
            moved, reached = position > reached, max(reached, position)
            if recs or moved:
                deadline = time.monotonic() + timeout
            elif reached < stop and time.monotonic() >= deadline:
                if _gone_below(bus, topic, partition, reached, stop):
                    break
                raise IncompleteReadError(topic, partition, stop, reached, timeout)
    finally:
        c.close()
    return out


def _gone_below(bus: Any, topic: str, partition: int, reached: int, stop: int) -> bool:
    """Whether the log holds nothing in ``[reached, stop)`` any more: retention moved its start to
    ``stop`` or past it (only a bus that knows its log start can say so; ``stop`` > 0)."""
    return _log_start(bus, topic, partition) >= stop


def _log_start(bus: Any, topic: str, partition: int) -> int:
    """The partition's log start, or 0 where the bus cannot say (the reads then find out)."""
    log_start = getattr(bus, "log_start", None)
    try:
        return log_start(topic, partition) if log_start is not None else 0
    except BusError:  # the broker does not answer that either
        return 0


def tail_offsets(bus: Any, topic: str, matches: Callable[[Record], bool], timeout: float = 10.0,
                 count: int = 1, ends: dict[int, int] | None = None) -> dict[tuple[str, int], int]:
    """Per partition, the offset of the ``count``-th newest record for which ``matches`` holds
    (the oldest match where fewer do; the log end where none does). Reads back from the end in
    growing windows (count, 4 count, ...), so it costs a few records, not a replay of the topic.
    ``ends``: the end offsets to read back from (default: the topic's now). A window the broker
    does not deliver within ``timeout`` raises ``IncompleteReadError``, never a short answer."""
    ends = bus.end_offsets(topic) if ends is None else ends
    out: dict[tuple[str, int], int] = {}
    for p, end in ends.items():
        hits: list[int] = []
        # down to the log start (retention), not to the first empty window: a window may hold
        # only transaction markers, which take offsets and are never read
        low = _log_start(bus, topic, p) if end > 0 else 0
        stop, window = end, max(1, count)
        while stop > low and len(hits) < count:
            start = max(low, stop - window)
            recs = _read_range(bus, topic, p, start, stop, ends, timeout)
            hits.extend(sorted((r.offset for r in recs if matches(r)), reverse=True))
            stop, window = start, window * 4
        out[(topic, p)] = hits[:count][-1] if hits else end
    return out


def decodes_as(events: EventBus, cls: type, pred: Callable[[Any], bool] | None = None) -> Callable[[Record], bool]:
    """A record predicate: it decodes as ``cls`` and ``pred`` holds of the event."""
    def matches(rec: Record) -> bool:
        try:
            ev = events.codec.decode(rec.value)
        except CodecError:
            return False
        return isinstance(ev, cls) and (pred is None or pred(ev))

    return matches


def newest_version(events: EventBus, policy_id: str = "policy", topic: str = POLICY_VERSIONS,
                   timeout: float = 10.0) -> PolicyVersion | None:
    """The newest PolicyVersion of ``policy_id`` on ``topic`` (None if there is none)."""
    match = decodes_as(events, PolicyVersion, lambda pv: pv.policy_id == policy_id)
    best: PolicyVersion | None = None
    ends = events.bus.end_offsets(topic)
    for (t, p), off in tail_offsets(events.bus, topic, match, timeout, ends=ends).items():
        if off >= ends.get(p, 0):
            continue
        for rec in _read_range(events.bus, t, p, off, off + 1, ends, timeout):
            pv = events.codec.decode(rec.value)
            if best is None or pv.version > best.version:
                best = pv
    return best
