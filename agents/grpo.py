"""GRPO: group-relative policy optimisation, for continuous control.

A *group* is G rollouts (columns of the batch sharing ``group_id``) started from
the same state. Each column is one rollout: its valid steps are the steps up to
and including its first episode end (within ``batch.mask``, which excludes padding). With
``R_i`` the (optionally discounted) return of rollout ``i``::

    A_i = (R_i - mean_{j in g(i)} R_j) / (std_{j in g(i)} R_j + eps)

broadcast to every valid step of rollout ``i``; no critic is used (the policy's
value head is left untouched). The per-step loss is the PPO clipped surrogate
against the behaviour log-probs, plus ``kl_coef * KL_k3(pi || pi_ref)`` (default 0.04, the paper's)
with the k3 estimator ``exp(ref - logp) - (ref - logp) - 1`` (unbiased, >= 0)
against a frozen reference copy of the initial policy. Per-step losses are
averaged per rollout, then over rollouts ("sequence" aggregation, as in the
GRPO paper) or over all valid steps ("token", DAPO's choice).

``DAPO`` (``agents/dapo.py``) reuses this class with different defaults and
column filtering.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from agents.base import BaseAlgorithm, accumulate_tensors, PolicyConfig, masked_mean, minibatch_indices, rollout_mask
from agents.core import TrajectoryBatch
from agents.losses import clipped_surrogate, ratio_stats
from agents.returns import group_advantages, group_stats, rollout_returns

__all__ = ["GRPOConfig", "GRPO", "rollout_returns", "group_advantages", "group_stats", "k3_kl", "aggregate_loss"]


@dataclass(frozen=True)
class GRPOConfig(PolicyConfig):
    """Group-relative PPO-style objective. Network/optimiser fields from ``PolicyConfig``."""

    clip_low: float = 0.2
    """Lower clip: ratio >= 1 - clip_low."""
    clip_high: float = 0.2
    """Upper clip: ratio <= 1 + clip_high (DAPO's clip-higher raises this)."""
    update_epochs: int = 4
    """Passes over each batch."""
    num_minibatches: int = 4
    """Minibatches per pass, split by columns (rollouts), so a rollout is never cut."""
    gamma: float = 1.0
    """Discount of the rollout return R (1.0 = plain sum of rewards)."""
    adv_eps: float = 1e-4
    """Added to the group std in the advantage denominator."""
    scale_adv_by_std: bool = True
    """Divide by the group std (False: only subtract the group mean, as Dr. GRPO)."""
    std_unbiased: bool = True
    """Use the unbiased (n - 1) group std; a singleton group gets std 0."""
    kl_coef: float = 0.04
    """Coefficient of the k3 KL to the frozen reference policy (the GRPO paper's 0.04); 0 skips the
    reference forward pass. DAPO sets 0."""
    ref_update_interval: int = 0
    """Copy the policy into the reference every this many updates; 0 keeps the initial policy."""
    ent_coef: float = 0.0
    """Entropy bonus coefficient."""
    loss_aggregation: str = "sequence"
    """"sequence": mean over a rollout's steps, then over rollouts; "token": sum over all valid steps / their count."""
    use_sample_weight: bool = True
    """Multiply per-step losses by ``batch.sample_weight`` when present."""


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 estimator of KL(pi || pi_ref) from samples of pi: ``exp(d) - d - 1`` with ``d = ref - logp``."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def aggregate_loss(per_step: Tensor, mask: Tensor, how: str, weight: Optional[Tensor] = None) -> Tensor:
    """Reduce ``[T, M]`` per-step losses: "token" (mean over all valid steps) or "sequence" (per-column mean, then mean)."""
    if weight is not None:
        per_step = per_step * weight
    m = mask.to(per_step.dtype)
    if how == "token":
        return (per_step * m).sum() / m.sum().clamp_min(1.0)
    if how == "sequence":
        per_col = (per_step * m).sum(0) / m.sum(0).clamp_min(1.0)
        has = m.sum(0) > 0
        return per_col[has].mean() if bool(has.any()) else per_col.sum() * 0.0
    raise ValueError(f"loss_aggregation must be 'token' or 'sequence', got {how!r}")


class GRPO(BaseAlgorithm):
    """Group-relative policy optimisation on columns-as-rollouts ``TrajectoryBatch``es.

    Needs ``group_id`` (without it the whole batch is one group). ``last_obs``,
    ``values`` and ``next_obs_final`` are not used.
    """

    name = "grpo"

    def __init__(self, config: Optional[GRPOConfig], obs_dim: int, act_dim: int, device: str | torch.device = "cpu"):
        config = config or GRPOConfig()
        super().__init__(config, obs_dim, act_dim, device)
        self.config: GRPOConfig = config
        if config.loss_aggregation not in ("token", "sequence"):
            raise ValueError(f"loss_aggregation must be 'token' or 'sequence', got {config.loss_aggregation!r}")
        self._init_reference()

    # Hook for DAPO: per-column advantages, which columns to train on, extra metrics.
    def _column_advantages(self, batch: TrajectoryBatch, mask: Tensor) -> tuple[Tensor, Tensor, dict[str, float]]:
        cfg = self.config
        returns = rollout_returns(batch.rewards, mask, cfg.gamma)
        adv = group_advantages(returns, batch.group_id, cfg.adv_eps, cfg.scale_adv_by_std, cfg.std_unbiased)
        _, std, _, inverse = group_stats(returns, batch.group_id, cfg.std_unbiased)
        metrics = {
            "return_mean": float(returns.mean()),
            "return_group_std_mean": float(std.mean()),
            "num_groups": float(int(inverse.max()) + 1),
        }
        keep = torch.ones_like(returns, dtype=torch.bool)
        return adv, keep, metrics

    def _minibatch_loss(self, obs: Tensor, act: Tensor, m: Tensor, old_logp: Tensor, adv_col: Tensor,
                        w: Optional[Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """One minibatch of columns: its loss and stats (what the captured step compiles)."""
        cfg = self.config
        logp, entropy, _ = self.policy.evaluate(obs, act)
        logratio = logp - old_logp
        adv = adv_col.unsqueeze(0).expand_as(logp)
        per_step = clipped_surrogate(logratio.exp(), adv, cfg.clip_low, cfg.clip_high)
        loss_pg = aggregate_loss(per_step, m, cfg.loss_aggregation, w)
        loss = loss_pg
        stats = {"loss_policy": loss_pg.detach()}
        if cfg.kl_coef > 0.0:
            with torch.no_grad():
                ref_logp = self.ref_policy.log_prob(obs, act)
            loss_kl = aggregate_loss(k3_kl(logp, ref_logp), m, cfg.loss_aggregation, w)
            loss = loss + cfg.kl_coef * loss_kl
            stats["loss_kl"] = loss_kl.detach()
        ent = masked_mean(entropy, m)
        if cfg.ent_coef:
            loss = loss - cfg.ent_coef * ent
        stats["loss_entropy"] = -ent.detach()
        stats["entropy"] = ent.detach()
        stats["loss_total"] = loss.detach()
        stats.update(ratio_stats(logratio.detach(), cfg.clip_low, cfg.clip_high, m))
        return loss, stats

    def update(self, batch: TrajectoryBatch) -> dict[str, float]:
        cfg = self.config
        batch = batch.to(self.device)
        if cfg.ref_update_interval > 0 and self.step > 0 and self.step % cfg.ref_update_interval == 0:
            self.sync_reference()
        mask = rollout_mask(batch.terminated, batch.truncated, batch.mask)
        adv_col, keep, metrics = self._column_advantages(batch, mask)
        cols = keep.nonzero().squeeze(-1)
        metrics["columns_used"] = float(cols.numel())

        sums: dict[str, Tensor] = {}
        count = 0
        if cols.numel() > 0:
            weight_all = batch.sample_weight if (cfg.use_sample_weight and batch.sample_weight is not None) else None
            for _ in range(cfg.update_epochs):
                for mb_local in minibatch_indices(cols.numel(), cfg.num_minibatches, self.generator, self.device):
                    mb = cols[mb_local]
                    w = weight_all[:, mb] if weight_all is not None else None
                    stats, grad_norm = self._minibatch_step(
                        self._minibatch_loss, batch.obs[:, mb], batch.actions[:, mb], mask[:, mb],
                        batch.behaviour_logp[:, mb], adv_col[mb], w)
                    stats["grad_norm"] = grad_norm
                    accumulate_tensors(sums, stats)
                    count += 1
            if cfg.normalize_obs:
                self.policy.obs_rms.update(batch.obs[mask])
        self.step += 1
        out = {k: float(v) / max(count, 1) for k, v in sums.items()}
        if count == 0:
            out.update({"loss_policy": 0.0, "loss_total": 0.0})
        out.update(metrics)
        out.update(
            {
                "adv_abs_mean": float(adv_col[keep].abs().mean()) if bool(keep.any()) else 0.0,
                "skipped": float(count == 0),
                "learning_rate": self.learning_rate,
                "step": float(self.step),
            }
        )
        return out
