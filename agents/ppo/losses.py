"""PPO math: GAE with truncation bootstrapping, clipped surrogate, clipped value loss."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from agents.base import masked_mean
from agents.scan import discounted_scan

__all__ = ["compute_gae", "clipped_surrogate", "policy_loss", "value_loss", "ratio_stats"]


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


def clipped_surrogate(ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: Optional[float] = None) -> Tensor:
    """Per-sample clipped surrogate *loss* ``max(-A * r, -A * clip(r, 1 - low, 1 + high))``."""
    high = clip_low if clip_high is None else clip_high
    return torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + high))


@torch.no_grad()
def ratio_stats(
    logratio: Tensor, clip_low: float, clip_high: Optional[float] = None, mask: Optional[Tensor] = None
) -> dict[str, Tensor]:
    """Diagnostics: ``approx_kl`` (k3, ``(r - 1) - log r``), ``old_approx_kl`` (``-log r``), ``clipfrac``, ``ratio_mean``."""
    high = clip_low if clip_high is None else clip_high
    ratio = logratio.exp()
    clipped = ((ratio < 1.0 - clip_low) | (ratio > 1.0 + high)).to(ratio.dtype)
    return {
        "approx_kl": masked_mean((ratio - 1.0) - logratio, mask),
        "old_approx_kl": masked_mean(-logratio, mask),
        "clipfrac": masked_mean(clipped, mask),
        "ratio_mean": masked_mean(ratio, mask),
    }


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
