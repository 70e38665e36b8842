"""The rollout loop's policy inference: a numpy snapshot of a Gaussian ``Policy``.

A per-step ``Policy.act`` costs a few dozen small torch ops (normaliser, actor and critic MLPs,
distribution maths), which at one or a few envs takes longer than the MuJoCo step itself. The
actor needs neither the value nor autograd, so for a Gaussian head with a plain MLP it snapshots
the weights once per adopted version (``GaussianSampler(policy)``) and, per step, runs only the
normaliser and the actor MLP in numpy. The noise of the whole fragment is drawn at once from the
actor's torch generator, and since ``action = mean + std * noise``, its log density is
``-0.5 * |noise|^2 - sum(log_std) - act_dim * log(2 pi) / 2``, computed for the fragment at once.
Policies it cannot mirror (categorical heads, other layers or activations) use ``Policy.act``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from agents.networks import Policy

_ACTIVATIONS = {nn.Tanh: np.tanh, nn.ReLU: lambda x: np.maximum(x, 0.0, out=x)}


def _layers(body: nn.Sequential) -> list | None:
    """``[(W^T, b) | activation fn, ...]`` of an MLP of Linear layers and known activations."""
    out: list = []
    for m in body:
        if isinstance(m, nn.Linear):
            out.append((m.weight.detach().numpy().T.copy(), m.bias.detach().numpy().copy()))
        elif type(m) in _ACTIVATIONS:
            out.append(_ACTIVATIONS[type(m)])
        else:
            return None
    return out


class GaussianSampler:
    """``sample(obs, noise)`` -> unclipped actions of a frozen copy of ``policy``'s Gaussian head."""

    def __init__(self, policy: Policy, layers: list) -> None:
        self.layers = layers
        with torch.no_grad():
            rms = policy.obs_rms
            self.normalize = policy.normalize_obs
            self.obs_mean = rms.mean.to(torch.float32).numpy().copy()
            self.obs_std = rms.std().to(torch.float32).numpy().copy()
            self.obs_clip = policy.obs_clip
            log_std = policy.net.actor_logstd.detach().reshape(-1)
            self.std = torch.exp(log_std).numpy().copy()
            self.logp_const = float(-(log_std.double().sum() + 0.5 * log_std.numel() * math.log(2.0 * math.pi)))

    @classmethod
    def of(cls, policy: Policy) -> "GaussianSampler | None":
        """A sampler for ``policy``, or None if it is not a CPU Gaussian MLP this can mirror."""
        if policy.nvec or next(policy.parameters()).device.type != "cpu":
            return None
        layers = _layers(policy.net.actor_mean)
        return None if layers is None else cls(policy, layers)

    def noise(self, shape: tuple[int, ...], generator: torch.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``(noise [*shape, act_dim], logp [*shape])`` for ``shape`` steps."""
        eps = torch.randn((*shape, self.std.shape[0]), generator=generator).numpy()
        return eps, self.logp(eps)

    def logp(self, noise: np.ndarray) -> np.ndarray:
        """Log density of the actions ``noise`` gives under this snapshot (``[...]``)."""
        return self.logp_const - 0.5 * np.einsum("...i,...i->...", noise, noise)

    def sample(self, obs: np.ndarray, noise: np.ndarray) -> np.ndarray:
        """Actions ``[N, act_dim]`` for raw observations ``obs [N, obs_dim]`` and standard-normal ``noise``."""
        x = obs
        if self.normalize:
            x = (x - self.obs_mean) / self.obs_std
            if self.obs_clip is not None:
                np.clip(x, -self.obs_clip, self.obs_clip, out=x)
        for layer in self.layers:
            if isinstance(layer, tuple):
                x = x @ layer[0]
                x += layer[1]
            else:
                x = layer(x)
        return x + self.std * noise
