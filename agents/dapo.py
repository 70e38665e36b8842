"""DAPO: GRPO with clip-higher, dynamic sampling, step-level loss and truncation shaping.

Differences from ``GRPO`` (same group-relative advantages, same data layout):

* **Clip-higher**: ratio clipped to ``[1 - eps_low, 1 + eps_high]`` with
  ``eps_low = 0.2``, ``eps_high = 0.28``, so low-probability actions with a
  positive advantage can grow more before the clip stops them.
* **Dynamic sampling**: groups whose returns all agree (group std <=
  ``zero_var_tol``) carry zero advantage and only dilute the batch; they are
  dropped before the loss and counted in ``groups_dropped``. (DAPO proper then
  samples more groups until the batch is full; this pure learner cannot sample,
  so the learner shell should size batches for the expected drop rate or
  re-queue. If every group is dropped, no gradient step is taken and
  ``skipped = 1``.)
* **Step-level aggregation**: the loss is the sum over all valid steps of all
  kept rollouts divided by the number of those steps (``loss_aggregation =
  "token"``), so long rollouts are not down-weighted per step.
* **Truncation-aware shaping** (``truncation_mode``), for rollouts that end
  without termination (truncated, or cut by the batch horizon):

  - ``"none"`` (default): no change. Right for control tasks where every
    rollout of a group runs to the same horizon, so partial returns compare fairly.
  - ``"mask"``: DAPO's *overlong filtering*: such rollouts are excluded from the
    group statistics and from the loss (their return is incomplete, so their
    advantage would be biased).
  - ``"soft_penalty"``: DAPO's *soft overlong punishment*, by rollout length
    ``L`` (applied to every rollout, as in DAPO, before grouping), with
    ``L_max = max_length`` (default: the batch horizon T) and ``L_cache =
    overlong_cache``: ``0`` if ``L <= L_max - L_cache``;
    ``((L_max - L_cache) - L) / L_cache`` in ``(L_max - L_cache, L_max]``;
    ``-1`` beyond; multiplied by ``overlong_penalty`` and added to R. Use it
    where shorter is better (goal reaching); it hurts survival tasks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from agents.core import TrajectoryBatch
from agents.grpo import GRPO, GRPOConfig
from agents.returns import group_advantages, group_stats, rollout_returns

__all__ = ["DAPOConfig", "DAPO", "overlong_penalty", "unfinished_rollouts", "dynamic_sampling_mask"]

_TRUNCATION_MODES = ("none", "mask", "soft_penalty")


@dataclass(frozen=True)
class DAPOConfig(GRPOConfig):
    """DAPO defaults on top of ``GRPOConfig``."""

    clip_low: float = 0.2
    """eps_low: ratio >= 1 - clip_low."""
    clip_high: float = 0.28
    """eps_high (clip-higher): ratio <= 1 + clip_high."""
    loss_aggregation: str = "token"
    """Step-level aggregation: sum over all valid steps / number of valid steps."""
    kl_coef: float = 0.0
    """DAPO drops the KL term."""
    dynamic_sampling: bool = True
    """Drop groups whose returns have (near) zero variance."""
    zero_var_tol: float = 1e-8
    """A group is dropped when its return std is <= this."""
    truncation_mode: str = "none"
    """How to treat rollouts that end without termination: none | mask | soft_penalty (see module doc)."""
    max_length: Optional[int] = None
    """L_max of the soft overlong penalty; None = the batch horizon T."""
    overlong_cache: int = 0
    """L_cache of the soft overlong penalty (length of the linear ramp); 0 = a step from 0 to -1 past L_max."""
    overlong_penalty: float = 1.0
    """Scale of the soft overlong penalty (in reward units of R)."""


def overlong_penalty(lengths: Tensor, max_length: int, cache: int) -> Tensor:
    """DAPO soft overlong punishment in ``[-1, 0]`` for rollout lengths ``[N]``."""
    lengths = lengths.to(torch.float32)
    start = float(max_length - cache)
    if cache <= 0:
        return torch.where(lengths > max_length, -torch.ones_like(lengths), torch.zeros_like(lengths))
    ramp = (start - lengths) / float(cache)
    pen = torch.where(lengths <= start, torch.zeros_like(lengths), ramp)
    return torch.where(lengths > max_length, -torch.ones_like(lengths), pen)


def unfinished_rollouts(terminated: Tensor, mask: Tensor) -> Tensor:
    """``[N]`` bool: the column's last valid step is not a termination (truncated or cut off)."""
    T = mask.shape[0]
    steps = torch.arange(T, device=mask.device).unsqueeze(1).expand_as(mask)
    last = torch.where(mask, steps, torch.full_like(steps, -1)).max(0).values  # -1 for empty columns
    idx = last.clamp_min(0)
    term_at_last = terminated.gather(0, idx.unsqueeze(0)).squeeze(0) & (last >= 0)
    return ~term_at_last


def dynamic_sampling_mask(returns: Tensor, group_id: Optional[Tensor], tol: float) -> tuple[Tensor, int, int]:
    """``(keep [N], groups_dropped, groups_total)``: keep columns of groups with return std > tol.

    Singleton groups have no spread and are dropped too.
    """
    _, std, _, inverse = group_stats(returns, group_id, unbiased=False)
    keep = std > tol
    total = int(inverse.max()) + 1 if returns.numel() else 0
    kept_groups = int(torch.unique(inverse[keep]).numel()) if bool(keep.any()) else 0
    return keep, total - kept_groups, total


class DAPO(GRPO):
    """Decoupled-clip, dynamic-sampling policy optimisation (see module doc)."""

    name = "dapo"

    def __init__(self, config: Optional[DAPOConfig], obs_dim: int, act_dim: int, device: str | torch.device = "cpu"):
        config = config or DAPOConfig()
        if config.truncation_mode not in _TRUNCATION_MODES:
            raise ValueError(f"truncation_mode must be one of {_TRUNCATION_MODES}, got {config.truncation_mode!r}")
        super().__init__(config, obs_dim, act_dim, device)
        self.config: DAPOConfig = config

    def _column_advantages(self, batch: TrajectoryBatch, mask: Tensor) -> tuple[Tensor, Tensor, dict[str, float]]:
        cfg = self.config
        returns = rollout_returns(batch.rewards, mask, cfg.gamma)
        unfinished = unfinished_rollouts(batch.terminated, mask)
        lengths = mask.sum(0)
        metrics: dict[str, float] = {"return_mean": float(returns.mean()), "unfinished_rollouts": float(unfinished.sum())}

        eligible = torch.ones_like(returns, dtype=torch.bool)
        if cfg.truncation_mode == "soft_penalty":
            L_max = cfg.max_length if cfg.max_length is not None else batch.num_steps
            pen = cfg.overlong_penalty * overlong_penalty(lengths, L_max, cfg.overlong_cache).to(returns)
            returns = returns + pen
            metrics["overlong_penalty_mean"] = float(pen.mean())
        elif cfg.truncation_mode == "mask":
            eligible = ~unfinished
        metrics["rollouts_masked"] = float((~eligible).sum())

        gid = batch.group_id if batch.group_id is not None else torch.zeros_like(returns, dtype=torch.int64)
        keep = eligible.clone()
        adv = torch.zeros_like(returns)
        groups_dropped, groups_total = 0, int(torch.unique(gid).numel())
        if bool(eligible.any()):
            r_e, g_e = returns[eligible], gid[eligible]
            if cfg.dynamic_sampling:
                keep_e, dropped_e, total_e = dynamic_sampling_mask(r_e, g_e, cfg.zero_var_tol)
                groups_dropped = dropped_e + (groups_total - total_e)  # groups with no eligible rollout count as dropped
            else:
                keep_e = torch.ones_like(r_e, dtype=torch.bool)
                groups_dropped = groups_total - int(torch.unique(g_e).numel())
            adv_e = group_advantages(r_e, g_e, cfg.adv_eps, cfg.scale_adv_by_std, cfg.std_unbiased)
            idx = eligible.nonzero().squeeze(-1)
            adv[idx] = adv_e
            keep[idx] = keep_e
        else:
            groups_dropped = groups_total
        metrics.update(
            {
                "groups_total": float(groups_total),
                "groups_dropped": float(groups_dropped),
                "groups_kept": float(groups_total - groups_dropped),
            }
        )
        return adv, keep, metrics
