"""rlstream algorithms as pure torch: networks, normalisers, losses and learner steps. No I/O.

The names below load on first use, so ``config.algos`` (pure data) is read without torch."""

from importlib import import_module

_EXPORTS = {
    "Algorithm": "agents.core", "TrajectoryBatch": "agents.core", "PreferenceBatch": "agents.dpo",
    "ActorCritic": "agents.networks", "Policy": "agents.networks", "RewardScaler": "agents.normalization",
    "RunningMeanStd": "agents.normalization", "ALGORITHMS": "agents.registry", "make_algorithm": "agents.registry",
    "make_config": "agents.registry", "make_policy": "agents.registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'agents' has no attribute {name!r}")
