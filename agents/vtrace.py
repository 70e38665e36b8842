"""Off-policy correction shared by the learner and the stream processor: truncated importance
weights with one behaviour-cap rule, and V-trace targets (Espeholt et al. 2018, IMPALA).

``importance_weights`` is THE cap rule, used both by ``streams/processors/importance.py`` (against
the newest published policy) and by the algorithms (against the policy that anchors their
update): with ``log_ratio = log pi - log mu``,

* a transition whose ratio exceeds ``behaviour_cap`` (or whose log ratio is not finite) is
  *dropped*: ``rho = c = 0`` -- its behaviour policy is too far away to be corrected;
* the others are *truncated*: ``rho = min(rho_bar, ratio)``, ``c = min(c_bar, ratio)``.

``vtrace`` turns ``rho``/``c`` into value targets ``vs`` and advantages; with ``rho = c = 1``
(on-policy) they are exactly GAE(lambda)'s returns and advantages (``agents/ppo/losses.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from agents.base import PolicyConfig
from agents.scan import discounted_scan

__all__ = ["VTraceConfig", "behaviour_weights", "importance_weights", "vtrace", "RHO_BAR", "C_BAR", "BEHAVIOUR_CAP", "MAX_LOG_RATIO"]

RHO_BAR = 1.0
C_BAR = 1.0
BEHAVIOUR_CAP: Optional[float] = 5.0
MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class VTraceConfig(PolicyConfig):
    """Off-policy correction settings (same defaults as the stream processor's ``PrepareConfig``)."""

    rho_bar: float = RHO_BAR
    """V-trace rho-bar: truncation of the importance weight of the current step."""
    c_bar: float = C_BAR
    """V-trace c-bar: truncation of the trace-cutting weights."""
    behaviour_cap: Optional[float] = BEHAVIOUR_CAP
    """Drop (weight 0) transitions whose ratio pi / mu exceeds this; None: never drop."""
    vtrace: bool = True
    """Correct for the behaviour policy (False: rho = c = 1 everywhere, an ablation)."""


@torch.no_grad()
def behaviour_weights(config: VTraceConfig, log_ratio: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(rho, c, dropped_by_cap)`` of ``config`` for ``log_ratio = log pi - log mu`` (ones without ``vtrace``)."""
    if not config.vtrace:
        ones = torch.ones_like(log_ratio)
        return ones, ones, torch.zeros_like(log_ratio, dtype=torch.bool)
    rho, c, capped, _ = importance_weights(log_ratio, config.rho_bar, config.c_bar, config.behaviour_cap)
    return rho, c, capped


@torch.no_grad()
def importance_weights(
    log_ratio: Tensor,
    rho_bar: float = RHO_BAR,
    c_bar: float = C_BAR,
    behaviour_cap: Optional[float] = BEHAVIOUR_CAP,
    max_log_ratio: float = MAX_LOG_RATIO,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(rho, c, dropped_by_cap, nonfinite)`` for ``log_ratio = log pi - log mu`` (module doc)."""
    finite = torch.isfinite(log_ratio)
    lr = torch.where(finite, log_ratio, torch.zeros_like(log_ratio))
    capped = torch.zeros_like(finite)
    if behaviour_cap is not None:
        capped = finite & (lr > math.log(behaviour_cap))
    keep = (finite & ~capped).to(lr.dtype)
    lr = lr.clamp(-max_log_ratio, max_log_ratio)
    rho = torch.exp(lr.clamp(max=math.log(rho_bar))) * keep
    c = torch.exp(lr.clamp(max=math.log(c_bar))) * keep
    return rho, c, capped, ~finite


@torch.no_grad()
def vtrace(
    rewards: Tensor,
    values: Tensor,
    terminated: Tensor,
    truncated: Tensor,
    last_value: Tensor,
    final_values: Optional[Tensor],
    rho: Tensor,
    c: Tensor,
    gamma: float,
    lam: float = 1.0,
    uncorrected: bool = False,
) -> tuple[Tensor, ...]:
    """V-trace over a time-major ``[T, N]`` batch: ``(vs, advantages)``.

    Next-state values follow ``compute_gae`` (``last_value`` after the last step, 0 after a
    termination, ``final_values[t]`` after a truncation, no trace across an episode end)::

        delta_t = r_t + gamma * V_next_t - V_t
        vs_t - V_t = rho_t * delta_t + gamma * lam * c_t * (1 - done_t) * (vs_{t+1} - V_{t+1})
        A_t = delta_t + gamma * lam * (1 - done_t) * (vs_{t+1} - V_{t+1})

    ``vs`` are the value targets; ``A_t`` estimates ``Q(s_t, a_t) - V(s_t)`` for the *sampled*
    action (IMPALA's policy-gradient advantage is ``rho_t * A_t`` at ``lam = 1``: weight the
    sample by ``rho_t`` where the objective needs it). With ``rho = c = 1`` both equal GAE.

    ``uncorrected=True`` returns ``(vs, advantages, advantages at rho = c = 1)``, the last from
    the same scan (one pass for both).
    """
    terminated, truncated = terminated.bool(), truncated.bool()
    next_values = torch.cat([values[1:], last_value.reshape(1, -1).to(values)], dim=0)
    if final_values is not None:
        next_values = torch.where(truncated, final_values.to(values), next_values)
    else:
        next_values = torch.where(truncated, torch.zeros_like(values), next_values)
    next_values = torch.where(terminated, torch.zeros_like(values), next_values)
    deltas = rewards + gamma * next_values - values
    carry = gamma * lam * (~(terminated | truncated)).to(values.dtype)
    if uncorrected:  # rho = c = 1 along a second column block: there vs - V is GAE's advantage
        x = discounted_scan(torch.cat([rho * deltas, deltas], dim=1), torch.cat([carry * c, carry], dim=1))
        corr, plain = x.split(values.shape[1], dim=1)
    else:
        corr = discounted_scan(rho * deltas, carry * c)  # vs - V
    # A_t = delta_t + carry_t * (vs_{t+1} - V_{t+1}), with 0 after the batch
    adv = torch.addcmul(deltas, carry, torch.cat([corr[1:], torch.zeros_like(corr[:1])], dim=0))
    if uncorrected:
        return values + corr, adv, plain
    return values + corr, adv
