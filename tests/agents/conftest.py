"""Shared toy problem for the agents tests: a one-step continuous bandit, pure torch.

obs ~ N(0, I_2); the best action is ``target(obs) = 0.5 * obs0 - 0.3 * obs1``; the
actor clips the action to [-1, 1] (as a real actor would) and the reward is
``-(clip(a) - target)^2``. Every step is a one-step episode (terminated).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import Tensor, nn

from agents.core import TrajectoryBatch

torch.set_num_threads(1)

OBS_DIM, ACT_DIM = 2, 1
_W = torch.tensor([0.5, -0.3])


def target(obs: torch.Tensor) -> torch.Tensor:
    return obs @ _W


def reward(obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    return -(action.clamp(-1.0, 1.0)[..., 0] - target(obs)).pow(2)


def rollout(policy, T: int, N: int, gen: torch.Generator, group_size: int | None = None, obs: torch.Tensor | None = None):
    """A TrajectoryBatch of T x N one-step episodes from ``policy``.

    With ``group_size`` the N columns form N // group_size groups that share
    their observations (rollouts from the same start state), and T should be 1.
    """
    if obs is None:
        if group_size is None:
            obs = torch.randn(T, N, OBS_DIM, generator=gen)
        else:
            base = torch.randn(T, N // group_size, OBS_DIM, generator=gen)
            obs = base.repeat_interleave(group_size, dim=1)
    action, logp, value = policy.act(obs, generator=gen)
    r = reward(obs, action)
    ones = torch.ones(T, N, dtype=torch.bool)
    group_id = None if group_size is None else torch.arange(N) // group_size
    return TrajectoryBatch(
        obs=obs,
        actions=action,
        rewards=r,
        terminated=ones,
        truncated=~ones,
        behaviour_logp=logp,
        values=value,
        last_obs=torch.randn(N, OBS_DIM, generator=gen),
        group_id=group_id,
    )


def policy_mse(policy, n: int = 512, seed: int = 123) -> float:
    """Mean squared error of the deterministic (mean) action vs the target on fixed held-out obs."""
    gen = torch.Generator().manual_seed(seed)
    obs = torch.randn(n, OBS_DIM, generator=gen)
    with torch.no_grad():
        a, _, _ = policy.act(obs, deterministic=True)
    return float((a.clamp(-1, 1)[:, 0] - target(obs)).pow(2).mean())


def mean_reward(policy, n: int = 1024, seed: int = 7) -> float:
    gen = torch.Generator().manual_seed(seed)
    obs = torch.randn(n, OBS_DIM, generator=gen)
    a, _, _ = policy.act(obs, generator=gen)
    return float(reward(obs, a).mean())


@pytest.fixture
def bandit():
    return SimpleNamespace(
        OBS_DIM=OBS_DIM, ACT_DIM=ACT_DIM, target=target, reward=reward, rollout=rollout,
        policy_mse=policy_mse, mean_reward=mean_reward,
    )


# ---- a tabular softmax policy: K discrete actions in one state, with the Policy interface the
# algorithms use (evaluate, log_prob, value), so a real update() can be checked against a
# closed-form optimum. Actions are [..., 1] floats holding the action index.

class TabularPolicy(nn.Module):
    def __init__(self, logits: Tensor) -> None:
        super().__init__()
        self.logits = nn.Parameter(logits.clone().float())
        self.v = nn.Parameter(torch.zeros(()))

    def probs(self) -> Tensor:
        return torch.softmax(self.logits, -1)

    def log_prob(self, obs: Tensor, actions: Tensor) -> Tensor:
        return torch.log_softmax(self.logits, -1)[actions[..., 0].long()]

    def value(self, obs: Tensor) -> Tensor:
        return self.v.expand(obs.shape[:-1])

    def evaluate(self, obs: Tensor, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        logp_all = torch.log_softmax(self.logits, -1)
        entropy = -(logp_all.exp() * logp_all).sum().expand(obs.shape[:-1])
        return self.log_prob(obs, actions), entropy, self.value(obs)


def install(algo, logits: Tensor) -> TabularPolicy:
    """Replace ``algo``'s policy by a tabular one (new optimiser, reference = the new policy)."""
    algo.policy = TabularPolicy(logits)
    algo.optimizer = algo._make_optimizer(list(algo.policy.parameters()))
    algo._init_reference()
    return algo.policy


def bandit_batch(probs: Tensor, rewards: Tensor, n: int, gen: torch.Generator) -> TrajectoryBatch:
    """``n`` one-step episodes (terminated) with actions drawn from ``probs``; ``behaviour_logp = log probs``."""
    a = torch.multinomial(probs, n, replacement=True, generator=gen)
    ones = torch.ones(n, 1, dtype=torch.bool)
    return TrajectoryBatch(
        obs=torch.zeros(n, 1, 1), actions=a.float().reshape(n, 1, 1), rewards=rewards[a].reshape(n, 1),
        terminated=ones, truncated=~ones, behaviour_logp=probs.log()[a].reshape(n, 1), last_obs=torch.zeros(1, 1),
    )


def kl(p: Tensor, q: Tensor) -> float:
    return float((p * (p / q).log()).sum())


@pytest.fixture
def tabular():
    return SimpleNamespace(TabularPolicy=TabularPolicy, install=install, bandit_batch=bandit_batch, kl=kl)
