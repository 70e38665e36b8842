"""Staleness: how far behind the newest policy a batch's behaviour policy is, and what to do.

A batch is stale when its behaviour policy is more than ``max_versions`` (K) versions behind
the latest ``PolicyVersion`` seen, or (if ``max_ms`` (T) is set) older than T ms. Two modes:

* ``drop``: a stale batch is rejected with a ``PolicyStalenessError`` (reason
  ``stale_versions`` or ``stale_ms``); the caller dead-letters it.
* ``downweight``: a stale batch keeps a ``weight`` that shrinks with how far past the window
  it is -- ``decay ** (versions - K) * decay ** ((ms - T) / T)`` by default, or any
  ``decay(over_versions, over_ms) -> weight`` callable. Once the weight falls below
  ``min_weight`` the batch is dropped like in ``drop`` mode (the larger factor names the reason).

A fragment collected across an in-flight weight update (``SampleBatch.step_versions``) is judged
by its oldest step, ``policy_version``: never fresher than any of its steps. Per-step weighting
happens downstream (importance weights from the per-step log-probs; the learner's per-step lag,
``learner.batching.step_staleness``).

Nothing here does I/O; ``clock`` (ms) is injected so tests are deterministic::

    w = StalenessWindow(max_versions=4, max_ms=30_000, mode="drop")
    w.on_policy(pv)                      # every PolicyVersion, in any order
    d = w.assess(batch)                  # StalenessDecision; counts freshness and lag
    if not d.keep:
        raise d.error                    # PolicyStalenessError, reason stale_versions/stale_ms
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from schemas.events import PolicyVersion, SampleBatch, now_ms

REASON_STALE_VERSIONS = "stale_versions"
REASON_STALE_MS = "stale_ms"

Mode = Literal["drop", "downweight"]
AgeFrom = Literal["batch", "policy"]
DecayFn = Callable[[int, float], float]


class PolicyStalenessError(Exception):
    """A batch is too far behind the current policy. ``reason`` is the machine-readable tag."""

    def __init__(self, reason: str, versions: int, ms: int, max_versions: int, max_ms: int | None,
                 weight: float = 0.0) -> None:
        self.reason = reason
        self.versions = versions
        self.ms = ms
        self.max_versions = max_versions
        self.max_ms = max_ms
        self.weight = weight
        if reason == REASON_STALE_VERSIONS:
            what = f"{versions} versions behind (max {max_versions})"
        else:
            what = f"{ms} ms old (max {max_ms})"
        super().__init__(f"policy staleness: batch is {what}; weight {weight:.3g}")


@dataclass(slots=True)
class LagStats:
    """Running count / sum / max / last of one lag measure."""

    count: int = 0
    total: float = 0.0
    max: float = 0.0
    last: float = 0.0

    def add(self, x: float) -> None:
        self.count += 1
        self.total += x
        self.last = x
        if x > self.max:
            self.max = x

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "max": self.max, "last": self.last}


@dataclass(slots=True)
class StalenessStats:
    checked_batches: int = 0
    checked_samples: int = 0
    fresh_batches: int = 0
    fresh_samples: int = 0  # within the window (weight 1)
    downweighted_batches: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # batches, by reason
    ahead_batches: int = 0  # behaviour version newer than the latest version seen
    unknown_policy_batches: int = 0  # no PolicyVersion seen yet
    lag_versions: LagStats = field(default_factory=LagStats)
    lag_ms: LagStats = field(default_factory=LagStats)

    @property
    def freshness(self) -> float:
        """Fraction of checked samples that were within the window (1.0 before any)."""
        return self.fresh_samples / self.checked_samples if self.checked_samples else 1.0


@dataclass(frozen=True, slots=True)
class StalenessDecision:
    action: Literal["keep", "downweight", "drop"]
    weight: float
    versions: int  # latest seen - behaviour version, >= 0
    ms: int  # age in ms, >= 0
    current_version: int  # latest version seen (the batch's own when none is newer)
    error: PolicyStalenessError | None = None

    @property
    def keep(self) -> bool:
        return self.action != "drop"

    @property
    def fresh(self) -> bool:
        return self.action == "keep"


class StalenessWindow:
    """Decides keep / downweight / drop per batch against the latest policy version.

    Args:
        max_versions: K, the most versions a batch's behaviour policy may lag the latest.
        max_ms: T, the most age in ms (None: no time limit).
        mode: ``drop`` or ``downweight`` (see the module docstring).
        decay: per-version (and per-T) weight factor in ``downweight`` mode, in (0, 1], or a
            callable ``(versions_over_K, ms_over_T) -> weight``.
        min_weight: in ``downweight`` mode, weights below this drop the batch.
        age_from: ``batch`` (now - batch.created_at_ms) or ``policy`` (now - created_at_ms of
            the behaviour version, the batch's own time when that version was never seen).
        clock: ms clock.
        history: how many versions' creation times to remember (for ``age_from="policy"``).
    """

    def __init__(
        self,
        max_versions: int,
        max_ms: int | None = None,
        mode: Mode = "drop",
        decay: float | DecayFn = 0.5,
        min_weight: float = 0.05,
        age_from: AgeFrom = "batch",
        clock: Callable[[], int] = now_ms,
        history: int = 1024,
    ) -> None:
        if max_versions < 0:
            raise ValueError("max_versions must be >= 0")
        if max_ms is not None and max_ms <= 0:
            raise ValueError("max_ms must be > 0 or None")
        if mode not in ("drop", "downweight"):
            raise ValueError(f"mode must be 'drop' or 'downweight', not {mode!r}")
        if not callable(decay) and not 0.0 < float(decay) <= 1.0:
            raise ValueError("decay must be in (0, 1] or a callable")
        if not 0.0 <= min_weight <= 1.0:
            raise ValueError("min_weight must be in [0, 1]")
        if age_from not in ("batch", "policy"):
            raise ValueError(f"age_from must be 'batch' or 'policy', not {age_from!r}")
        self.max_versions = int(max_versions)
        self.max_ms = None if max_ms is None else int(max_ms)
        self.mode = mode
        self.decay = decay
        self.min_weight = float(min_weight)
        self.age_from = age_from
        self.clock = clock
        self._history: OrderedDict[int, int] = OrderedDict()  # version -> created_at_ms
        self._history_size = max(1, int(history))
        self.latest_version: int | None = None
        self.latest_created_ms: int | None = None
        self.stats = StalenessStats()

    # -- policy stream ----------------------------------------------------------------------
    def on_policy(self, pv: PolicyVersion) -> bool:
        return self.observe_version(pv.version, pv.created_at_ms)

    def observe_version(self, version: int, created_at_ms: int) -> bool:
        """Record a version; True if it is the newest seen so far."""
        version = int(version)
        self._history[version] = int(created_at_ms)
        self._history.move_to_end(version)
        while len(self._history) > self._history_size:
            self._history.popitem(last=False)
        if self.latest_version is None or version > self.latest_version:
            self.latest_version = version
            self.latest_created_ms = int(created_at_ms)
            return True
        return False

    # -- decisions --------------------------------------------------------------------------
    def _weight(self, over_v: int, over_ms: float) -> tuple[float, str]:
        """Downweight-mode weight and the reason that dominates it."""
        if callable(self.decay):
            w = float(self.decay(over_v, over_ms))
            if not math.isfinite(w):
                w = 0.0
            reason = REASON_STALE_VERSIONS if over_v > 0 else REASON_STALE_MS
            return min(1.0, max(0.0, w)), reason
        d = float(self.decay)
        fv = d ** over_v if over_v > 0 else 1.0
        fms = d ** (over_ms / self.max_ms) if over_ms > 0 and self.max_ms else 1.0
        return fv * fms, (REASON_STALE_VERSIONS if fv <= fms else REASON_STALE_MS)

    def decide(self, behaviour_version: int, created_at_ms: int, now: int | None = None) -> StalenessDecision:
        """The decision for a batch of this behaviour version and creation time; no counting."""
        now = self.clock() if now is None else now
        latest = self.latest_version
        if latest is None or behaviour_version >= latest:
            versions, current = 0, int(behaviour_version)
        else:
            versions, current = int(latest - behaviour_version), int(latest)
        born = created_at_ms
        if self.age_from == "policy":
            born = self._history.get(int(behaviour_version), created_at_ms)
        ms = max(0, int(now - born))
        over_v = versions - self.max_versions
        over_ms = ms - self.max_ms if self.max_ms is not None else 0
        if over_v <= 0 and over_ms <= 0:
            return StalenessDecision("keep", 1.0, versions, ms, current)
        if self.mode == "drop":
            reason = REASON_STALE_VERSIONS if over_v > 0 else REASON_STALE_MS
            err = PolicyStalenessError(reason, versions, ms, self.max_versions, self.max_ms, 0.0)
            return StalenessDecision("drop", 0.0, versions, ms, current, err)
        weight, reason = self._weight(max(0, over_v), max(0, over_ms))
        if weight < self.min_weight or weight <= 0.0:
            err = PolicyStalenessError(reason, versions, ms, self.max_versions, self.max_ms, weight)
            return StalenessDecision("drop", 0.0, versions, ms, current, err)
        return StalenessDecision("downweight", weight, versions, ms, current)

    def assess(self, batch: SampleBatch, now: int | None = None) -> StalenessDecision:
        """Decide for ``batch`` and count it (freshness, lag, drops)."""
        d = self.decide(batch.policy_version, batch.created_at_ms, now)
        s = self.stats
        n = batch.size
        s.checked_batches += 1
        s.checked_samples += n
        if self.latest_version is None:
            s.unknown_policy_batches += 1
        elif batch.policy_version > self.latest_version:
            s.ahead_batches += 1
        s.lag_versions.add(d.versions)
        s.lag_ms.add(d.ms)
        if d.action == "keep":
            s.fresh_batches += 1
            s.fresh_samples += n
        elif d.action == "downweight":
            s.downweighted_batches += 1
        else:
            assert d.error is not None
            s.dropped[d.error.reason] = s.dropped.get(d.error.reason, 0) + 1
        return d

    def check(self, batch: SampleBatch, now: int | None = None) -> StalenessDecision:
        """Like ``assess`` but raises the ``PolicyStalenessError`` of a dropped batch."""
        d = self.assess(batch, now)
        if d.error is not None:
            raise d.error
        return d
