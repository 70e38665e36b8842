"""PPO: config, losses (GAE, clipped surrogate, value clipping) and the learner step."""

from agents.ppo.config import PPOConfig
from agents.ppo.learning import PPO
from agents.ppo.losses import clipped_surrogate, compute_gae, policy_loss, value_loss

__all__ = ["PPO", "PPOConfig", "compute_gae", "clipped_surrogate", "policy_loss", "value_loss"]
