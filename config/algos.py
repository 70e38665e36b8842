"""The one table of per-algorithm defaults: data collection, batching and the stream processors'
staleness and importance settings. Pure data, read by ``agents.base`` (``is_on_policy``),
``config.PrepareConfig.for_algo`` and ``config.TrainConfig``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["AlgoDefaults", "ALGO_DEFAULTS", "TRAINABLE", "algo_defaults"]


@dataclass(frozen=True)
class AlgoDefaults:
    """One algorithm's row: what ``rlstream train --algo X`` uses when no flag says otherwise."""

    on_policy: bool
    """The algorithm assumes (near-)fresh data: decoupled actors wait for new versions."""
    num_envs: int
    """Vector env width per actor."""
    group_size: int
    """Envs per start-state group (0: no groups). Group mode makes each column one rollout."""
    train_batch_size: int
    """Transitions per learner update."""
    max_versions: int
    """Staleness window K: most policy versions a batch may lag the latest."""
    max_ms: int | None
    """Staleness window T in ms (None: no time limit)."""
    staleness_mode: Literal["drop", "downweight"] = "drop"
    """Stale batches are dropped, or kept at a lower weight."""
    min_weight: float = 0.05
    """Downweight mode: batches whose weight falls below this are dropped."""
    importance: bool = True
    """The stream processors compute V-trace IS weights against the latest policy."""
    online: bool = True
    """Trained from live rollouts (a ``rlstream train --algo`` choice); DPO trains on replayed data."""
    fragment_steps: int | None = None
    """Steps per env per SampleBatch; None: ``train_batch_size // (num_envs * num_actors)``, or in
    group mode the env's episode horizon (``max_episode_steps``)."""

    def prepare(self) -> dict[str, Any]:
        """The ``PrepareConfig`` fields of this row."""
        return {"max_versions": self.max_versions, "max_ms": self.max_ms, "staleness_mode": self.staleness_mode,
                "min_weight": self.min_weight, "importance": self.importance}


#: PPO, AGRO and TBA bootstrap a learned value, so fragments may cut episodes anywhere: CleanRL's
#: 1 env x 2048 steps. GRPO and DAPO compare whole rollouts from one start state: one group of 8
#: rollouts per fragment, fragments as long as an episode (ended early once all 8 are done), and
#: a small batch, counted in padded steps: 512 is a few groups while rollouts are short and one
#: group per update once they pass 64 steps (InvertedPendulum, 30k steps, 3 seeds: GRPO reached
#: a return of ~290 with 512 vs ~170 with 1024; 8 rollouts per group beat 2 groups of 4).
#: Staleness windows are starting points, not tuned: on-policy methods drop stale data early,
#: off-policy-tolerant ones keep it at a lower weight; DPO learns from replayed preferences (the
#: reference, not the version, anchors its loss), so nothing is ever stale for it.
ALGO_DEFAULTS: dict[str, AlgoDefaults] = {
    "ppo": AlgoDefaults(on_policy=True, num_envs=1, group_size=0, train_batch_size=2048,
                        max_versions=4, max_ms=60_000),
    "grpo": AlgoDefaults(on_policy=True, num_envs=8, group_size=8, train_batch_size=512,
                         max_versions=1, max_ms=60_000),
    "dapo": AlgoDefaults(on_policy=True, num_envs=8, group_size=8, train_batch_size=512,
                         max_versions=1, max_ms=60_000),
    "agro": AlgoDefaults(on_policy=False, num_envs=1, group_size=0, train_batch_size=2048,
                         max_versions=4, max_ms=120_000, staleness_mode="downweight"),
    "tba": AlgoDefaults(on_policy=False, num_envs=1, group_size=0, train_batch_size=2048,
                        max_versions=16, max_ms=300_000, staleness_mode="downweight", min_weight=0.01),
    "dpo": AlgoDefaults(on_policy=False, num_envs=1, group_size=0, train_batch_size=2048,
                        max_versions=1 << 30, max_ms=None, importance=False, online=False),
}

#: The ``rlstream train --algo`` choices.
TRAINABLE: tuple[str, ...] = tuple(name for name, row in ALGO_DEFAULTS.items() if row.online)


def algo_defaults(algo: str) -> AlgoDefaults:
    """The row of ``algo`` (case-insensitive); unknown names raise ``ValueError``."""
    try:
        return ALGO_DEFAULTS[algo.lower()]
    except KeyError:
        raise ValueError(f"unknown algorithm {algo!r}; choose from {sorted(ALGO_DEFAULTS)}") from None
