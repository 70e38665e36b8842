"""Backward linear recurrences in log depth (pure torch)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["discounted_scan"]


def discounted_scan(a: Tensor, b: Tensor) -> Tensor:
    """``x`` with ``x_t = a_t + b_t * x_{t+1}`` along dim 0 and ``x_T = 0``; any trailing shape.

    Hillis-Steele scan over the affine maps ``x -> a_t + b_t * x``: after the round with offset
    ``d``, ``(a_t, b_t)`` is the composition of steps ``t .. t + 2d - 1`` (clipped at ``T``), by
    ``(a1, b1) after (a2, b2) = (a1 + b1 * a2, b1 * b2)`` -- ``ceil(log2 T)`` rounds of
    whole-tensor ops instead of ``T`` rounds of small ones. It sums in tree order, so it matches
    the sequential loop to rounding, not bit for bit. Out of place (differentiable).
    """
    T = a.shape[0]
    d = 1
    while d < T:
        a = torch.cat([torch.addcmul(a[:-d], b[:-d], a[d:]), a[-d:]])
        if 2 * d < T:  # b is not read after the last round
            b = torch.cat([b[:-d] * b[d:], b[-d:]])
        d *= 2
    return a
