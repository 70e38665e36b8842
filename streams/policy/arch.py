"""A policy's architecture <-> its module: the safetensors metadata that lets any process rebuild it."""

from __future__ import annotations

import contextlib
import itertools
import logging
from typing import Any

import torch

from agents.networks import Policy

from streams.policy.errors import PolicyLoadError

log = logging.getLogger(__name__)


# -- architecture <-> module ----------------------------------------------------------------------

def arch_of(policy: Policy) -> dict[str, Any]:
    body = policy.net.actor_body
    hidden = [m.out_features for m in body if isinstance(m, torch.nn.Linear)][:-1]
    act_name = next((type(m).__name__.lower() for m in body if not isinstance(m, torch.nn.Linear)), "tanh")
    extra = {"nvec": list(policy.nvec)} if policy.nvec else {}
    return {
        "kind": "categorical_mlp" if policy.nvec else "gaussian_mlp",
        **extra,
        "obs_dim": policy.obs_dim,
        "act_dim": policy.act_dim,
        "hidden": hidden,
        "activation": act_name,
        "normalize_obs": policy.normalize_obs,
        "obs_clip": policy.obs_clip,
    }


def _arch_dims(arch: Any) -> tuple[str, list[int]]:
    """``(kind, [obs_dim, *hidden, actor outputs])`` of a gaussian_mlp (the default kind; outputs:
    act_dim) or categorical_mlp (outputs: sum(nvec)) architecture; PolicyLoadError otherwise."""
    if not isinstance(arch, dict):
        raise PolicyLoadError(f"policy architecture must be an object, not {type(arch).__name__}")
    kind = arch.get("kind", "gaussian_mlp")
    if kind not in ("gaussian_mlp", "categorical_mlp"):
        raise PolicyLoadError(f"unsupported policy architecture {kind!r}")
    try:
        out = sum(int(n) for n in arch["nvec"]) if kind == "categorical_mlp" else int(arch["act_dim"])
        dims = [int(arch["obs_dim"]), *(int(h) for h in arch.get("hidden", (64, 64))), out]
    except (KeyError, TypeError, ValueError) as e:
        raise PolicyLoadError(f"bad policy architecture {arch}: {type(e).__name__}: {e}") from e
    if any(d <= 0 for d in dims):
        raise PolicyLoadError(f"bad policy architecture {arch}: sizes must be positive")
    return kind, dims


def policy_from_arch(arch: dict[str, Any], max_params: int | None = None, *, empty: bool = False) -> Policy:
    """Build the module of ``arch``. ``max_params``: refuse (before allocating anything) an
    architecture whose actor layers alone hold more parameters than this -- the weights that
    come with it: an event must not make a reader allocate what its payload cannot fill.
    ``empty``: allocate its tensors uninitialised (built on the meta device), for a caller that
    loads every one of them next (``load_state``): the orthogonal init of a 10M-parameter policy
    is seconds of QR for nothing."""
    kind, dims = _arch_dims(arch)
    need = sum(a * b for a, b in itertools.pairwise(dims))
    if max_params is not None and need > max_params:
        raise PolicyLoadError(f"policy architecture {arch} needs {need} parameters; its weights hold {max_params}")
    try:
        with torch.device("meta") if empty else contextlib.nullcontext():
            policy = Policy(
                obs_dim=dims[0],
                act_dim=int(arch["act_dim"]),
                hidden=tuple(dims[1:-1]),
                activation=str(arch.get("activation", "tanh")),
                normalize_obs=bool(arch.get("normalize_obs", True)),
                obs_clip=arch.get("obs_clip", 10.0),
                nvec=arch.get("nvec") if kind == "categorical_mlp" else None,
            )
        if not empty:
            return policy
        policy = policy.to_empty(device="cpu")
        held = {n for n, _ in policy.named_parameters()} | {n for n, _ in policy.named_buffers()}
        if held != set(policy.state_dict()):  # a tensor no state_dict fills: build it initialised
            return policy_from_arch(arch, max_params)
        return policy
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise PolicyLoadError(f"bad policy architecture {arch}: {e}") from e
