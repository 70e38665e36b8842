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

``lag`` (decoupled experiments, ``TrainConfig.actor.actor_lag_versions``): act with the newest version
at least ``lag`` versions behind the newest received, so every fragment is K versions stale when
it leaves the actor and the whole pipeline (staleness window, importance weights, V-trace) sees
real staleness; until ``lag`` versions exist it acts with the first one it received.

Policy latency (``on_latency``, the guide's go-live figure): seconds from the learner publishing a
version to this subscriber adopting it in place of the version it was acting with. The first
adoption of each subscriber (a new or restarted actor taking its first policy, whichever version
that is and however long ago it was published) ends the actor's start-up rather than measuring
publish-to-use, so it is not counted there but kept apart in ``startup_latency_s``.

Where a counted latency went (``parts``, newest ``PARTS_KEPT``; ``parts_ms()`` gives quantiles):
``in_flight`` (publish to the end of the actor's previous poll, which did not have it yet: the
learner's flush, the broker, the consumer's fetch), ``unpolled`` (from then, or from the publish
if later, to the poll that took it: the version may have waited this long for the actor to look,
or part of it was still in flight), ``poll`` (the consumer call) and ``load`` (weights into the
module). ``where``: the label the caller set before the adopting poll (``Actor``: ``step``,
between env steps; ``fragment``, before one; ``held``, held back by its flow). Two clock reads
per poll.
"""

from __future__ import annotations

import logging
import time
from collections import deque
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
    PolicyUpdate,
    SharedWeights,
    StartRule,
    load_policy,
)

log = logging.getLogger(__name__)

#: Counted adoptions whose latency parts a subscriber keeps (module doc).
PARTS_KEPT = 4096
PARTS = ("in_flight", "unpolled", "poll", "load")


class PolicySubscriber:
    """``poll()`` adopts the newest PolicyVersion that arrived (older ones in the same poll are
    skipped: an actor only ever wants the latest). ``policy`` is None until the first one.
    ``shared``: the process's decoded versions (None: this subscriber decodes and copies alone);
    ``failed``/``last_error``: versions that did not load; ``lag``: module doc."""

    def __init__(self, events: EventBus, policy_id: str, stage: str,
                 on_latency: Callable[[float], None] | None = None,
                 blob_store: Blobs = None, from_version: int | None = None,
                 shared: SharedWeights | None = PROCESS_WEIGHTS, retry: FetchRetry = DEFAULT_RETRY,
                 lag: int = 0) -> None:
        if lag < 0:
            raise ValueError(f"lag must be >= 0, got {lag}")
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
        self.startup_latency_s: float | None = None  # the first adoption's (module doc)
        self.last_error: Exception | None = None
        self.lag = lag
        self.newest = -1  # the newest version received (with a lag, ahead of ``version``)
        self._held: dict[int, PolicyUpdate] = {}  # with a lag: received, not yet due
        self.parts: deque[dict] = deque(maxlen=PARTS_KEPT)  # module doc
        self._polled_ns: int | None = None  # when the previous poll ended
        self.where = ""  # the caller's label of its next poll (module doc)

    def poll(self, timeout: float = 0.0) -> bool:
        """Adopt the newest version available within ``timeout``; True if one was adopted."""
        start = time.time_ns()
        prev, self._polled_ns = self._polled_ns, start
        try:
            return self._poll(timeout, self.where, start, prev)
        finally:
            self._polled_ns = time.time_ns()

    def _poll(self, timeout: float, where: str, start: int, prev: int | None) -> bool:
        candidates = self._due(self.follower.poll(timeout))
        loading = time.time_ns()
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
        done = time.time_ns()
        lat = u.latency_s(done)
        if self.adopted == 1:
            self.startup_latency_s = lat
        elif lat is not None:
            pub = u.published_ns
            looked = start if prev is None else max(prev, pub)
            self.parts.append({"in_flight": max(0, looked - pub) / 1e9 if prev is not None else 0.0,
                               "unpolled": max(0, start - looked) / 1e9, "poll": (loading - start) / 1e9,
                               "load": (done - loading) / 1e9, "latency": lat, "where": where})
            if self.on_latency is not None:
                self.on_latency(lat)
        return True

    def parts_ms(self) -> dict:
        """Quantiles (ms) of each latency part over the kept adoptions, by the adopting poll's
        ``where`` too (module doc); the parts of the slowest 1 % beside them."""
        from runtime.progress import quantiles_ms

        rows = list(self.parts)
        if not rows:
            return {}
        out: dict = {p: quantiles_ms([r[p] for r in rows]) for p in PARTS}
        out["where"] = {w: sum(1 for r in rows if r["where"] == w) for w in sorted({r["where"] for r in rows})}
        worst = sorted(rows, key=lambda r: -r["latency"])[:max(3, len(rows) // 100)]
        out["slowest"] = [{k: (round(v * 1e3, 2) if k != "where" else v) for k, v in r.items()} for r in worst]
        return out

    def _due(self, arrived: list[PolicyUpdate]) -> list[PolicyUpdate]:
        """The versions that may be adopted now: all newer ones, or with a lag those at least
        ``lag`` behind the newest received (the first one received while none is adopted)."""
        for u in arrived:
            self.newest = max(self.newest, u.version)
        if not self.lag:
            return [u for u in arrived if u.version > self.version]
        self._held.update((u.version, u) for u in arrived if u.version > self.version)
        if not self._held:
            return []
        due_to = self.newest - self.lag if self.policy is not None else max(self.newest - self.lag, min(self._held))
        due = [u for v, u in self._held.items() if v <= due_to]
        self._held = {v: u for v, u in self._held.items() if v > due_to}
        return due

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
