"""PPO learner step (pure torch; the learner shell feeds it ``TrajectoryBatch``es)."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from torch import Tensor

from agents.base import BaseAlgorithm, explained_variance, minibatch_indices
from agents.core import TrajectoryBatch
from agents.normalization import RewardScaler
from agents.ppo.config import PPOConfig
from agents.ppo.losses import policy_loss, value_loss
from agents.returns import bootstrap_values, compute_gae
from agents.vtrace import behaviour_weights, vtrace

__all__ = ["PPO", "bootstrap_values"]

_STATS = ("loss_policy", "loss_value", "loss_entropy", "loss_total", "entropy", "approx_kl", "old_approx_kl",
          "clipfrac", "ratio_mean", "grad_norm")


class PPO(BaseAlgorithm):
    """Proximal Policy Optimisation, CleanRL-faithful.

    Per ``update(batch)``:

    1. anneal the learning rate (``frac = 1 - step / total_updates``);
    2. values / bootstrap values with the current policy (under the normaliser
       statistics the actor used, so ratios start at exactly 1 on fresh data);
    3. scale rewards by the running discounted-return std (learner-side state)
       and clip; GAE with truncation bootstrapping;
    4. ``update_epochs`` x ``num_minibatches`` Adam steps on the clipped
       surrogate + clipped value loss - entropy bonus, grad-norm clip;
    5. fold the batch observations into ``policy.obs_rms`` (so the *next*
       published version normalises with them).
    """

    name = "ppo"

    def __init__(self, config: Optional[PPOConfig], obs_dim: int, act_dim: int, device: str | torch.device = "cpu"):
        config = config or PPOConfig()
        super().__init__(config, obs_dim, act_dim, device)
        self.config: PPOConfig = config
        self.reward_scaler = RewardScaler(gamma=config.gamma, clip=config.reward_clip)

    def current_lr(self) -> float:
        cfg = self.config
        if cfg.anneal_lr and cfg.total_updates:
            frac = max(0.0, 1.0 - self.step / cfg.total_updates)
            return frac * cfg.learning_rate
        return cfg.learning_rate

    def update(self, batch: TrajectoryBatch) -> dict[str, float]:
        cfg = self.config
        batch = batch.to(self.device)
        self.set_learning_rate(self.current_lr())

        values, last_value, final_values = bootstrap_values(
            self.policy, batch, cfg.bootstrap_on_truncation, use_batch_values=not cfg.decoupled
        )
        if cfg.normalize_reward:
            rewards = self.reward_scaler(batch.rewards, batch.terminated, batch.stream_ids, batch.mask)
        else:
            rewards = batch.rewards
        extra: dict[str, float] = {}
        rho = None
        if cfg.decoupled:
            # Decoupled PPO: the trust region is around the learner's policy at the start of this
            # update (pi_prox); the behaviour mismatch pi_prox / mu is corrected by V-trace.
            with torch.no_grad():
                prox_logp = self.policy.log_prob(batch.obs, batch.actions)
            rho, c, capped = behaviour_weights(cfg, prox_logp - batch.behaviour_logp)
            returns, advantages = vtrace(
                rewards, values, batch.terminated, batch.truncated, last_value, final_values, rho, c, cfg.gamma, cfg.gae_lambda
            )
            extra["behaviour_dropped"] = float(capped.sum())
        else:
            advantages, returns = compute_gae(
                rewards, values, batch.terminated, batch.truncated, last_value, final_values, cfg.gamma, cfg.gae_lambda
            )

        valid = batch.mask.reshape(-1) if batch.mask is not None else None

        def flat(x: Tensor) -> Tensor:
            x = x.reshape(-1, *x.shape[2:])
            return x[valid] if valid is not None else x

        b_obs, b_act = flat(batch.obs), flat(batch.actions)
        with torch.no_grad():  # the statistics stay fixed during the update: normalise once
            b_obs_norm = self.policy.preprocess(b_obs)
        b_logp, b_adv, b_ret, b_val = flat(batch.behaviour_logp), flat(advantages), flat(returns), flat(values)
        b_w = flat(batch.sample_weight) if (cfg.use_sample_weight and batch.sample_weight is not None) else None
        if b_w is not None and bool((b_w == 1.0).all()):
            b_w = None  # all ones (the processors' default): the same losses without the multiplies
        n = b_obs.shape[0]
        if rho is not None:
            b_logp = flat(prox_logp)
            b_rho = flat(rho)
            b_w = b_rho if b_w is None else b_w * b_rho
            extra["behaviour_weight_mean"] = float(b_rho.mean())

        rows: list[Tensor] = []  # one row of _STATS per minibatch, summed once at the end
        epochs_run = 0
        kl_col = _STATS.index("approx_kl")
        for _ in range(cfg.update_epochs):
            epoch_start = len(rows)
            for mb in minibatch_indices(n, self.minibatches(n, cfg.num_minibatches), self.generator, self.device):
                w = b_w[mb] if b_w is not None else None
                stats, grad_norm = self._minibatch_step(
                    self._minibatch_loss, b_obs_norm[mb], b_act[mb], b_logp[mb], b_adv[mb], b_val[mb], b_ret[mb], w)
                rows.append(torch.cat([stats, grad_norm.to(stats.dtype).reshape(1)]))
            epochs_run += 1
            if (cfg.target_kl is not None and len(rows) > epoch_start
                    and float(torch.stack(rows[epoch_start:])[:, kl_col].mean()) > cfg.target_kl):
                break
        count = len(rows)
        sums = dict(zip(_STATS, torch.stack(rows).double().sum(0).tolist())) if rows else {}

        if cfg.normalize_obs:
            self.policy.obs_rms.update(b_obs)
        self.step += 1

        metrics = {k: v / max(count, 1) for k, v in sums.items()}
        metrics.update(extra)
        metrics.update(
            {
                "explained_variance": explained_variance(b_val, b_ret),
                "learning_rate": self.learning_rate,
                "adv_mean": float(b_adv.mean()),
                "adv_std": float(b_adv.std()) if n > 1 else 0.0,
                "value_mean": float(b_val.mean()),
                "return_mean": float(b_ret.mean()),
                "reward_raw_mean": float(batch.rewards.mean()),
                "reward_scaled_mean": float(rewards.mean()),
                "reward_scale_std": float(self.reward_scaler.rms.std()),
                "num_samples": float(n),
                "epochs_run": float(epochs_run),
                "minibatch_size": float(max(1, n // self.minibatches(n, cfg.num_minibatches))),
                "step": float(self.step),
            }
        )
        return metrics

    def _minibatch_loss(self, obs_norm: Tensor, act: Tensor, old_logp: Tensor, adv: Tensor, old_values: Tensor,
                        returns: Tensor, w: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        """One minibatch's loss and its ``_STATS`` row but the grad norm (what the captured step compiles)."""
        cfg = self.config
        newlogp, entropy, newvalue = self.policy.net.evaluate(obs_norm, act)
        if cfg.norm_adv and adv.numel() > 1:
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        pl = policy_loss(newlogp, old_logp, adv, cfg.clip_coef, weight=w)
        v_loss = value_loss(newvalue, old_values, returns, cfg.clip_coef if cfg.clip_vloss else None, weight=w)
        ent = entropy.mean()
        loss = pl["loss_policy"] - cfg.ent_coef * ent + cfg.vf_coef * v_loss
        row = torch.stack([
            pl["loss_policy"].detach(), v_loss.detach(), -ent.detach(), loss.detach(), ent.detach(),
            pl["approx_kl"], pl["old_approx_kl"], pl["clipfrac"], pl["ratio_mean"],
        ])
        return loss, row

    def _extra_state(self) -> dict[str, Any]:
        return {"reward_scaler": self.reward_scaler.state_dict()}

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        self.reward_scaler.load_state_dict(state["reward_scaler"])
