"""Role interface and data contract between the learner shell and the algorithms.

The learner shell (``learner/``) drives every algorithm the same way::

    algo = make_algorithm("ppo", obs_dim, act_dim, overrides, device)
    publish(algo.policy.state_dict())            # version 0
    for prepared in consume("rl.samples.prepared"):
        batch = TrajectoryBatch.from_numpy(**arrays_of(prepared))
        metrics = algo.update(batch)              # one learner step
        emit_gradient_step(metrics)
        publish(algo.policy.state_dict())         # next version
        if time_to_snapshot: save(algo.state_dict())

Actors only need the ``Policy`` module, built from a version's recorded architecture
(``policy_from_arch``, through ``streams.policies``' loader) with its weights loaded; they call
``policy.act`` and never update anything.

``TrajectoryBatch`` conventions (time-major, ``T`` steps by ``N`` columns):

* ``obs[t]`` is the observation the action ``actions[t]`` was taken in.
* ``rewards[t]``, ``terminated[t]``, ``truncated[t]`` are what the env returned
  for that action.
* When step ``t`` ended an episode (terminated or truncated), ``obs[t + 1]`` is
  the *reset* observation of the next episode, so the true final observation
  of a truncated episode is carried separately in ``next_obs_final[t]``.
* ``last_obs`` is the observation after the last step (``obs[T]``), used to
  bootstrap the value of an unfinished episode at the batch boundary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Protocol, Union, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from agents.networks import Policy

__all__ = ["Algorithm", "TrajectoryBatch", "as_tensor"]

ScalarOrTensor = Union[float, int, Tensor]

_BOOL_FIELDS = {"terminated", "truncated", "mask"}
_INT_FIELDS = {"group_id", "stream_ids"}


def as_tensor(x: Any, name: str = "") -> Any:
    """numpy / scalar / tensor -> tensor, zero-copy where the dtype allows.

    Floats become float32 (a copy only if they were not already), the bool
    fields (``terminated``, ``truncated``, ``mask``) become bool, the id fields
    int64. ``None`` passes through.
    """
    if x is None:
        return None
    if isinstance(x, np.ndarray):
        if not x.flags.writeable:  # torch.from_numpy warns on read-only arrays
            x = x.copy()
        t = torch.from_numpy(np.ascontiguousarray(x))
    elif isinstance(x, Tensor):
        t = x
    else:
        t = torch.as_tensor(x)
    if name in _BOOL_FIELDS:
        return t if t.dtype == torch.bool else t != 0
    if name in _INT_FIELDS:
        return t if t.dtype == torch.int64 else t.to(torch.int64)
    if t.is_floating_point() and t.dtype != torch.float32:
        return t.to(torch.float32)
    if not t.is_floating_point() and name not in _BOOL_FIELDS | _INT_FIELDS:
        return t.to(torch.float32)
    return t


@dataclass(frozen=True)
class TrajectoryBatch:
    """Time-major batch of transitions. All tensors; ``T`` steps, ``N`` columns.

    Fields marked optional may be ``None``; each algorithm documents which it needs.
    """

    obs: Tensor
    """``[T, N, obs_dim]`` float32 raw (un-normalised) observations."""
    actions: Tensor
    """``[T, N, act_dim]`` float32 actions as *sampled* (before clipping to the action space)."""
    rewards: Tensor
    """``[T, N]`` float32 raw env rewards (scaling, if any, is the learner's job)."""
    terminated: Tensor
    """``[T, N]`` bool: the episode ended in a terminal state at step t (no bootstrap)."""
    truncated: Tensor
    """``[T, N]`` bool: the episode was cut at step t (time limit); bootstrap from ``next_obs_final[t]``."""
    behaviour_logp: Tensor
    """``[T, N]`` float32 log-density of ``actions`` under the behaviour policy that produced them."""
    last_obs: Optional[Tensor] = None
    """``[N, obs_dim]`` observation after the last step (``obs[T]``), for bootstrapping. Needed by PPO/value baselines."""
    values: Optional[Tensor] = None
    """``[T, N]`` behaviour-time value estimates, or None -> the learner recomputes them."""
    next_obs_final: Optional[Tensor] = None
    """``[T, N, obs_dim]`` true final observation where ``truncated``; other entries are ignored (any value)."""
    is_rho: Optional[Tensor] = None
    """``[T, N]`` truncated importance weights rho (V-trace rho-bar); None means all ones."""
    is_c: Optional[Tensor] = None
    """``[T, N]`` truncated trace-cutting weights c (V-trace c-bar); None means all ones."""
    staleness_versions: ScalarOrTensor = 0.0
    """Scalar or ``[T, N]``: how many policy versions the behaviour policy was behind the learner's."""
    staleness_ms: ScalarOrTensor = 0.0
    """Scalar or ``[T, N]``: age of the data in milliseconds when it reached the learner."""
    group_id: Optional[Tensor] = None
    """``[N]`` int64: columns with the same id are rollouts from the same start state (GRPO/DAPO/TB)."""
    sample_weight: Optional[Tensor] = None
    """``[T, N]`` float32 extra per-sample loss weights (e.g. from the staleness processor); None means ones."""
    mask: Optional[Tensor] = None
    """``[T, N]`` bool valid-step mask (False = padding). None: every step is valid. Group algorithms
    (GRPO/DAPO/TB) further keep only each column's steps up to and including its first episode end."""
    stream_ids: Optional[Tensor] = None
    """``[N]`` int64 stable ids of the env instances behind the columns (e.g. ``actor_idx * num_envs + env_idx``),
    so the learner's reward scaler continues the right running return across batches. None: column index."""

    def __post_init__(self) -> None:
        if self.obs.dim() != 3:
            raise ValueError(f"obs must be [T, N, obs_dim], got {tuple(self.obs.shape)}")
        T, N = self.obs.shape[:2]
        for name in ("rewards", "terminated", "truncated", "behaviour_logp"):
            if tuple(getattr(self, name).shape) != (T, N):
                raise ValueError(f"{name} must be [T, N]=({T}, {N}), got {tuple(getattr(self, name).shape)}")
        if self.actions.dim() != 3 or tuple(self.actions.shape[:2]) != (T, N):
            raise ValueError(f"actions must be [T, N, act_dim], got {tuple(self.actions.shape)}")
        for name in ("values", "is_rho", "is_c", "sample_weight", "mask"):
            v = getattr(self, name)
            if v is not None and tuple(v.shape) != (T, N):
                raise ValueError(f"{name} must be [T, N]=({T}, {N}), got {tuple(v.shape)}")
        for name in ("staleness_versions", "staleness_ms"):
            v = getattr(self, name)
            if isinstance(v, Tensor) and v.dim() > 0 and tuple(v.shape) != (T, N):
                raise ValueError(f"{name} must be a scalar or [T, N], got {tuple(v.shape)}")
        if self.last_obs is not None and tuple(self.last_obs.shape) != (N, self.obs.shape[2]):
            raise ValueError(f"last_obs must be [N, obs_dim], got {tuple(self.last_obs.shape)}")
        if self.next_obs_final is not None and tuple(self.next_obs_final.shape) != tuple(self.obs.shape):
            raise ValueError(f"next_obs_final must be [T, N, obs_dim], got {tuple(self.next_obs_final.shape)}")
        for name in ("group_id", "stream_ids"):
            v = getattr(self, name)
            if v is not None and tuple(v.shape) != (N,):
                raise ValueError(f"{name} must be [N]=({N},), got {tuple(v.shape)}")

    @property
    def num_steps(self) -> int:
        return int(self.obs.shape[0])

    @property
    def num_columns(self) -> int:
        return int(self.obs.shape[1])

    @classmethod
    def from_numpy(cls, **arrays: Any) -> "TrajectoryBatch":
        """Build from numpy arrays (or scalars/tensors) named like the fields.

        Zero-copy for contiguous float32 / bool / int64 arrays; other dtypes are
        converted once. Unknown names raise ``TypeError``.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(arrays) - names
        if unknown:
            raise TypeError(f"unknown TrajectoryBatch fields: {sorted(unknown)}")
        kwargs = {}
        for k, v in arrays.items():
            if k in ("staleness_versions", "staleness_ms") and isinstance(v, (int, float)):
                kwargs[k] = float(v)
            else:
                kwargs[k] = as_tensor(v, k)
        return cls(**kwargs)

    def to(self, device: Union[str, torch.device]) -> "TrajectoryBatch":
        """Copy of the batch with every tensor on ``device`` (no-op for tensors already there)."""
        changes = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor):
                changes[f.name] = v.to(device, non_blocking=True)
        return dataclasses.replace(self, **changes)

    def staleness_tensor(self, name: str) -> Tensor:
        """``staleness_versions``/``staleness_ms`` broadcast to ``[T, N]`` float32."""
        v = getattr(self, name)
        shape = self.rewards.shape
        t = torch.as_tensor(v, dtype=torch.float32, device=self.rewards.device)
        return t.expand(shape) if t.dim() == 0 else t


@runtime_checkable
class Algorithm(Protocol):
    """One learning algorithm, as the learner shell sees it.

    Attributes:
        policy: the ``Policy`` module whose ``state_dict()`` is published to actors.
        is_on_policy: True if the algorithm assumes (near-)fresh data (``config.algos``).
    """

    policy: Policy
    is_on_policy: bool

    def update(self, batch: Any) -> dict[str, float]:
        """One learner step on ``batch`` (a ``TrajectoryBatch``; DPO takes a ``PreferenceBatch``).

        Returns float metrics: ``loss_*`` entries plus diagnostics.
        """
        ...

    def state_dict(self) -> dict:
        """Full learner state (policy, optimiser, normalisers, reference nets, step, RNG) for snapshots."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from ``state_dict()`` (resume / rollback)."""
        ...
