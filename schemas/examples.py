"""Valid example events (for tests, benchmarks and docs), deterministic from a seed.

    batch = sample_batch(T=8, N=4, obs_dim=17, act_dim=6)
    batch = sample_batch_of_size(256 * 1024)     # T chosen so the encoding is ~256 KiB
    for ev in example_events(): ...              # one of every event type
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from schemas.events import (
    ClaimCheck,
    DeadLetter,
    GradientStep,
    PolicyVersion,
    PreferencePair,
    PreparedBatch,
    SampleBatch,
)


def sample_batch(T: int = 8, N: int = 4, obs_dim: int = 17, act_dim: int = 6, seed: int = 0,
                 actor_id: str = "actor-0", seq: int = 0, policy_version: int = 3) -> SampleBatch:
    """A valid [T, N] rollout fragment (MuJoCo-like dims by default: HalfCheetah 17/6)."""
    rng = np.random.default_rng(seed)
    truncated = np.zeros((T, N), dtype=bool)
    truncated[-1, 0] = True
    k = int(truncated.sum())
    return SampleBatch(
        batch_id=f"b-{seed:08d}-{seq:06d}",
        actor_id=actor_id,
        seq=seq,
        env_id="HalfCheetah-v5",
        policy_version=policy_version,
        created_at_ms=1_700_000_000_000 + seq,
        obs=rng.standard_normal((T, N, obs_dim), dtype=np.float32),
        actions=rng.standard_normal((T, N, act_dim), dtype=np.float32),
        rewards=rng.standard_normal((T, N), dtype=np.float32),
        terminated=rng.random((T, N)) < 0.05,
        truncated=truncated,
        behaviour_logp=-rng.random((T, N), dtype=np.float32),
        last_obs=rng.standard_normal((N, obs_dim), dtype=np.float32),
        final_obs_index=np.flatnonzero(truncated.reshape(-1)).astype(np.int64),
        final_obs=rng.standard_normal((k, obs_dim), dtype=np.float32),
        group_ids=np.arange(N, dtype=np.int64) // 2,
        episode_returns=[float(x) for x in rng.standard_normal(2)],
        episode_lengths=[1000, 250],
    )


def sample_batch_of_size(target_bytes: int, N: int = 16, obs_dim: int = 17, act_dim: int = 6,
                         seed: int = 0, codec: Any = None) -> SampleBatch:
    """A SampleBatch whose encoding is about ``target_bytes`` (the largest T not above it, T >= 1)."""
    from schemas.codec import Codec

    codec = codec or Codec()

    def size(t: int) -> int:
        return len(codec.encode(sample_batch(t, N, obs_dim, act_dim, seed)))

    per_step = size(2) - size(1)
    t = max(1, (target_bytes - (size(1) - per_step)) // per_step)
    return sample_batch(int(t), N, obs_dim, act_dim, seed)


def example_events(seed: int = 0) -> list[Any]:
    """One valid event of every type the codec writes (ClaimCheck travels inside PolicyVersion)."""
    rng = np.random.default_rng(seed)
    sb = sample_batch(seed=seed)
    shape = sb.rewards.shape
    return [
        sb,
        dataclasses.replace(sb, group_ids=None, episode_returns=[], episode_lengths=[], seq=1),
        PreparedBatch(
            sample=sb, current_version=5, staleness_versions=2, staleness_ms=120,
            is_rho=rng.random(shape, dtype=np.float32), is_c=rng.random(shape, dtype=np.float32),
            prepared_at_ms=1_700_000_000_500, sample_weight=0.5, source_partition=2, source_offset=41,
        ),
        PolicyVersion(policy_id="pi", version=7, created_at_ms=1_700_000_000_000, learner_id="learner-0",
                      algo="ppo", weights=bytes(rng.integers(0, 256, 64, dtype=np.uint8)), parent_version=6,
                      metrics={"loss_pi": 0.25, "kl": 0.01}),
        PolicyVersion(policy_id="pi", version=8, created_at_ms=1_700_000_000_001, learner_id="learner-0",
                      algo="ppo", weights_ref=ClaimCheck(store="redis", key="rl:w:pi:8", sha256="ab" * 32,
                                                         size=123456789)),
        GradientStep(learner_id="learner-0", step=11, from_version=7, to_version=8, algo="ppo",
                     losses={"loss_pi": 0.1, "loss_v": 0.2}, grad_norm=1.5, batch_ids=["b1", "b2"],
                     num_samples=512, started_at_ms=1_700_000_000_000, finished_at_ms=1_700_000_000_040),
        PreferencePair(pair_id="p1", env_id="HalfCheetah-v5", policy_version=3,
                       obs_w=rng.standard_normal((5, 17), dtype=np.float32),
                       act_w=rng.standard_normal((5, 6), dtype=np.float32),
                       obs_l=rng.standard_normal((5, 17), dtype=np.float32),
                       act_l=rng.standard_normal((5, 6), dtype=np.float32),
                       return_w=10.0, return_l=-2.0, source_batch_ids=["b1"], created_at_ms=1_700_000_000_000),
        DeadLetter(topic="rl.samples.raw", partition=1, offset=99, value=b"\x00garbage", reason="corrupt",
                   error_class="CorruptEventError", stage="learner", occurred_at_ms=1_700_000_000_000,
                   key=b"actor-0", headers={"rl-schema": b"rlstream.SampleBatch/1"}, detail="bad magic"),
        # in-flight weight updates: versions 3, then 4 from step 3, then 5 from step 6
        dataclasses.replace(sb, seq=2, step_versions=np.repeat(np.array([3, 4, 5], np.int64), [3, 3, shape[0] - 6])),
    ]


def events_equal(a: Any, b: Any) -> bool:
    """Field-by-field equality where arrays compare by dtype, shape and content."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
    if dataclasses.is_dataclass(a):
        return all(events_equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(events_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(events_equal(a[k], b[k]) for k in a)
    return a == b
