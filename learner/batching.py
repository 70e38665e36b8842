"""PreparedBatch events -> one TrajectoryBatch (pure; no I/O)."""

from __future__ import annotations

import numpy as np

from agents.core import TrajectoryBatch
from schemas.events import PreparedBatch


class StreamIds:
    """Stable int ids for (actor_id, env column), so per-env learner state (the reward scaler's
    running return) continues across batches from the same env."""

    def __init__(self) -> None:
        self._base: dict[str, int] = {}
        self._next = 0

    def ids(self, actor_id: str, num_envs: int) -> np.ndarray:
        base = self._base.get(actor_id)
        if base is None:
            base = self._base[actor_id] = self._next
            self._next += max(num_envs, 1024)  # room for an actor that widens its vector env
        return base + np.arange(num_envs, dtype=np.int64)


def dense_final_obs(p: PreparedBatch) -> np.ndarray:
    s = p.sample
    out = np.zeros_like(s.obs)
    if s.final_obs_index.size:
        t, n = np.divmod(s.final_obs_index, s.num_envs)
        out[t, n] = s.final_obs
    return out


def to_trajectory_batch(batches: list[PreparedBatch], stream_ids: StreamIds) -> TrajectoryBatch:
    """Concatenate fragments of equal length T along the env axis."""
    if not batches:
        raise ValueError("no batches")
    T = batches[0].sample.num_steps
    if any(b.sample.num_steps != T for b in batches):
        raise ValueError("fragments of different lengths cannot share one TrajectoryBatch")

    def cat(get) -> np.ndarray:
        parts = [get(b) for b in batches]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)

    def per_col(b: PreparedBatch, value: float) -> np.ndarray:
        return np.full((T, b.sample.num_envs), value, np.float32)

    group = None
    if all(b.sample.group_ids is not None for b in batches):
        group = np.concatenate([b.sample.group_ids for b in batches])
    return TrajectoryBatch.from_numpy(
        obs=cat(lambda b: b.sample.obs),
        actions=cat(lambda b: b.sample.actions),
        rewards=cat(lambda b: b.sample.rewards),
        terminated=cat(lambda b: b.sample.terminated),
        truncated=cat(lambda b: b.sample.truncated),
        behaviour_logp=cat(lambda b: b.sample.behaviour_logp),
        last_obs=np.concatenate([b.sample.last_obs for b in batches], axis=0),
        next_obs_final=cat(dense_final_obs),
        is_rho=cat(lambda b: b.is_rho),
        is_c=cat(lambda b: b.is_c),
        staleness_versions=cat(lambda b: per_col(b, b.staleness_versions)),
        staleness_ms=cat(lambda b: per_col(b, b.staleness_ms)),
        sample_weight=cat(lambda b: per_col(b, b.sample_weight)),
        group_id=group,
        stream_ids=np.concatenate([stream_ids.ids(b.sample.actor_id, b.sample.num_envs) for b in batches]),
    )
