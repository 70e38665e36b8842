"""Policy networks.

``ActorCritic`` is CleanRL's ``ppo_continuous_action`` agent: two separate MLPs
(policy mean and value), a state-independent ``log_std`` parameter, orthogonal
init with gain sqrt(2) on hidden layers, 0.01 on the policy head and 1.0 on the
value head, zero biases.

``Policy`` wraps an ``ActorCritic`` with the observation normaliser, so one
``state_dict()`` carries everything an actor needs: weights *and* normaliser
statistics. Actors load it and call ``act``; they never update the normaliser
(the learner does, via ``policy.obs_rms.update(obs)``).

Actions are returned unclipped and ``logp`` is the density of the unclipped
action; clipping to the action bounds is the actor's job (as gymnasium's
``ClipAction`` wrapper does in CleanRL).

With ``nvec`` (Discrete: ``(n,)``; MultiDiscrete: its ``nvec``) the policy head is categorical
instead (CleanRL's ``ppo.py`` agent): the actor MLP outputs ``sum(nvec)`` logits, one independent
categorical per action component, and there is no ``log_std``. Actions are still float32
``[..., act_dim]`` vectors (``act_dim == len(nvec)``) holding each component's index, so events,
batches and every algorithm stay the same: they only call ``act``, ``evaluate``, ``log_prob``
and ``value``, which work with both heads.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from agents.normalization import RunningMeanStd

__all__ = ["ActorCritic", "Policy", "check_nvec", "layer_init", "mlp", "resolve_activation"]

_LOG_2PI = math.log(2.0 * math.pi)

ActivationLike = Union[str, type, Callable[[], nn.Module]]

_ACTIVATIONS: dict[str, type] = {
    "tanh": nn.Tanh,
    "relu": nn.ReLU,
    "elu": nn.ELU,
    "gelu": nn.GELU,
    "silu": nn.SiLU,
}


def resolve_activation(activation: ActivationLike) -> Callable[[], nn.Module]:
    """Accept ``"tanh"``, ``nn.Tanh``, ``torch.tanh`` or any zero-arg module factory."""
    if isinstance(activation, str):
        try:
            return _ACTIVATIONS[activation.lower()]
        except KeyError as e:
            raise ValueError(f"unknown activation {activation!r}; choose from {sorted(_ACTIVATIONS)}") from e
    if activation is torch.tanh:
        return nn.Tanh
    if activation is torch.relu:
        return nn.ReLU
    return activation  # a module class or factory


def layer_init(layer: nn.Linear, std: float = math.sqrt(2.0), bias: float = 0.0) -> nn.Linear:
    """Orthogonal weight init with gain ``std`` and constant bias (CleanRL's ``layer_init``)."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias)
    return layer


def check_nvec(nvec: Optional[Sequence[int]], act_dim: int) -> tuple[int, ...]:
    """``nvec`` as a tuple (``()``: Gaussian head); ValueError unless it fits ``act_dim``."""
    out = tuple(int(n) for n in (nvec or ()))
    if out and (len(out) != act_dim or min(out) < 1):
        raise ValueError(f"nvec {list(out)} must hold act_dim={act_dim} positive choice counts")
    return out


def mlp(in_dim: int, hidden: Sequence[int], out_dim: int, activation: Callable[[], nn.Module], out_std: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    last = in_dim
    for h in hidden:
        layers += [layer_init(nn.Linear(last, h)), activation()]
        last = h
    layers.append(layer_init(nn.Linear(last, out_dim), std=out_std))
    return nn.Sequential(*layers)


class ActorCritic(nn.Module):
    """Diagonal-Gaussian (or categorical) actor and separate value MLP, on (already normalised)
    observations.

    Args:
        obs_dim: observation size.
        act_dim: action size.
        hidden: hidden layer widths, shared layout for actor and critic (not weights).
        activation: activation name/class (default tanh).
        init_log_std: initial value of the state-independent log standard deviation.
        nvec: categorical head with these numbers of choices per action component
            (``len(nvec) == act_dim``); None: Gaussian head.
    """

    def __init__(
        self,
        obs_dim: int,
        act_dim: int,
        hidden: Sequence[int] = (64, 64),
        activation: ActivationLike = "tanh",
        init_log_std: float = 0.0,
        nvec: Optional[Sequence[int]] = None,
    ):
        super().__init__()
        act = resolve_activation(activation)
        self.obs_dim = int(obs_dim)
        self.act_dim = int(act_dim)
        self.nvec = check_nvec(nvec, self.act_dim)
        self.critic = mlp(obs_dim, hidden, 1, act, out_std=1.0)
        if self.nvec:
            self.actor_logits = mlp(obs_dim, hidden, sum(self.nvec), act, out_std=0.01)
        else:
            self.actor_mean = mlp(obs_dim, hidden, act_dim, act, out_std=0.01)
            self.actor_logstd = nn.Parameter(torch.full((1, act_dim), float(init_log_std)))

    @property
    def actor_body(self) -> nn.Sequential:
        """The actor MLP (mean or logits head)."""
        return self.actor_logits if self.nvec else self.actor_mean

    def _log_softmax(self, obs: Tensor) -> list[Tensor]:
        """Per-component ``[..., n_i]`` log-probabilities of the categorical head."""
        return [torch.log_softmax(z, -1) for z in self.actor_logits(obs).split(self.nvec, -1)]

    def _categorical_log_prob(self, logps: list[Tensor], actions: Tensor) -> Tensor:
        idx = actions.round().long()
        if idx.shape[-1] != len(self.nvec):
            raise ValueError(f"actions have {idx.shape[-1]} components, the policy {len(self.nvec)}")
        if bool((idx < 0).any()) or bool((idx >= idx.new_tensor(self.nvec)).any()):
            raise ValueError(f"discrete actions outside [0, nvec) for nvec {list(self.nvec)}")
        return sum(lp.gather(-1, idx[..., i:i + 1]).squeeze(-1) for i, lp in enumerate(logps))

    @staticmethod
    def _categorical_entropy(logps: list[Tensor]) -> Tensor:
        return sum(-(lp.exp() * lp).sum(-1) for lp in logps)

    def value(self, obs: Tensor) -> Tensor:
        """State value ``[...]`` for ``obs[..., obs_dim]``."""
        return self.critic(obs).squeeze(-1)

    def distribution_params(self, obs: Tensor) -> tuple[Tensor, Tensor]:
        """``(mean, log_std)``, both ``[..., act_dim]``."""
        mean = self.actor_mean(obs)
        return mean, self.actor_logstd.expand_as(mean)

    @staticmethod
    def gaussian_log_prob(mean: Tensor, log_std: Tensor, actions: Tensor) -> Tensor:
        """Sum over action dims of the diagonal-Gaussian log density."""
        z = (actions - mean) * torch.exp(-log_std)
        return (-0.5 * z.pow(2) - log_std - 0.5 * _LOG_2PI).sum(-1)

    @staticmethod
    def gaussian_entropy(log_std: Tensor) -> Tensor:
        return (0.5 + 0.5 * _LOG_2PI + log_std).sum(-1)

    def act(
        self, obs: Tensor, deterministic: bool = False, generator: Optional[torch.Generator] = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        if self.nvec:
            logps = self._log_softmax(obs)
            if deterministic:
                picks = [lp.argmax(-1) for lp in logps]
            else:
                picks = [torch.multinomial(lp.exp().reshape(-1, lp.shape[-1]), 1, generator=generator)
                         .reshape(lp.shape[:-1]) for lp in logps]
            action = torch.stack(picks, -1).to(obs.dtype)
            return action, self._categorical_log_prob(logps, action), self.value(obs)
        mean, log_std = self.distribution_params(obs)
        if deterministic:
            action = mean
        else:
            noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
            action = mean + torch.exp(log_std) * noise
        return action, self.gaussian_log_prob(mean, log_std, action), self.value(obs)

    def evaluate(self, obs: Tensor, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self.nvec:
            logps = self._log_softmax(obs)
            return self._categorical_log_prob(logps, actions), self._categorical_entropy(logps), self.value(obs)
        mean, log_std = self.distribution_params(obs)
        return self.gaussian_log_prob(mean, log_std, actions), self.gaussian_entropy(log_std), self.value(obs)

    def log_prob(self, obs: Tensor, actions: Tensor) -> Tensor:
        if self.nvec:
            return self._categorical_log_prob(self._log_softmax(obs), actions)
        mean, log_std = self.distribution_params(obs)
        return self.gaussian_log_prob(mean, log_std, actions)


class Policy(nn.Module):
    """Observation normaliser + ``ActorCritic``: the module whose ``state_dict`` is published.

    All methods take *raw* observations and normalise them with the current
    statistics (``obs_rms``) first; none of them update the statistics.

    Args:
        obs_dim, act_dim, hidden, activation, init_log_std: see ``ActorCritic``.
        normalize_obs: if False the normaliser is kept (so the state_dict layout
            is the same) but bypassed.
        obs_clip: clip of normalised observations (CleanRL: 10).
        nvec: categorical head (see ``ActorCritic``); None: Gaussian.
    """

    def __init__(
        self,
        obs_dim: int,
        act_dim: int,
        hidden: Sequence[int] = (64, 64),
        activation: ActivationLike = "tanh",
        init_log_std: float = 0.0,
        normalize_obs: bool = True,
        obs_clip: Optional[float] = 10.0,
        nvec: Optional[Sequence[int]] = None,
    ):
        super().__init__()
        self.obs_dim = int(obs_dim)
        self.act_dim = int(act_dim)
        self.nvec = check_nvec(nvec, self.act_dim)
        self.normalize_obs = bool(normalize_obs)
        self.obs_clip = obs_clip
        self.obs_rms = RunningMeanStd(shape=(self.obs_dim,))
        self.net = ActorCritic(obs_dim, act_dim, hidden, activation, init_log_std, self.nvec)

    def preprocess(self, obs: Tensor) -> Tensor:
        """Normalise (and clip) raw observations with the current statistics."""
        if not self.normalize_obs:
            return obs
        return self.obs_rms.normalize(obs, self.obs_clip)

    @torch.no_grad()
    def act(
        self, obs: Tensor, deterministic: bool = False, generator: Optional[torch.Generator] = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Sample (or take the mean) action. Returns ``(action, logp, value)``; no grad.

        ``action`` is unclipped, ``logp`` is its log density (summed over dims); categorical
        head: ``action`` holds each component's index (float), ``logp`` its log-probability.
        """
        return self.net.act(self.preprocess(obs), deterministic, generator)

    def evaluate(self, obs: Tensor, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(logp, entropy, value)`` of given actions; differentiable."""
        return self.net.evaluate(self.preprocess(obs), actions)

    def log_prob(self, obs: Tensor, actions: Tensor) -> Tensor:
        """Log density of ``actions`` under the policy; differentiable."""
        return self.net.log_prob(self.preprocess(obs), actions)

    def value(self, obs: Tensor) -> Tensor:
        """State value; differentiable."""
        return self.net.value(self.preprocess(obs))

    def forward(self, obs: Tensor, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.evaluate(obs, actions)
