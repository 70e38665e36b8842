"""PPO configuration (defaults: CleanRL ``ppo_continuous_action.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from agents.vtrace import VTraceConfig

__all__ = ["PPOConfig"]


@dataclass(frozen=True)
class PPOConfig(VTraceConfig):
    """Clipped-surrogate PPO with GAE. Inherits network/optimiser fields from ``PolicyConfig``
    and the off-policy correction (used when ``decoupled``) from ``VTraceConfig``.

    One ``update()`` call is one CleanRL iteration: ``update_epochs`` passes over
    the batch (CleanRL: 1 env x 2048 steps) in ``num_minibatches`` shuffled
    minibatches.
    """

    gamma: float = 0.99
    """Discount factor (also the discount of the return whose std scales rewards)."""
    gae_lambda: float = 0.95
    """GAE lambda."""
    update_epochs: int = 10
    """Passes over each batch."""
    num_minibatches: int = 32
    """Minibatches per pass (minibatch size = T * N // num_minibatches)."""
    clip_coef: float = 0.2
    """Surrogate clipping epsilon (ratio clipped to [1 - clip_coef, 1 + clip_coef])."""
    clip_vloss: bool = True
    """Clip the value update around the behaviour-time value (CleanRL's clipped value loss)."""
    ent_coef: float = 0.0
    """Entropy bonus coefficient."""
    vf_coef: float = 0.5
    """Value loss coefficient."""
    norm_adv: bool = True
    """Normalise advantages per minibatch (mean 0, std 1)."""
    target_kl: Optional[float] = None
    """Stop the epochs of an update early once the mean approx KL of an epoch exceeds this; None disables."""
    anneal_lr: bool = True
    """Linearly anneal the learning rate to 0 over ``total_updates`` update() calls."""
    total_updates: Optional[int] = 488
    """Number of update() calls the annealing spans (CleanRL: 1M steps // 2048 = 488); None disables annealing.
    Past the end the rate stays at 0."""
    normalize_reward: bool = True
    """Divide rewards by the running std of the gamma-discounted return (learner-side NormalizeReward)."""
    reward_clip: float = 10.0
    """Clip of scaled rewards (CleanRL TransformReward clip 10)."""
    bootstrap_on_truncation: bool = True
    """Bootstrap truncated episodes from V(final obs). False reproduces CleanRL, which treats truncation as termination."""
    use_sample_weight: bool = True
    """Multiply per-sample losses by ``batch.sample_weight`` when present."""
    decoupled: bool = False
    """Decoupled PPO for stale data: the clip is anchored at the learner's own policy at the start of
    the update (pi_prox), each sample is weighted by the behaviour correction ``rho = pi_prox / mu``
    under the shared cap rule (``agents.vtrace.importance_weights``: dropped above ``behaviour_cap``,
    truncated at ``rho_bar``), and advantages / value targets are V-trace's (``c`` truncated at
    ``c_bar``) with the current critic. Identical to plain PPO on fresh data; off by default
    (CleanRL has no such mode)."""
