"""Name -> (config class, algorithm class), and the one place algorithms are constructed."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import torch

from agents.agro import AGRO, AGROConfig
from agents.base import BaseAlgorithm, PolicyConfig, build_policy
from agents.core import Algorithm
from agents.dapo import DAPO, DAPOConfig
from agents.dpo import DPO, DPOConfig
from agents.grpo import GRPO, GRPOConfig
from agents.networks import Policy
from agents.ppo import PPO, PPOConfig
from agents.tba import TBA, TBAConfig

__all__ = ["ALGORITHMS", "make_config", "make_algorithm", "make_policy"]

ALGORITHMS: dict[str, tuple[type[PolicyConfig], type[BaseAlgorithm]]] = {
    "ppo": (PPOConfig, PPO),
    "grpo": (GRPOConfig, GRPO),
    "dapo": (DAPOConfig, DAPO),
    "agro": (AGROConfig, AGRO),
    "tba": (TBAConfig, TBA),
    "dpo": (DPOConfig, DPO),
}


def _lookup(name: str) -> tuple[type[PolicyConfig], type[BaseAlgorithm]]:
    try:
        return ALGORITHMS[name.lower()]
    except KeyError as e:
        raise ValueError(f"unknown algorithm {name!r}; choose from {sorted(ALGORITHMS)}") from e


def make_config(name: str, config_overrides: Optional[Mapping[str, Any]] = None) -> PolicyConfig:
    """The algorithm's config with defaults replaced by ``config_overrides``; unknown keys raise."""
    config_cls, _ = _lookup(name)
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
    """Build algorithm ``name`` (ppo | grpo | dapo | agro | tba | dpo) for the given spaces."""
    _, algo_cls = _lookup(name)
    return algo_cls(make_config(name, config_overrides), obs_dim, act_dim, device)


def make_policy(
    name: str,
    obs_dim: int,
    act_dim: int,
    config_overrides: Optional[Mapping[str, Any]] = None,
    device: str | torch.device = "cpu",
) -> Policy:
    """Just the ``Policy`` module that algorithm ``name`` publishes, for actors to load state_dicts into."""
    return build_policy(make_config(name, config_overrides), obs_dim, act_dim).to(device)
