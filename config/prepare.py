"""Settings of the stream processors' prepare pipeline (reorder -> staleness -> importance)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from config.algos import algo_defaults


@dataclass(frozen=True)
class PrepareConfig:
    """Settings of the prepare pipeline (reorder -> staleness -> importance)."""

    max_versions: int = 4
    """K: most policy versions a batch may lag the latest before it is stale."""
    max_ms: int | None = 60_000
    """T: most age of a batch in ms before it is stale (None: no time limit)."""
    staleness_mode: Literal["drop", "downweight"] = "drop"
    """``drop`` stale batches, or ``downweight`` them (and drop below ``min_weight``)."""
    decay: float = 0.5
    """Downweight factor per version past K (and per T past T)."""
    min_weight: float = 0.05
    """Downweight mode: batches whose weight falls below this are dropped."""
    age_from: Literal["batch", "policy"] = "batch"
    """Age is now minus the batch's ``created_at_ms`` or its behaviour version's."""
    reorder_window: int = 32
    """Most batches buffered per actor while waiting for a missing seq."""
    reorder_timeout_ms: int = 1000
    """How long a buffered batch waits for a missing seq before the buffer skips ahead."""
    dedup_capacity: int = 65536
    """How many batch ids are remembered to drop duplicates."""
    dedup_ttl_ms: int | None = None
    """Forget batch ids after this long (None: only ``dedup_capacity`` bounds them)."""
    max_actors: int = 10000
    """Most actors tracked by the reorder buffer."""
    importance: bool = True
    """Compute V-trace IS weights against the latest policy (needs a ``logp_factory``)."""
    rho_bar: float = 1.0
    """V-trace rho-bar."""
    c_bar: float = 1.0
    """V-trace c-bar."""
    behaviour_cap: float | None = 5.0
    """AReaL-style cap: transitions with ratio above it get weight 0 (None: no cap)."""
    policy_id: str | None = "policy"
    """Only follow PolicyVersions of this policy (the learner's ``policy_id``; None: any). Versions
    of other policies on the topic are counted (``policy_ignored``) and ignored, so another
    run's or test's versions never move the staleness window."""

    @classmethod
    def for_algo(cls, algo: str, **overrides: Any) -> "PrepareConfig":
        """The algorithm's row of ``config.algos.ALGO_DEFAULTS``, then ``overrides``."""
        return cls(**{**algo_defaults(algo).prepare(), **overrides})
