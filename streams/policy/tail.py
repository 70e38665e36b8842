"""Reading rl.policy.versions back from its end: where the newest records of one policy are."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any


# Weights above DEFAULT_INLINE_LIMIT must go to the blob store (the event carries a claim check);
# above DEFAULT_CLAIM_CHECK_ABOVE they go there when one is configured: one tiny record fans out
# to every reader instead of the weights, and a process of many readers fetches them once.
from schemas.errors import CodecError
from schemas.events import PolicyVersion
from streams.bus.base import Record
from streams.events import EventBus
from streams.topics import POLICY_VERSIONS



log = logging.getLogger(__name__)


# -- reading the topic back from its end --------------------------------------------------------------

def _read_range(bus: Any, topic: str, partition: int, start: int, stop: int, ends: dict[int, int],
                timeout: float) -> list[Record]:
    """Records of ``topic[partition]`` with ``start <= offset < stop`` (ephemeral reader)."""
    offsets = {(topic, p): (start if p == partition else e) for p, e in ends.items()}
    c = bus.consumer(None, [topic], start=offsets)
    out: list[Record] = []
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            recs = c.poll(0.2, max_records=1000)
            done = False
            for r in recs:
                if r.partition != partition:
                    continue
                if r.offset >= stop:
                    done = True
                    break
                if r.offset >= start:
                    out.append(r)
                if r.offset >= stop - 1:
                    done = True
            if done:
                break
            if recs:
                deadline = time.monotonic() + timeout
    finally:
        c.close()
    return out


def tail_offsets(bus: Any, topic: str, matches: Callable[[Record], bool], timeout: float = 10.0,
                 count: int = 1) -> dict[tuple[str, int], int]:
    """Per partition, the offset of the ``count``-th newest record for which ``matches`` holds
    (the oldest match where fewer do; the log end where none does). Reads back from the end in
    growing windows (count, 4 count, ...), so it costs a few records, not a replay of the topic."""
    ends = bus.end_offsets(topic)
    out: dict[tuple[str, int], int] = {}
    for p, end in ends.items():
        hits: list[int] = []
        stop, window = end, max(1, count)
        while stop > 0 and len(hits) < count:
            start = max(0, stop - window)
            recs = _read_range(bus, topic, p, start, stop, ends, timeout)
            hits.extend(sorted((r.offset for r in recs if matches(r)), reverse=True))
            if start == 0 or not recs:
                break
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
    for (t, p), off in tail_offsets(events.bus, topic, match, timeout).items():
        if off >= ends.get(p, 0):
            continue
        for rec in _read_range(events.bus, t, p, off, off + 1, ends, timeout):
            pv = events.codec.decode(rec.value)
            if best is None or pv.version > best.version:
                best = pv
    return best
