"""Recorded PreparedBatch fragments for learner tests: fixed by their index, Pendulum-sized."""

from __future__ import annotations

import numpy as np

from schemas.events import PreparedBatch, SampleBatch, now_ms

OBS, ACT, N = 3, 1, 2


def fragment(i: int, steps: int = 16) -> PreparedBatch:
    """A recorded fragment: fixed by ``i`` (the same on every rank and in the single learner)."""
    rng = np.random.default_rng(1000 + i)
    sb = SampleBatch(
        batch_id=f"b{i}", actor_id=f"actor-{i % 2}", seq=i, env_id="Pendulum-v1", policy_version=0,
        created_at_ms=now_ms(), obs=rng.normal(size=(steps, N, OBS)).astype(np.float32),
        actions=rng.normal(size=(steps, N, ACT)).astype(np.float32),
        rewards=rng.normal(size=(steps, N)).astype(np.float32),
        terminated=rng.random((steps, N)) < 0.05, truncated=np.zeros((steps, N), bool),
        behaviour_logp=rng.normal(-1.0, 0.1, size=(steps, N)).astype(np.float32),
        last_obs=rng.normal(size=(N, OBS)).astype(np.float32),
        final_obs_index=np.zeros(0, np.int64), final_obs=np.zeros((0, OBS), np.float32),
    )
    ones = np.ones((steps, N), np.float32)
    return PreparedBatch(sb, 0, 0, 0, ones, ones, now_ms())
