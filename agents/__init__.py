"""rlstream algorithms as pure torch: networks, normalisers, losses and learner steps. No I/O.

The algorithms are siblings: shared math lives in neutral modules (``returns``: GAE, value
bootstrap, rollout returns, group statistics; ``losses``: clipped surrogate, ratio diagnostics;
``vtrace``; ``base``: masks, minibatches, the optimiser step), never in another algorithm's
module. A subclass is a variant of its parent (DAPO of GRPO, TBA of AGRO), not a helper source.

A new algorithm: ``agents/<algo>.py`` (config dataclass and class with ``name``), its
``AlgorithmSpec`` in ``registry.SPECS``, its row in ``config.algos.ALGO_DEFAULTS``, its tests.

Update loop: one style, CleanRL's. Each ``update`` writes its epochs and minibatches out whole,
so one file reads top to bottom, and every minibatch goes through the one shared step
``BaseAlgorithm._minibatch_step(loss_fn, ...)`` (backward, clip, Adam; captured when enabled).
Not a shared ``_epochs(loss_fn)``: the loops differ in what matters (PPO's ``target_kl`` early
stop, GRPO's split by rollouts, DPO's preference pairs), and the reference oracles pin each
loop's summation order. DPO still steps through the eager ``_apply_gradients``.

The names below load on first use, so ``config.algos`` (pure data) is read without torch."""

from importlib import import_module

_EXPORTS = {
    "Algorithm": "agents.core", "TrajectoryBatch": "agents.core", "PreferenceBatch": "agents.dpo",
    "ActorCritic": "agents.networks", "Policy": "agents.networks", "RewardScaler": "agents.normalization",
    "RunningMeanStd": "agents.normalization", "ALGORITHMS": "agents.registry", "make_algorithm": "agents.registry",
    "make_config": "agents.registry", "make_policy": "agents.registry", "AlgorithmSpec": "agents.registry",
    "SPECS": "agents.registry", "algorithm_spec": "agents.registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'agents' has no attribute {name!r}")
