"""rlstream algorithms as pure torch: networks, normalisers, losses and learner steps. No I/O."""

from agents.core import Algorithm, TrajectoryBatch
from agents.dpo import PreferenceBatch
from agents.networks import ActorCritic, Policy
from agents.normalization import RewardScaler, RunningMeanStd
from agents.registry import ALGORITHMS, make_algorithm, make_config, make_policy

__all__ = [
    "ALGORITHMS",
    "ActorCritic",
    "Algorithm",
    "Policy",
    "PreferenceBatch",
    "RewardScaler",
    "RunningMeanStd",
    "TrajectoryBatch",
    "make_algorithm",
    "make_config",
    "make_policy",
]
