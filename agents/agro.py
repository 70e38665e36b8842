"""AGRO: one regularised policy-gradient objective for on- and off-policy data.

Per valid sample (s_t, a_t) from *any* behaviour policy mu::

    loss_t = -(A_t - b) * log pi(a_t | s_t)  +  beta / 2 * (log pi(a_t | s_t) - log pi_ref(a_t | s_t))^2

averaged over the valid samples of the minibatch (times ``sample_weight``), plus
``vf_coef * 0.5 * (V(s_t) - vs_t)^2`` when the baseline is the learned value.

Why no importance ratio: think of one start state and treat ``log pi(a)`` as free. The
gradient of the loss is ``sum_samples (-(A(a) - b) + beta * (log pi(a) - log pi_ref(a))) *
grad log pi(a)``. At ``pi* = pi_ref * exp(A / beta) / Z`` every sample's *regularised reward*
``A(a) - beta * (log pi*(a) - log pi_ref(a))`` equals ``beta * log Z``, so with the baseline

    b = mean over the minibatch of (A - beta * (log pi - log pi_ref))     (pi at that moment, no grad;
                                                                            weighted by the sample weights)

each coefficient is 0 and ``pi*`` is a fixed point for *any* sampler mu (any staleness, any mu
with the same support): mu only weights where the condition is enforced. Any other baseline
(the mean of ``A``, a value of ``A``, re-centring) leaves a residual ``(b - beta log Z) *
sum grad log pi(a)`` whose expectation under mu != pi is not zero: a biased optimum.

Choices here:

* ``A_t`` per ``baseline`` -- the state-dependent part of the baseline comes first:
  ``"value"`` (default) -- V-trace (``agents/vtrace.py``) advantages ``r_t + gamma * vs_{t+1} -
  V(s_t)`` with the current critic, which is trained on the V-trace targets ``vs``: the
  correction of the *later* actions of a stale trajectory (``rho``/``c`` of ``pi`` against the
  behaviour log-probs, one cap rule with the stream processor); ``gae_lambda`` is V-trace's lambda;
  ``"mean"`` -- the discounted reward-to-go of the behaviour trajectory (no critic, no correction);
  ``"group"`` -- LLM-style: each column is one rollout, ``R`` its return minus the mean return
  of its group (``group_id``), broadcast over its steps;
  then the scalar ``b`` above (exact for one state; with many states it is the part of
  ``beta * log Z(s)`` that the state baseline does not already remove).
* ``norm_adv`` divides ``A`` by a std over the batch (no re-centring: ``b`` is the centre), so
  ``beta`` is in units of standard deviations of the advantage: the std of the *uncorrected*
  advantages (``rho = c = 1``), so that V-trace's truncation still shrinks a stale batch's step.
  Dividing by the corrected advantages' own std undid it: at 16 versions of lag on HalfCheetah
  their std fell to a fifth, each update moved the policy about three times as far from its
  reference, the policy drifted from its samples (rho fell further) and the return sank below
  the initial policy's (docs/algorithms.md, staleness).
* ``pi_ref`` is a frozen copy of the policy, refreshed every ``ref_update_interval`` updates
  (1 = the policy as it was at the start of this update, which turns the regulariser into a
  proximal term and each update into one mirror-descent step ``pi <- pi_ref * exp(A / beta)``;
  0 = never: the fixed point is the KL-regularised optimum to the initial policy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
from torch import Tensor

from agents.base import BaseAlgorithm, accumulate_tensors, explained_variance, masked_mean, minibatch_indices, rollout_mask
from agents.core import TrajectoryBatch
from agents.normalization import RewardScaler
from agents.returns import bootstrap_values, compute_gae, group_stats, rollout_returns
from agents.vtrace import VTraceConfig, behaviour_weights, vtrace

__all__ = ["AGROConfig", "AGRO", "agro_loss"]

_BASELINES = ("value", "mean", "group")


@dataclass(frozen=True)
class AGROConfig(VTraceConfig):
    """AGRO objective settings. Network/optimiser fields from ``PolicyConfig``, V-trace's from ``VTraceConfig``."""

    beta: float = 1.0
    """Coefficient of the squared log-ratio regulariser to the reference policy."""
    baseline: str = "value"
    """value | mean | group (see module doc)."""
    gamma: float = 0.99
    """Discount of the reward-to-go."""
    gae_lambda: float = 1.0
    """V-trace lambda for the value baseline (1.0: IMPALA's V-trace)."""
    norm_adv: bool = True
    """Scale A to unit std over the batch's valid samples (beta in units of that std); no re-centring."""
    update_epochs: int = 4
    """Passes over each batch."""
    num_minibatches: int = 8
    """Minibatches per pass (over valid samples)."""
    vf_coef: float = 0.5
    """Value-loss coefficient (baseline="value" only)."""
    ent_coef: float = 0.0
    """Entropy bonus coefficient."""
    ref_update_interval: int = 1
    """Refresh the reference policy every this many updates; 0 = never (keep the initial policy)."""
    normalize_reward: bool = True
    """Scale rewards by the running discounted-return std, as PPO (not used for baseline="group")."""
    reward_clip: float = 10.0
    """Clip of scaled rewards."""
    bootstrap_on_truncation: bool = True
    """Bootstrap truncated episodes from V(final obs) (baseline="value")."""
    use_sample_weight: bool = True
    """Multiply per-sample losses by ``batch.sample_weight`` when present."""
    decay_lr: bool = True
    """Scale the step's learning rate by the batch's mean sample weight and use the weights only
    relative to that mean inside the loss: Adam divides a uniform loss scale away, so a down-weighted
    (stale) batch would otherwise move the policy as far as a fresh one."""


def agro_loss(
    logp: Tensor,
    ref_logp: Tensor,
    advantages: Tensor,
    beta: float,
    weight: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
) -> dict[str, Tensor]:
    """``loss_policy = mean(-A * logp)``, ``loss_reg = mean(beta / 2 * (logp - ref_logp)^2)`` (weighted, masked)."""
    log_ratio_ref = logp - ref_logp
    return {
        "loss_policy": masked_mean(-advantages.detach() * logp, mask, weight),
        "loss_reg": masked_mean(0.5 * beta * log_ratio_ref.pow(2), mask, weight),
        "log_ratio_ref_abs": masked_mean(log_ratio_ref.detach().abs(), mask),
    }


class AGRO(BaseAlgorithm):
    """Off-policy-tolerant regularised policy gradient (see module doc)."""

    name = "agro"

    def __init__(self, config: Optional[AGROConfig], obs_dim: int, act_dim: int, device: str | torch.device = "cpu"):
        config = config or AGROConfig()
        if config.baseline not in _BASELINES:
            raise ValueError(f"baseline must be one of {_BASELINES}, got {config.baseline!r}")
        super().__init__(config, obs_dim, act_dim, device)
        self.config: AGROConfig = config
        self.reward_scaler = RewardScaler(gamma=config.gamma, clip=config.reward_clip)
        self._init_reference()

    #: The mean sample weight over the whole step's batch when it is split across data-parallel
    #: ranks (set by ``learner.distributed.DataParallel`` around each update, from every rank's
    #: ``weight_totals``); None: this batch is the whole step's, its own mean is used.
    group_weight_mean: Optional[float] = None

    def _loss_mask(self, batch: TrajectoryBatch) -> Optional[Tensor]:
        """The valid samples the loss averages over."""
        if self.config.baseline == "group":
            return rollout_mask(batch.terminated, batch.truncated, batch.mask)
        return batch.mask

    def weight_totals(self, batch: TrajectoryBatch) -> Optional[tuple[float, float]]:
        """``(sum, count)`` of the per-sample weights ``decay_lr`` averages (None: no weights), so a
        data-parallel group can give every rank the mean of the whole step's batch."""
        weights = self._sample_weights(batch.to(self.device))
        if weights is None or not self.config.decay_lr:
            return None
        mask = self._loss_mask(batch.to(self.device))
        if mask is None:
            return float(weights.sum()), float(weights.numel())
        m = mask.to(weights.dtype)
        return float((weights * m).sum()), float(m.sum())

    # ---- hooks (TBA overrides) -----------------------------------------------------------
    def _sample_weights(self, batch: TrajectoryBatch) -> Optional[Tensor]:
        """Per-sample ``[T, N]`` loss weights, or None for all ones."""
        if self.config.use_sample_weight and batch.sample_weight is not None:
            return batch.sample_weight
        return None

    def _step_weights(self, weights: Optional[Tensor], mask: Optional[Tensor]) -> tuple[Optional[Tensor], float]:
        """``(loss weights, learning rate)`` of this update from the per-sample weights (``decay_lr``)."""
        lr = self.config.learning_rate
        if weights is None or not self.config.decay_lr:
            return weights, lr
        mean = self.group_weight_mean
        if mean is None:
            mean = float(masked_mean(weights, mask))
        return (weights / mean if mean > 0 else torch.zeros_like(weights)), lr * mean

    # ---- advantages ----------------------------------------------------------------------
    @torch.no_grad()
    def _advantages(self, batch: TrajectoryBatch, mask: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor], Optional[Tensor], Tensor, dict[str, float]]:
        """``(A [T, N] with the state baseline removed, value_targets or None, old_values or None,
        the advantages whose spread ``norm_adv`` divides by, metrics)``."""
        cfg = self.config
        metrics: dict[str, float] = {}
        if cfg.baseline == "group":
            assert mask is not None
            R = rollout_returns(batch.rewards, mask, cfg.gamma)
            mean, _, _, _ = group_stats(R, batch.group_id)
            adv = (R - mean).unsqueeze(0).expand_as(batch.rewards).clone()
            metrics["return_mean"] = float(R.mean())
            return adv, None, None, adv, metrics
        rewards = (
            self.reward_scaler(batch.rewards, batch.terminated, batch.stream_ids, batch.mask) if cfg.normalize_reward else batch.rewards
        )
        if cfg.baseline == "value":
            # always the current critic: batch.values may come from a stale behaviour policy
            values, last_value, final_values = bootstrap_values(
                self.policy, batch, cfg.bootstrap_on_truncation, use_batch_values=False
            )
            log_ratio = self.policy.log_prob(batch.obs, batch.actions) - batch.behaviour_logp
            rho, c, _ = behaviour_weights(cfg, log_ratio)
            # the spread to normalise by is that of the uncorrected advantages (rho = c = 1): truncated
            # traces shrink A on stale data, and dividing by A's own std would undo that and grow
            # the step as the data gets staler (the policy then runs away from its samples);
            # without V-trace rho = c = 1 already. Both come from one scan.
            vs, adv, *plain = vtrace(
                rewards, values, batch.terminated, batch.truncated, last_value, final_values, rho, c, cfg.gamma, cfg.gae_lambda,
                uncorrected=cfg.vtrace,
            )
            scale = plain[0] if plain else adv
            metrics["explained_variance"] = explained_variance(values.reshape(-1), vs.reshape(-1))
            metrics["return_mean"] = float(vs.mean())
            metrics["rho_mean"] = float(masked_mean(rho, mask))
            return adv, vs, values, scale, metrics
        zeros = torch.zeros_like(rewards)
        rtg, _ = compute_gae(rewards, zeros, batch.terminated, batch.truncated, zeros[0], None, cfg.gamma, 1.0)
        metrics["return_mean"] = float(masked_mean(rtg, mask))
        return rtg, None, None, rtg, metrics

    def update(self, batch: TrajectoryBatch) -> dict[str, float]:
        cfg = self.config
        batch = batch.to(self.device)
        if cfg.ref_update_interval > 0 and self.step % cfg.ref_update_interval == 0:
            self.sync_reference()
        mask = self._loss_mask(batch)
        adv, ret, old_values, scale, metrics = self._advantages(batch, mask)
        def spread(x: Tensor) -> Tensor:
            return torch.sqrt(masked_mean((x - masked_mean(x, mask)).pow(2), mask))

        std = spread(adv)
        metrics["adv_std_raw"] = float(std)
        if cfg.norm_adv:
            norm = spread(scale)
            metrics["adv_norm_std"] = float(norm)
            adv = adv / (norm + 1e-8)
        raw_weights = self._sample_weights(batch)
        weights, lr = self._step_weights(raw_weights, mask)
        self.set_learning_rate(lr)

        valid = mask.reshape(-1) if mask is not None else None

        def flat(x: Optional[Tensor]) -> Optional[Tensor]:
            if x is None:
                return None
            x = x.reshape(-1, *x.shape[2:])
            return x[valid] if valid is not None else x

        b_obs, b_act, b_adv = flat(batch.obs), flat(batch.actions), flat(adv)
        b_ret, b_w, b_blogp = flat(ret), flat(weights), flat(batch.behaviour_logp)
        n = b_obs.shape[0]

        sums: dict[str, Tensor] = {}
        count = 0
        for _ in range(cfg.update_epochs):
            for mb in minibatch_indices(n, self.minibatches(n, cfg.num_minibatches), self.generator, self.device):
                w = b_w[mb] if b_w is not None else None
                ret_mb = b_ret[mb] if b_ret is not None else None
                stats, grad_norm = self._minibatch_step(self._minibatch_loss, b_obs[mb], b_act[mb], b_adv[mb], ret_mb, w,
                                                        b_blogp[mb])
                stats["grad_norm"] = grad_norm
                accumulate_tensors(sums, stats)
                count += 1

        if cfg.normalize_obs:
            self.policy.obs_rms.update(b_obs)
        self.step += 1
        out = {k: float(v) / max(count, 1) for k, v in sums.items()}
        out.update(metrics)
        out.update(
            {
                "weight_mean": float(masked_mean(raw_weights, mask)) if raw_weights is not None else 1.0,
                "learning_rate": self.learning_rate,
                "num_samples": float(n),
                "minibatch_size": float(max(1, n // self.minibatches(n, cfg.num_minibatches))),
                "step": float(self.step),
            }
        )
        return out

    def _minibatch_loss(self, obs: Tensor, act: Tensor, adv: Tensor, ret: Optional[Tensor], w: Optional[Tensor],
                        behaviour_logp: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """One minibatch's loss and stats (what the captured step compiles)."""
        cfg = self.config
        logp, entropy, value = self.policy.evaluate(obs, act)
        with torch.no_grad():
            ref_logp = self.ref_policy.log_prob(obs, act)
            # the baseline under which pi_ref * exp(A / beta) is the fixed point for any sampler
            reg = adv - cfg.beta * (logp - ref_logp)
            baseline = reg.mean() if w is None else (reg * w).sum() / w.sum().clamp_min(1e-8)
        terms = agro_loss(logp, ref_logp, adv - baseline, cfg.beta, weight=w)
        loss = terms["loss_policy"] + terms["loss_reg"]
        ent = entropy.mean()
        if cfg.ent_coef:
            loss = loss - cfg.ent_coef * ent
        stats: dict[str, Tensor] = {k: v.detach() for k, v in terms.items()}
        stats["baseline"] = baseline
        if ret is not None:
            loss_value = 0.5 * masked_mean((value - ret).pow(2), None, w)
            loss = loss + cfg.vf_coef * loss_value
            stats["loss_value"] = loss_value.detach()
        stats["loss_entropy"] = -ent.detach()
        stats["entropy"] = ent.detach()
        stats["loss_total"] = loss.detach()
        with torch.no_grad():
            lr_b = logp - behaviour_logp
            stats["approx_kl_behaviour"] = ((lr_b.exp() - 1.0) - lr_b).mean()
        return loss, stats

    def _extra_state(self) -> dict[str, Any]:
        return {"reward_scaler": self.reward_scaler.state_dict()}

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        self.reward_scaler.load_state_dict(state["reward_scaler"])
