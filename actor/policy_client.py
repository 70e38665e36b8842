"""Follows PolicyVersion events and swaps the newest into a local Policy module.

A thin client of ``streams.policies.PolicyFollower``: it starts at the newest version of ITS
policy now on the topic (``StartRule.newest``; ``from_version``: every version from there),
so it acts with the current policy at once without replaying the history.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from agents.networks import Policy
from schemas.errors import CodecError
from streams.events import EventBus
from streams.policies import Blobs, PolicyFollower, StartRule, load_policy


class PolicySubscriber:
    """``poll()`` adopts the newest PolicyVersion that arrived (older ones in the same poll are
    skipped: an actor only ever wants the latest). ``policy`` is None until the first one."""

    def __init__(self, events: EventBus, policy_id: str, stage: str,
                 on_latency: Callable[[float], None] | None = None,
                 blob_store: Blobs = None, from_version: int | None = None) -> None:
        self.events = events
        self.policy_id = policy_id
        self.blob_store = blob_store
        self.on_latency = on_latency
        start = StartRule.newest() if from_version is None else StartRule.at_version(from_version)
        self.follower = PolicyFollower(events, policy_id, start, blobs=blob_store, stage=stage)
        self.policy: Policy | None = None
        self.version: int = -1
        self.version_created_ms: int = 0
        self.adopted = 0

    def poll(self, timeout: float = 0.0) -> bool:
        """Adopt the newest version available within ``timeout``; True if one was adopted."""
        candidates = [u for u in self.follower.poll(timeout) if u.version > self.version]
        # newest first; a version whose weights do not load is skipped and counted (the learner
        # owns its dead letter) and the next newest is tried, so one bad record never leaves the
        # actor on an older policy
        for u in sorted(candidates, key=lambda c: c.version, reverse=True):
            try:
                self.policy = load_policy(u.event, self.blob_store, into=self.policy)
                break
            except CodecError as e:
                self.follower.dead_letter(u, e)
        else:
            return False
        self.version = u.version
        self.version_created_ms = u.created_at_ms
        self.adopted += 1
        lat = u.latency_s()
        if lat is not None and self.on_latency is not None:
            self.on_latency(lat)
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
        self.follower.close()
