"""DPO on trajectory segments.

A preference pair is two segments (same start state / policy, see
``PreferencePair`` in the design): the winner ``w`` and the loser ``l``. A
segment's log-likelihood is the sum over its valid steps of the per-step action
log-density. With a frozen reference copy of the policy::

    r_w = beta * (log pi(w) - log pi_ref(w)),   r_l = beta * (log pi(l) - log pi_ref(l))
    loss = -log sigmoid(r_w - r_l)

(optionally label-smoothed: ``-(1 - eps) log sigmoid(z) - eps log sigmoid(-z)``).
``r_w`` / ``r_l`` are the implicit rewards; reported: ``reward_accuracy``
(fraction with ``r_w > r_l``), ``reward_margin`` (mean ``r_w - r_l``),
``reward_chosen``, ``reward_rejected``.

The observation normaliser is frozen during DPO (the reference keeps its own
copy, and moving the policy's would change both implicit rewards for reasons
unrelated to preferences). Start from a trained policy with
``init_from_policy(state_dict)``, which also resets the reference to it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from agents.base import BaseAlgorithm, accumulate, PolicyConfig, minibatch_indices
from agents.core import as_tensor

__all__ = ["DPOConfig", "DPO", "PreferenceBatch", "dpo_loss", "segment_log_prob"]


@dataclass(frozen=True)
class PreferenceBatch:
    """``B`` preference pairs of segments of up to ``L`` steps, time-major."""

    obs_w: Tensor
    """``[L, B, obs_dim]`` raw observations of the preferred (winning) segments."""
    act_w: Tensor
    """``[L, B, act_dim]`` actions (as sampled, unclipped) of the winning segments."""
    obs_l: Tensor
    """``[L, B, obs_dim]`` raw observations of the rejected (losing) segments."""
    act_l: Tensor
    """``[L, B, act_dim]`` actions of the losing segments."""
    mask_w: Optional[Tensor] = None
    """``[L, B]`` bool valid steps of the winning segments (None: all valid)."""
    mask_l: Optional[Tensor] = None
    """``[L, B]`` bool valid steps of the losing segments (None: all valid)."""
    weight: Optional[Tensor] = None
    """``[B]`` per-pair loss weight (None: ones)."""

    def __post_init__(self) -> None:
        for o, a, m, tag in ((self.obs_w, self.act_w, self.mask_w, "w"), (self.obs_l, self.act_l, self.mask_l, "l")):
            if o.dim() != 3 or a.dim() != 3 or tuple(o.shape[:2]) != tuple(a.shape[:2]):
                raise ValueError(f"obs_{tag}/act_{tag} must be [L, B, dim] with matching L, B")
            if m is not None and tuple(m.shape) != tuple(o.shape[:2]):
                raise ValueError(f"mask_{tag} must be [L, B]")
        if self.obs_w.shape[1] != self.obs_l.shape[1]:
            raise ValueError("winner and loser batches must have the same number of pairs B")
        if self.weight is not None and tuple(self.weight.shape) != (self.obs_w.shape[1],):
            raise ValueError("weight must be [B]")

    @property
    def num_pairs(self) -> int:
        return int(self.obs_w.shape[1])

    @classmethod
    def from_numpy(cls, **arrays: Any) -> "PreferenceBatch":
        conv = {}
        for k, v in arrays.items():
            conv[k] = as_tensor(v, "mask" if k.startswith("mask") else k)
        return cls(**conv)

    def to(self, device: str | torch.device) -> "PreferenceBatch":
        return dataclasses.replace(
            self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}
        )

    def select(self, idx: Tensor) -> "PreferenceBatch":
        """Subset of pairs ``idx``."""
        def pick(x: Optional[Tensor], dim: int) -> Optional[Tensor]:
            return None if x is None else x.index_select(dim, idx)

        return PreferenceBatch(
            pick(self.obs_w, 1), pick(self.act_w, 1), pick(self.obs_l, 1), pick(self.act_l, 1),
            pick(self.mask_w, 1), pick(self.mask_l, 1), pick(self.weight, 0),
        )


@dataclass(frozen=True)
class DPOConfig(PolicyConfig):
    """DPO settings. Network/optimiser fields from ``PolicyConfig``."""

    beta: float = 0.1
    """Inverse temperature of the implicit reward (KL strength to the reference)."""
    label_smoothing: float = 0.0
    """Assumed label-noise rate eps (conservative DPO); 0 = plain DPO."""
    update_epochs: int = 1
    """Passes over each preference batch."""
    num_minibatches: int = 1
    """Minibatches per pass (over pairs)."""
    ref_update_interval: int = 0
    """Copy the policy into the reference every this many updates; 0 = keep it frozen."""


def segment_log_prob(policy, obs: Tensor, actions: Tensor, mask: Optional[Tensor]) -> Tensor:
    """``[B]`` sum over valid steps of ``log pi(a_t | s_t)``."""
    logp = policy.log_prob(obs, actions)
    if mask is not None:
        logp = logp * mask.to(logp.dtype)
    return logp.sum(0)


def dpo_loss(
    logp_w: Tensor,
    logp_l: Tensor,
    ref_logp_w: Tensor,
    ref_logp_l: Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    weight: Optional[Tensor] = None,
) -> dict[str, Tensor]:
    """``-log sigmoid(beta * ((logp_w - ref_w) - (logp_l - ref_l)))`` (mean over pairs) plus reward diagnostics."""
    chosen = beta * (logp_w - ref_logp_w)
    rejected = beta * (logp_l - ref_logp_l)
    logits = chosen - rejected
    per_pair = -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    loss = (per_pair * weight).mean() if weight is not None else per_pair.mean()
    chosen, rejected = chosen.detach(), rejected.detach()
    return {
        "loss_dpo": loss,
        "reward_accuracy": (chosen > rejected).float().mean(),
        "reward_margin": (chosen - rejected).mean(),
        "reward_chosen": chosen.mean(),
        "reward_rejected": rejected.mean(),
    }


class DPO(BaseAlgorithm):
    """Direct preference optimisation of the Gaussian policy on segment pairs."""

    name = "dpo"

    def __init__(self, config: Optional[DPOConfig], obs_dim: int, act_dim: int, device: str | torch.device = "cpu"):
        config = config or DPOConfig()
        super().__init__(config, obs_dim, act_dim, device)
        self.config: DPOConfig = config
        self._init_reference()

    def init_from_policy(self, policy_state: Mapping[str, Tensor]) -> None:
        """Load trained policy weights (and normaliser) and make them the reference too."""
        self.policy.load_state_dict(policy_state)
        self.sync_reference()

    def _terms(self, batch: PreferenceBatch) -> dict[str, Tensor]:
        logp_w = segment_log_prob(self.policy, batch.obs_w, batch.act_w, batch.mask_w)
        logp_l = segment_log_prob(self.policy, batch.obs_l, batch.act_l, batch.mask_l)
        with torch.no_grad():
            ref_w = segment_log_prob(self.ref_policy, batch.obs_w, batch.act_w, batch.mask_w)
            ref_l = segment_log_prob(self.ref_policy, batch.obs_l, batch.act_l, batch.mask_l)
        return dpo_loss(logp_w, logp_l, ref_w, ref_l, self.config.beta, self.config.label_smoothing, batch.weight)

    @torch.no_grad()
    def evaluate(self, batch: PreferenceBatch) -> dict[str, float]:
        """Loss and reward metrics on (held-out) pairs, without a gradient step."""
        return {k: float(v) for k, v in self._terms(batch.to(self.device)).items()}

    def update(self, batch: PreferenceBatch) -> dict[str, float]:
        cfg = self.config
        batch = batch.to(self.device)
        if cfg.ref_update_interval > 0 and self.step > 0 and self.step % cfg.ref_update_interval == 0:
            self.sync_reference()
        sums: dict[str, float] = {}
        count = 0
        for _ in range(cfg.update_epochs):
            for mb in minibatch_indices(batch.num_pairs, cfg.num_minibatches, self.generator, self.device):
                terms = self._terms(batch.select(mb))
                loss = terms["loss_dpo"]
                stats: dict[str, Any] = dict(terms)
                stats["loss_total"] = loss
                stats["grad_norm"] = self._apply_gradients(loss)
                accumulate(sums, stats)
                count += 1
        self.step += 1
        out = {k: v / max(count, 1) for k, v in sums.items()}
        out.update({"learning_rate": self.learning_rate, "num_pairs": float(batch.num_pairs), "step": float(self.step)})
        return out
