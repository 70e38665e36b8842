"""Follows PolicyVersion events and swaps the newest into a local Policy module.

Every follower reads without a consumer group (each must see every version) from the last
record of the topic, so it starts with the current policy without replaying the history.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from agents.networks import Policy
from rlstream.policies import BlobStore, load_into
from schemas.errors import CodecError
from schemas.events import PolicyVersion
from streams.events import EventBus
from streams.topics import POLICY_VERSIONS, PUBLISHED_NS_HEADER



def start_at_last(events: EventBus, topic: str = POLICY_VERSIONS) -> dict:
    ends = events.bus.end_offsets(topic)
    return {(topic, p): max(0, e - 1) for p, e in ends.items()}


class PolicySubscriber:
    """``poll()`` adopts the newest PolicyVersion that arrived (older ones in the same poll are
    skipped: an actor only ever wants the latest). ``policy`` is None until the first one."""

    def __init__(self, events: EventBus, policy_id: str, stage: str,
                 on_latency: Callable[[float], None] | None = None,
                 blob_store: BlobStore | None = None, from_version: int | None = None) -> None:
        self.events = events
        self.policy_id = policy_id
        self.blob_store = blob_store
        self.on_latency = on_latency
        start = "earliest" if from_version is not None else start_at_last(events)
        self.consumer = events.consumer(None, [POLICY_VERSIONS], stage=stage, expect=PolicyVersion, start=start)
        self.from_version = from_version or 0
        self.policy: Policy | None = None
        self.version: int = -1
        self.version_created_ms: int = 0
        self.adopted = 0

    def poll(self, timeout: float = 0.0) -> bool:
        """Adopt the newest version available within ``timeout``; True if one was adopted."""
        candidates = [(rec, pv) for rec, pv in self.consumer.poll(timeout, max_records=1000)
                      if pv.policy_id == self.policy_id and pv.version >= self.from_version
                      and pv.version > self.version]
        # newest first; a version whose weights do not load is skipped and counted (the learner
        # owns its dead letter) and the next newest is tried, so one bad record never leaves the
        # actor on an older policy
        for rec, pv in sorted(candidates, key=lambda c: c[1].version, reverse=True):
            try:
                self.policy = load_into(self.policy, pv, self.blob_store)
                break
            except CodecError as e:
                self.consumer.dead_letter(rec, e.reason, e)
        else:
            return False
        self.version = pv.version
        self.version_created_ms = pv.created_at_ms
        self.adopted += 1
        sent = rec.headers.get(PUBLISHED_NS_HEADER)
        if sent and self.on_latency is not None:
            self.on_latency(max(0.0, (time.time_ns() - int(sent)) / 1e9))
        return True

    def wait_for(self, min_version: int, timeout: float) -> bool:
        """Block until a version >= ``min_version`` is adopted, or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while self.version < min_version:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self.poll(min(remaining, 0.5))
        return True

    def close(self) -> None:
        self.consumer.close()
