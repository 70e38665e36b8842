"""Returns and advantages shared by the algorithms: GAE, value bootstrapping, rollout returns
and group statistics. Pure torch; every algorithm imports these from here, none from a sibling."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from agents.core import TrajectoryBatch
from agents.scan import discounted_scan

__all__ = ["compute_gae", "bootstrap_values", "rollout_returns", "group_stats", "group_advantages"]


@torch.no_grad()
def compute_gae(
    rewards: Tensor,
    values: Tensor,
    terminated: Tensor,
    truncated: Tensor,
    last_value: Tensor,
    final_values: Optional[Tensor],
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over a time-major ``[T, N]`` batch.

    ``next_value[t]`` is ``values[t + 1]`` (``last_value`` at ``t = T - 1``), except:

    * terminated at t: 0 (no bootstrap);
    * truncated at t: ``final_values[t]`` = V(true final obs), not the value of
      the reset obs that follows in ``values[t + 1]``. With ``final_values=None``
      truncation is treated as termination (CleanRL's behaviour).

    ``delta[t] = r[t] + gamma * next_value[t] - values[t]`` and the trace is cut
    at every episode end: ``A[t] = delta[t] + gamma * lam * (1 - done[t]) * A[t + 1]``.

    Returns ``(advantages, returns = advantages + values)``.
    """
    terminated = terminated.bool()
    truncated = truncated.bool()
    next_values = torch.cat([values[1:], last_value.reshape(1, -1).to(values)], dim=0)
    boot = final_values.to(values) if final_values is not None else torch.zeros_like(values)
    next_values = torch.where(truncated, boot, next_values)
    next_values = torch.where(terminated, torch.zeros_like(values), next_values)
    deltas = rewards + gamma * next_values - values
    carry = gamma * lam * (~(terminated | truncated)).to(values.dtype)
    advantages = discounted_scan(deltas, carry)
    return advantages, advantages + values


@torch.no_grad()
def bootstrap_values(
    policy, batch: TrajectoryBatch, bootstrap_on_truncation: bool, use_batch_values: bool = True
) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """``(values [T, N], last_value [N], final_values [T, N] or None)`` with the current policy.

    Behaviour-time ``batch.values`` are used when present and ``use_batch_values``. ``last_obs`` may be
    omitted only if every column ended at the last step; ``next_obs_final`` is
    required when some step is truncated and bootstrapping is on.
    """
    values = batch.values if (use_batch_values and batch.values is not None) else policy.value(batch.obs)
    done_last = batch.terminated[-1] | batch.truncated[-1]
    if batch.last_obs is not None:
        last_value = policy.value(batch.last_obs)
    elif bool(done_last.all()):
        last_value = torch.zeros_like(values[0])
    else:
        raise ValueError("TrajectoryBatch.last_obs is required to bootstrap unfinished columns")
    final_values = None
    if bootstrap_on_truncation and bool(batch.truncated.any()):
        if batch.next_obs_final is None:
            raise ValueError("TrajectoryBatch.next_obs_final is required when steps are truncated (bootstrap_on_truncation)")
        trunc = batch.truncated
        final_values = torch.zeros_like(values)
        final_values[trunc] = policy.value(batch.next_obs_final[trunc])
    return values, last_value, final_values


@torch.no_grad()
def rollout_returns(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """``[N]`` return of each column over its valid steps: ``sum_t gamma^t * r_t * mask_t``."""
    T = rewards.shape[0]
    disc = gamma ** torch.arange(T, dtype=rewards.dtype, device=rewards.device)
    return (rewards * mask.to(rewards.dtype) * disc.unsqueeze(1)).sum(0)


def group_stats(values: Tensor, group_id: Optional[Tensor], unbiased: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-column ``(group_mean, group_std, group_size, group_index)`` of ``values [N]``.

    ``group_index`` maps each column to ``0..num_groups - 1``. ``group_id=None``
    puts every column in one group.
    """
    n = values.shape[0]
    if group_id is None:
        inverse = torch.zeros(n, dtype=torch.int64, device=values.device)
    else:
        _, inverse = torch.unique(group_id.to(values.device), return_inverse=True)
    num_groups = int(inverse.max()) + 1 if n else 0
    ones = torch.ones_like(values)
    size = torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, inverse, ones)
    total = torch.zeros_like(size).index_add_(0, inverse, values)
    mean = total / size
    sq = torch.zeros_like(size).index_add_(0, inverse, (values - mean[inverse]).pow(2))
    denom = (size - 1.0).clamp_min(1.0) if unbiased else size
    std = torch.sqrt(sq / denom)
    std = torch.where(size > 1, std, torch.zeros_like(std))
    return mean[inverse], std[inverse], size[inverse], inverse


@torch.no_grad()
def group_advantages(
    returns: Tensor,
    group_id: Optional[Tensor],
    eps: float = 1e-4,
    scale_by_std: bool = True,
    unbiased: bool = True,
) -> Tensor:
    """``(R - mean_group) / (std_group + eps)`` per column (``[N]``)."""
    mean, std, _, _ = group_stats(returns, group_id, unbiased)
    adv = returns - mean
    return adv / (std + eps) if scale_by_std else adv
