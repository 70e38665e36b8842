"""TBA-style asynchronous training: staleness-decayed updates, optional trajectory balance.

Actors and learner run decoupled, so samples arrive ``versions`` policy
versions and ``ms`` milliseconds old. Every sample's loss weight is decayed by
its staleness (``staleness_weights``):

* ``"exponential"``: ``w = version_decay ** versions * 0.5 ** (ms / half_life_ms)``
  (the time factor is dropped when ``half_life_ms`` is None; ``0.5 ** (ms / h)``
  is ``exp(-ln 2 * ms / h)``, so ``half_life_ms`` is a true half-life);
* ``"linear"``: ``w = clip(1 - versions / max_versions, 0, 1) * clip(1 - ms / max_ms, 0, 1)``
  (time factor dropped when ``max_ms`` is None);
* ``"none"``: ``w = 1``;

then ``w = max(w, min_weight)`` and multiplied by ``batch.sample_weight``.

Which reading of TBA this is: the *time-decay asynchronous* one -- staleness shrinks the
learning rate. A weight that scales the whole loss does nothing under Adam (it divides the
scale away: weight 0.12 and weight 1 move the parameters by nearly the same amount), so with
``decay_lr`` (default, from ``AGROConfig``) the step's learning rate is the base rate times the
batch's mean weight, and inside the loss the weights only count *relative* to that mean (stale
samples of a mixed batch count less than its fresh ones). A batch whose weights are all 0 does not
move the policy at all.

Objectives (``objective``):

* ``"agro"`` (default): the AGRO loss (``agents/agro.py``) -- a regularised
  policy gradient whose fixed point does not depend on the behaviour policy,
  so it tolerates any staleness; the decay only limits how much old data counts.
* ``"tb"``: trajectory balance, the objective TBA itself uses. Each column is a
  rollout tau from a start state s0 (``group_id`` marks rollouts sharing s0); with
  ``log R~(tau) = tb_reward_scale * R(tau) + sum_t log pi_ref(a_t | s_t)``::

      loss(tau) = (log Z(s0) + sum_t log pi(a_t | s_t) - log R~(tau))^2

  whose minimiser (for any sampling distribution with full support: it is an
  off-policy objective, which is why TBA uses it) is
  ``pi(tau) proportional to pi_ref(tau) * exp(tb_reward_scale * R(tau))`` -- KL-regularised
  RL with coefficient ``1 / tb_reward_scale``. Dynamics do not appear, which
  makes it exact for deterministic dynamics given s0 and an approximation
  otherwise. The ``pi_ref`` prior is what makes it sound for continuous
  actions: without it the target ``exp(beta * R)`` over unbounded (and, after
  the actor's clipping, flat-rewarded) actions is not normalisable and the std
  would grow without bound. ``log Z``: ``"vargrad"`` (default) estimates it per
  group as the mean of ``log R~ - sum log pi`` (a scalar would assume a
  single start state), ``"learned"`` is one learned scalar (needs a fixed
  start-state distribution and reference: ``ref_update_interval = 0`` is enforced).
  The reference moves every update by default (``ref_update_interval = 1``, the policy at the
  start of the update), on purpose: with VarGrad the target is then
  ``pi_{k+1} proportional to pi_k * exp(tb_reward_scale * R)``, one KL-proximal (mirror-descent)
  step per update, which keeps improving the return instead of stopping at the KL-regularised
  optimum around the *initial* policy -- the same reading as AGRO's interval 1. Set
  ``ref_update_interval = 0`` for the fixed-reference objective of the paper.
  Raw rewards are used (no running scaling: the target must not drift).
  Horizons are long in locomotion (T=1000: sums of 1000 log-densities), so
  expect high variance there; it is best on short rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
from torch import Tensor, nn

from agents.agro import AGRO, AGROConfig
from agents.base import accumulate_tensors, minibatch_indices, rollout_mask
from agents.core import TrajectoryBatch
from agents.returns import group_stats, rollout_returns

__all__ = ["TBAConfig", "TBA", "staleness_weights", "trajectory_balance_loss"]

_SCHEDULES = ("exponential", "linear", "none")
_OBJECTIVES = ("agro", "tb")
_LOGZ = ("vargrad", "learned")


@dataclass(frozen=True)
class TBAConfig(AGROConfig):
    """AGRO fields plus staleness decay and trajectory-balance settings."""

    objective: str = "agro"
    """agro | tb (see module doc)."""
    staleness_schedule: str = "exponential"
    """exponential | linear | none."""
    version_decay: float = 0.9
    """Exponential schedule: weight factor per version of staleness."""
    half_life_ms: Optional[float] = None
    """Exponential schedule: half-life of the weight in ms of data age; None ignores ms."""
    max_versions: float = 16.0
    """Linear schedule: weight reaches 0 at this many versions."""
    max_ms: Optional[float] = None
    """Linear schedule: weight reaches 0 at this age in ms; None ignores ms."""
    min_weight: float = 0.0
    """Floor of the staleness weight."""
    tb_reward_scale: float = 1.0
    """TB: log R~ = tb_reward_scale * R (+ log pi_ref); the inverse KL coefficient."""
    tb_logz: str = "vargrad"
    """TB: vargrad (per-group batch estimate) | learned (one scalar parameter)."""
    tb_logz_lr: float = 1e-2
    """TB: learning rate of the learned log Z."""
    tb_use_ref_prior: bool = True
    """TB: include sum log pi_ref in log R~ (see module doc for why it should stay on)."""


def staleness_weights(
    versions: Tensor,
    ms: Tensor,
    schedule: str = "exponential",
    version_decay: float = 0.9,
    half_life_ms: Optional[float] = None,
    max_versions: float = 16.0,
    max_ms: Optional[float] = None,
    min_weight: float = 0.0,
) -> Tensor:
    """Per-sample weights in ``[min_weight, 1]`` from staleness in versions and ms (module doc)."""
    versions = versions.to(torch.float32).clamp_min(0.0)
    ms = ms.to(torch.float32).clamp_min(0.0)
    if schedule == "none":
        w = torch.ones_like(versions)
    elif schedule == "exponential":
        w = torch.pow(torch.full_like(versions, float(version_decay)), versions)
        if half_life_ms is not None and half_life_ms > 0:
            w = w * torch.pow(torch.full_like(ms, 0.5), ms / float(half_life_ms))
    elif schedule == "linear":
        w = (1.0 - versions / float(max_versions)).clamp(0.0, 1.0)
        if max_ms is not None and max_ms > 0:
            w = w * (1.0 - ms / float(max_ms)).clamp(0.0, 1.0)
    else:
        raise ValueError(f"staleness_schedule must be one of {_SCHEDULES}, got {schedule!r}")
    return w.clamp_min(float(min_weight))


def trajectory_balance_loss(
    sum_logp: Tensor,
    log_reward: Tensor,
    log_z: Optional[Tensor],
    group_id: Optional[Tensor] = None,
    weight: Optional[Tensor] = None,
) -> dict[str, Tensor]:
    """Per-rollout TB residual ``delta = log Z + sum log pi - log R~`` squared, weighted mean over rollouts.

    ``log_z=None`` selects VarGrad: ``log Z`` per group is the group mean of
    ``log R~ - sum log pi`` (so ``delta`` is the deviation from the group mean).
    """
    if log_z is None:
        x = sum_logp - log_reward
        mean, _, _, _ = group_stats(x, group_id, unbiased=False)
        delta = x - mean
        log_z_est = (-mean).detach().mean()
    else:
        delta = log_z + sum_logp - log_reward
        log_z_est = log_z.detach()
    sq = delta.pow(2)
    loss = (sq * weight).mean() if weight is not None else sq.mean()
    return {"loss_tb": loss, "tb_residual_abs": delta.detach().abs().mean(), "log_z": log_z_est}


class TBA(AGRO):
    """Staleness-decayed AGRO or trajectory-balance learner (see module doc)."""

    name = "tba"

    def __init__(self, config: Optional[TBAConfig], obs_dim: int, act_dim: int, device: str | torch.device = "cpu"):
        config = config or TBAConfig()
        for value, allowed, field in (
            (config.staleness_schedule, _SCHEDULES, "staleness_schedule"),
            (config.objective, _OBJECTIVES, "objective"),
            (config.tb_logz, _LOGZ, "tb_logz"),
        ):
            if value not in allowed:
                raise ValueError(f"{field} must be one of {allowed}, got {value!r}")
        if config.objective == "tb" and config.tb_logz == "learned" and config.ref_update_interval != 0:
            raise ValueError("tb_logz='learned' needs a fixed reference (ref_update_interval=0): a moving one moves log Z")
        super().__init__(config, obs_dim, act_dim, device)
        self.config: TBAConfig = config
        self.log_z = nn.Parameter(torch.zeros((), device=self.device))
        if config.objective == "tb" and config.tb_logz == "learned":
            self.optimizer.add_param_group({"params": [self.log_z], "lr": config.tb_logz_lr})

    def _sample_weights(self, batch: TrajectoryBatch) -> Tensor:
        cfg = self.config
        w = staleness_weights(
            batch.staleness_tensor("staleness_versions"),
            batch.staleness_tensor("staleness_ms"),
            cfg.staleness_schedule,
            cfg.version_decay,
            cfg.half_life_ms,
            cfg.max_versions,
            cfg.max_ms,
            cfg.min_weight,
        )
        if cfg.use_sample_weight and batch.sample_weight is not None:
            w = w * batch.sample_weight
        return w

    def weight_totals(self, batch: TrajectoryBatch) -> Optional[tuple[float, float]]:
        if self.config.objective == "agro" or not self.config.decay_lr:
            return super().weight_totals(batch)
        w_raw = self._rollout_weights(batch.to(self.device))  # the TB step's lr scales with their mean
        return float(w_raw.sum()), float(w_raw.numel())

    def _rollout_weights(self, batch: TrajectoryBatch) -> Tensor:
        """Per rollout (column): the mean sample weight over its valid steps."""
        m = rollout_mask(batch.terminated, batch.truncated, batch.mask).to(torch.float32)
        return (self._sample_weights(batch) * m).sum(0) / m.sum(0).clamp_min(1.0)

    def set_learning_rate(self, lr: float) -> None:
        self._set_group_lr(self.optimizer.param_groups[0], lr)  # the log Z group keeps its own rate

    def update(self, batch: TrajectoryBatch) -> dict[str, float]:
        if self.config.objective == "agro":
            return super().update(batch)
        return self._update_tb(batch)

    def _update_tb(self, batch: TrajectoryBatch) -> dict[str, float]:
        cfg = self.config
        batch = batch.to(self.device)
        if cfg.ref_update_interval > 0 and self.step % cfg.ref_update_interval == 0:
            self.sync_reference()
        mask = rollout_mask(batch.terminated, batch.truncated, batch.mask)
        m = mask.to(torch.float32)
        R = rollout_returns(batch.rewards, mask, 1.0)
        w_raw = self._rollout_weights(batch)
        w_col, lr = self._step_weights(w_raw, None)
        self.set_learning_rate(lr)
        with torch.no_grad():
            ref_sum = (self.ref_policy.log_prob(batch.obs, batch.actions) * m).sum(0) if cfg.tb_use_ref_prior else torch.zeros_like(R)
        log_reward = cfg.tb_reward_scale * R + ref_sum
        N = batch.num_columns
        # VarGrad needs whole groups inside a minibatch, so split by group.
        gid = batch.group_id if batch.group_id is not None else torch.zeros(N, dtype=torch.int64, device=self.device)
        _, inverse = torch.unique(gid, return_inverse=True)
        num_groups = int(inverse.max()) + 1

        sums: dict[str, Tensor] = {}
        count = 0
        for _ in range(cfg.update_epochs):
            for mb_groups in minibatch_indices(num_groups, cfg.num_minibatches, self.generator, self.device):
                cols = torch.isin(inverse, mb_groups).nonzero().squeeze(-1)
                stats, grad_norm = self._minibatch_step(
                    self._tb_loss, batch.obs[:, cols], batch.actions[:, cols], m[:, cols], log_reward[cols], gid[cols],
                    w_col[cols])
                stats["grad_norm"] = grad_norm
                accumulate_tensors(sums, stats)
                count += 1
        if cfg.normalize_obs:
            self.policy.obs_rms.update(batch.obs[mask])
        self.step += 1
        out = {k: float(v) / max(count, 1) for k, v in sums.items()}
        out.update(
            {
                "return_mean": float(R.mean()),
                "weight_mean": float(w_raw.mean()),
                "learning_rate": self.learning_rate,
                "num_rollouts": float(N),
                "step": float(self.step),
            }
        )
        return out

    def _tb_loss(self, obs: Tensor, act: Tensor, m: Tensor, log_reward: Tensor, gid: Tensor,
                 w: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """One minibatch of whole groups: the trajectory-balance loss and stats (the captured step's)."""
        logp = self.policy.log_prob(obs, act)
        sum_logp = (logp * m).sum(0)
        terms = trajectory_balance_loss(sum_logp, log_reward, self.log_z if self.config.tb_logz == "learned" else None,
                                        gid, w)
        loss = terms["loss_tb"]
        stats: dict[str, Tensor] = {k: v.detach() for k, v in terms.items()}
        stats["loss_total"] = loss.detach()
        return loss, stats

    def _extra_state(self) -> dict[str, Any]:
        state = super()._extra_state()
        state["log_z"] = self.log_z.detach().clone()
        return state

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        super()._load_extra_state(state)
        with torch.no_grad():
            self.log_z.copy_(state["log_z"])
