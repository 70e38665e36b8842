"""Follows PolicyVersion events and swaps the newest into a local Policy module.

A thin client of ``streams.policies.PolicyFollower``: it starts at the newest version of ITS
policy now on the topic (``StartRule.newest``; ``from_version``: every version from there),
so it acts with the current policy at once without replaying the history.

Adoption is cheap and never fatal: the subscribers of one process share one fetch and decode of
each claim-checked version (``streams.policies.SharedWeights``) and take the decoded tensors by
reference (the actor only reads its module; adoption replaces its tensors, never writes them, so
a sampler's snapshot of the previous version stays intact). A version that does not load (after
the loader's bounded retries) is counted and skipped: the actor keeps the version it has and
takes the next one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from agents.networks import Policy
from schemas.errors import CodecError
from streams.events import EventBus
from streams.policies import (
    DEFAULT_RETRY,
    PROCESS_WEIGHTS,
    Blobs,
    FetchRetry,
    PolicyFollower,
    PolicyLoadError,
    SharedWeights,
    StartRule,
    load_policy,
)

log = logging.getLogger(__name__)


class PolicySubscriber:
    """``poll()`` adopts the newest PolicyVersion that arrived (older ones in the same poll are
    skipped: an actor only ever wants the latest). ``policy`` is None until the first one.
    ``shared``: the process's decoded versions (None: this subscriber decodes and copies alone);
    ``failed``/``last_error``: versions that did not load."""

    def __init__(self, events: EventBus, policy_id: str, stage: str,
                 on_latency: Callable[[float], None] | None = None,
                 blob_store: Blobs = None, from_version: int | None = None,
                 shared: SharedWeights | None = PROCESS_WEIGHTS, retry: FetchRetry = DEFAULT_RETRY) -> None:
        self.events = events
        self.policy_id = policy_id
        self.blob_store = blob_store
        self.on_latency = on_latency
        self.shared = shared
        self.retry = retry
        start = StartRule.newest() if from_version is None else StartRule.at_version(from_version)
        self.follower = PolicyFollower(events, policy_id, start, blobs=blob_store, stage=stage)
        self.policy: Policy | None = None
        self.version: int = -1
        self.version_created_ms: int = 0
        self.adopted = self.failed = 0
        self.last_error: Exception | None = None

    def poll(self, timeout: float = 0.0) -> bool:
        """Adopt the newest version available within ``timeout``; True if one was adopted."""
        candidates = [u for u in self.follower.poll(timeout) if u.version > self.version]
        # newest first; a version whose weights do not load is skipped and counted (the learner
        # owns its dead letter) and the next newest is tried, so one bad record never leaves the
        # actor on an older policy, nor ends it
        for u in sorted(candidates, key=lambda c: c.version, reverse=True):
            try:
                self.policy = load_policy(u.event, self.blob_store, into=self.policy, shared=self.shared,
                                          retry=self.retry)
                break
            except Exception as e:
                err = e if isinstance(e, CodecError) else PolicyLoadError(f"{type(e).__name__}: {e}")
                self.failed += 1
                self.last_error = err
                log.warning("policy %s version %d not adopted (keeping %d): %s", self.policy_id, u.version,
                            self.version, err)
                self.follower.dead_letter(u, err)
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
