"""PPO losses: the clipped policy objective and the clipped value loss. GAE and the clipped
surrogate live in ``agents.returns`` and ``agents.losses`` (re-exported here for old imports)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from agents.base import masked_mean
from agents.losses import clipped_surrogate, ratio_stats
from agents.returns import compute_gae

__all__ = ["compute_gae", "clipped_surrogate", "policy_loss", "value_loss", "ratio_stats"]


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    clip_coef: float,
    clip_high: Optional[float] = None,
    weight: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
) -> dict[str, Tensor]:
    """PPO clipped objective. Returns ``loss_policy`` plus ``ratio_stats`` diagnostics."""
    logratio = logp - old_logp
    per_sample = clipped_surrogate(logratio.exp(), advantages, clip_coef, clip_high)
    out = {"loss_policy": masked_mean(per_sample, mask, weight)}
    out.update(ratio_stats(logratio, clip_coef, clip_high, mask))
    return out


def value_loss(
    new_values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    clip_coef: Optional[float],
    weight: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
) -> Tensor:
    """``0.5 * (V - R)^2``, or with ``clip_coef`` the pessimistic max with the clipped
    ``old_V + clip(V - old_V, -c, c)`` (CleanRL ``clip_vloss``)."""
    unclipped = (new_values - returns).pow(2)
    if clip_coef is None:
        return 0.5 * masked_mean(unclipped, mask, weight)
    v_clipped = old_values + torch.clamp(new_values - old_values, -clip_coef, clip_coef)
    clipped = (v_clipped - returns).pow(2)
    return 0.5 * masked_mean(torch.maximum(unclipped, clipped), mask, weight)
