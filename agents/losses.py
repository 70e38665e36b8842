"""Policy-loss pieces shared by the algorithms: the clipped surrogate and its ratio diagnostics.
Pure torch; every algorithm imports these from here, none from a sibling."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from agents.base import masked_mean

__all__ = ["clipped_surrogate", "ratio_stats"]


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
