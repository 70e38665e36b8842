"""PreparedBatch events -> one TrajectoryBatch (pure; no I/O), and that batch onto the learner's
device once (``to_device``: pinned host memory and non-blocking copies on CUDA)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

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


def step_staleness(b: PreparedBatch) -> np.ndarray:
    """[T] versions each step's behaviour policy lags the one ``b`` was weighted against. A
    fragment's ``staleness_versions`` is its first (oldest) step's; with in-flight weight updates
    (``SampleBatch.step_versions``) a later step acted with a newer version and lags that much
    less (never below 0: a step newer than the processors' latest is not stale)."""
    s = b.sample
    lag = np.full(s.num_steps, b.staleness_versions, np.int64)
    if s.step_versions is not None:
        lag = np.maximum(0, lag - (s.step_versions - s.policy_version))
    return lag


def _padded(b: PreparedBatch, T: int) -> dict[str, np.ndarray]:
    """The [T_b, N] arrays of fragment ``b``, zero-padded in time to ``T`` steps, with a ``mask``
    of its real steps.

    A step fragment (no group ids) is padded at the START, so its last real step is the batch's
    last step and bootstraps from ``last_obs`` exactly as it would alone: each column's
    returns/GAE are those of the fragment by itself, whatever the bootstrap mode, and nothing
    from the padding flows back (the recursions run backward in time).

    A group fragment (one rollout per column, discounted from its first step) is padded at the
    END; a column that did not end its episode at the fragment's last step is marked truncated
    there, with ``last_obs`` as its true next observation, so the group algorithms cut it exactly
    as they would at a batch boundary."""
    s = b.sample
    Tb, N = s.num_steps, s.num_envs
    ones = np.ones((Tb, N), np.float32)
    cols = {
        "obs": s.obs, "actions": s.actions, "rewards": s.rewards, "terminated": s.terminated,
        "truncated": s.truncated, "behaviour_logp": s.behaviour_logp, "next_obs_final": dense_final_obs(b),
        "is_rho": b.is_rho, "is_c": b.is_c, "staleness_versions": ones * step_staleness(b).astype(np.float32)[:, None],
        "staleness_ms": ones * b.staleness_ms, "sample_weight": ones * b.sample_weight,
        "mask": np.ones((Tb, N), bool),
    }
    if Tb == T:
        return cols
    real = slice(0, Tb) if s.group_ids is not None else slice(T - Tb, T)
    out = {}
    for k, v in cols.items():
        pad = np.zeros((T,) + v.shape[1:], v.dtype)
        pad[real] = v
        out[k] = pad
    if s.group_ids is not None:
        cut = ~(s.terminated[-1] | s.truncated[-1])
        out["truncated"][Tb - 1] |= cut
        out["next_obs_final"][Tb - 1, cut] = s.last_obs[cut]
    return out


def to_trajectory_batch(batches: list[PreparedBatch], stream_ids: StreamIds) -> TrajectoryBatch:
    """Concatenate fragments of any lengths along the env axis.

    Fragments of different lengths are zero-padded to the longest (see ``_padded``) and the
    batch gets a ``mask`` of the real steps; fragments of equal length give ``mask=None``. Group
    ids are renumbered per fragment, so groups of different actors (or fragments) never merge."""
    if not batches:
        raise ValueError("no batches")
    T = max(b.sample.num_steps for b in batches)
    ragged = any(b.sample.num_steps != T for b in batches)
    parts = [_padded(b, T) for b in batches]

    def cat(key: str) -> np.ndarray:
        xs = [p[key] for p in parts]
        return xs[0] if len(xs) == 1 else np.concatenate(xs, axis=1)

    group = None
    if all(b.sample.group_ids is not None for b in batches):
        ids, offset = [], 0
        for b in batches:
            _, local = np.unique(b.sample.group_ids, return_inverse=True)
            ids.append(local.astype(np.int64) + offset)
            offset += int(local.max()) + 1 if local.size else 0
        group = np.concatenate(ids)
    names = ("obs", "actions", "rewards", "terminated", "truncated", "behaviour_logp", "next_obs_final",
             "is_rho", "is_c", "staleness_versions", "staleness_ms", "sample_weight")
    return TrajectoryBatch.from_numpy(
        **{k: cat(k) for k in names},
        last_obs=np.concatenate([b.sample.last_obs for b in batches], axis=0),
        mask=cat("mask") if ragged else None,
        group_id=group,
        stream_ids=np.concatenate([stream_ids.ids(b.sample.actor_id, b.sample.num_envs) for b in batches]),
    )


def copy_plan(device: torch.device | str) -> tuple[bool, bool]:
    """``(pin, non_blocking)`` of the host-to-``device`` copy: both on CUDA (page-locked memory
    lets the copy run asynchronously beside the host), neither where the batch stays on the host."""
    on_cuda = torch.device(device).type == "cuda"
    return on_cuda, on_cuda


def to_device(batch: TrajectoryBatch, device: torch.device | str, pin: bool | None = None) -> TrajectoryBatch:
    """``batch`` with every tensor on ``device``, each moved once: pinned first when ``pin``
    (default: ``copy_plan``), then copied non-blocking. A batch already there is returned as is
    (zero-copy on CPU: the tensors still share the numpy arrays' memory)."""
    device = torch.device(device)
    plan_pin, non_blocking = copy_plan(device)
    pin = plan_pin if pin is None else pin
    changes = {}
    for f in dataclasses.fields(batch):
        v = getattr(batch, f.name)
        if isinstance(v, torch.Tensor) and v.device != device:
            if pin and v.device.type == "cpu" and not v.is_pinned():
                v = v.pin_memory()
            changes[f.name] = v.to(device, non_blocking=non_blocking)
    return dataclasses.replace(batch, **changes) if changes else batch
