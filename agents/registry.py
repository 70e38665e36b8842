"""One ``AlgorithmSpec`` per algorithm, registered once in ``SPECS``, and the one place
algorithms are constructed.

A spec has two halves, joined by name. The data half is the algorithm's row of
``config.algos.ALGO_DEFAULTS`` (defaults, staleness, on-policy, the ``--actor.overlap`` correction): the
CLI and ``TrainConfig`` read it before torch loads, and ``config/`` imports nothing of ours. The
torch half is here: the config and algorithm classes and the replay rule. A spec whose row is
missing fails here, at import, with a message naming the table. Callers ask the spec
(``algorithm_spec(name)``) and never branch on an algorithm's name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
from torch import Tensor

from agents.agro import AGRO, AGROConfig
from agents.base import BaseAlgorithm, PolicyConfig, build_policy
from agents.core import Algorithm
from agents.dapo import DAPO, DAPOConfig
from agents.dpo import DPO, DPOConfig
from agents.grpo import GRPO, GRPOConfig
from agents.networks import Policy
from agents.ppo import PPO, PPOConfig
from agents.tba import TBA, TBAConfig
from agents.vtrace import behaviour_weights, importance_weights
from config.algos import ALGO_DEFAULTS, AlgoDefaults

__all__ = ["AlgorithmSpec", "SPECS", "ALGORITHMS", "algorithm_spec", "make_config", "make_algorithm", "make_policy",
           "vtrace_replay_weights", "truncated_replay_weights"]

ReplayWeights = Callable[[PolicyConfig, Tensor], tuple[Tensor, Tensor]]


def vtrace_replay_weights(config: PolicyConfig, log_ratio: Tensor) -> tuple[Tensor, Tensor]:
    """``(rho, c)`` with the algorithm's own V-trace caps (a ``VTraceConfig``)."""
    rho, c, _ = behaviour_weights(config, log_ratio)
    return rho, c


def truncated_replay_weights(config: PolicyConfig, log_ratio: Tensor) -> tuple[Tensor, Tensor]:
    """``(rho, c)`` with the stream processors' default caps (``agents.vtrace.importance_weights``)."""
    rho, c, _, _ = importance_weights(log_ratio)
    return rho, c


@dataclass(frozen=True)
class AlgorithmSpec:
    """Everything rlstream knows about one algorithm."""

    name: str
    """``--algo`` value; also the algorithm class's ``name`` and its ``ALGO_DEFAULTS`` key."""
    config: type[PolicyConfig]
    """Its config dataclass (what ``--set key=value`` overrides)."""
    algorithm: type[BaseAlgorithm]
    """Its class: ``algorithm(config, obs_dim, act_dim, device)``."""
    replay_weights: ReplayWeights = truncated_replay_weights
    """The IS weights a fragment replayed from the sample cache is restated with
    (``learner.core.LearnerCore.restate``)."""
    updates_field: Optional[str] = None
    """A config field counting the run's updates (PPO's learning-rate annealing), set by
    ``wiring.build_algo`` to ``total_steps // train_batch_size`` unless given."""

    def __post_init__(self) -> None:
        if self.name not in ALGO_DEFAULTS:
            raise ValueError(f"algorithm {self.name!r} has no row in config.algos.ALGO_DEFAULTS; add one")
        if self.algorithm.name != self.name:
            raise ValueError(f"{self.algorithm.__name__}.name is {self.algorithm.name!r}, its spec {self.name!r}")

    @property
    def defaults(self) -> AlgoDefaults:
        """Its row of ``config.algos.ALGO_DEFAULTS`` (the data half)."""
        return ALGO_DEFAULTS[self.name]

    @property
    def overlap(self) -> Optional[dict[str, Any]]:
        """The config fields co-located ``--actor.overlap`` sets (None: the option is refused)."""
        return self.defaults.overlap


SPECS: dict[str, AlgorithmSpec] = {s.name: s for s in (
    AlgorithmSpec("ppo", PPOConfig, PPO, vtrace_replay_weights, updates_field="total_updates"),
    AlgorithmSpec("grpo", GRPOConfig, GRPO),
    AlgorithmSpec("dapo", DAPOConfig, DAPO),
    AlgorithmSpec("agro", AGROConfig, AGRO, vtrace_replay_weights),
    AlgorithmSpec("tba", TBAConfig, TBA, vtrace_replay_weights),
    AlgorithmSpec("dpo", DPOConfig, DPO),
)}
if set(SPECS) != set(ALGO_DEFAULTS):
    raise ValueError(f"config.algos.ALGO_DEFAULTS rows without a spec here: {sorted(set(ALGO_DEFAULTS) - set(SPECS))}")

#: ``name -> (config class, algorithm class)``: a view of ``SPECS``.
ALGORITHMS: dict[str, tuple[type[PolicyConfig], type[BaseAlgorithm]]] = {
    name: (s.config, s.algorithm) for name, s in SPECS.items()}


def algorithm_spec(name: str) -> AlgorithmSpec:
    """The spec of ``name`` (case-insensitive); unknown names raise ``ValueError``."""
    try:
        return SPECS[name.lower()]
    except KeyError as e:
        raise ValueError(f"unknown algorithm {name!r}; choose from {sorted(SPECS)}") from e


def make_config(name: str, config_overrides: Optional[Mapping[str, Any]] = None) -> PolicyConfig:
    """The algorithm's config with defaults replaced by ``config_overrides``; unknown keys raise."""
    config_cls = algorithm_spec(name).config
    overrides = dict(config_overrides or {})
    fields = {f.name for f in dataclasses.fields(config_cls)}
    unknown = set(overrides) - fields
    if unknown:
        raise ValueError(f"unknown {config_cls.__name__} fields: {sorted(unknown)}")
    for key in ("hidden", "action_nvec"):
        if key in overrides:
            overrides[key] = tuple(overrides[key])  # lists from YAML/JSON
    return config_cls(**overrides)


def make_algorithm(
    name: str,
    obs_dim: int,
    act_dim: int,
    config_overrides: Optional[Mapping[str, Any]] = None,
    device: str | torch.device = "cpu",
) -> Algorithm:
    """Build algorithm ``name`` (a key of ``SPECS``) for the given spaces."""
    return algorithm_spec(name).algorithm(make_config(name, config_overrides), obs_dim, act_dim, device)


def make_policy(
    name: str,
    obs_dim: int,
    act_dim: int,
    config_overrides: Optional[Mapping[str, Any]] = None,
    device: str | torch.device = "cpu",
) -> Policy:
    """Just the ``Policy`` module that algorithm ``name`` publishes, for actors to load state_dicts into."""
    return build_policy(make_config(name, config_overrides), obs_dim, act_dim).to(device)
