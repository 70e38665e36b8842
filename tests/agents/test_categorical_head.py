"""The categorical policy head (Discrete / MultiDiscrete actions) against torch.distributions,
and every algorithm's update on discrete actions."""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Categorical

from agents.core import TrajectoryBatch
from agents.networks import Policy
from agents.registry import ALGORITHMS, make_algorithm

torch.set_num_threads(1)


def test_log_prob_and_entropy_match_torch_categorical():
    torch.manual_seed(0)
    p = Policy(4, 2, hidden=(16,), nvec=(3, 5))
    obs = torch.randn(7, 4)
    logits = p.net.actor_logits(p.preprocess(obs))
    d0, d1 = Categorical(logits=logits[:, :3]), Categorical(logits=logits[:, 3:])
    actions = torch.stack([d0.sample(), d1.sample()], -1).float()
    logp, ent, value = p.evaluate(obs, actions)
    torch.testing.assert_close(logp, d0.log_prob(actions[:, 0].long()) + d1.log_prob(actions[:, 1].long()))
    torch.testing.assert_close(ent, d0.entropy() + d1.entropy())
    assert value.shape == (7,)
    torch.testing.assert_close(p.log_prob(obs, actions), logp)


def test_act_samples_valid_indices_with_their_log_probs_and_argmax_when_deterministic():
    torch.manual_seed(1)
    p = Policy(3, 1, hidden=(8,), nvec=(4,))
    with torch.no_grad():
        p.net.actor_logits[-1].bias.copy_(torch.tensor([0.0, 2.0, 0.0, -1.0]))
    obs = torch.zeros(4000, 3)
    a, logp, _ = p.act(obs, generator=torch.Generator().manual_seed(0))
    assert a.shape == (4000, 1) and a.dtype == torch.float32
    assert set(a[:, 0].long().tolist()) <= {0, 1, 2, 3}
    torch.testing.assert_close(logp, p.log_prob(obs, a))
    freq = torch.bincount(a[:, 0].long(), minlength=4).float() / 4000
    probs = torch.softmax(p.net.actor_logits(p.preprocess(obs[:1])), -1)[0].detach()
    assert torch.allclose(freq, probs, atol=0.03)
    det, _, _ = p.act(obs[:5], deterministic=True)
    assert det[:, 0].long().tolist() == [1] * 5


def test_bad_discrete_actions_are_refused():
    p = Policy(3, 1, hidden=(8,), nvec=(2,))
    with pytest.raises(ValueError, match="outside"):
        p.log_prob(torch.zeros(2, 3), torch.tensor([[0.0], [2.0]]))
    with pytest.raises(ValueError, match="components"):
        p.log_prob(torch.zeros(2, 3), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="nvec"):
        Policy(3, 2, nvec=(2,))


def test_gaussian_state_dict_layout_is_unchanged():
    keys = set(Policy(3, 2, hidden=(8,)).state_dict())
    assert "net.actor_logstd" in keys and any(k.startswith("net.actor_mean.") for k in keys)
    cat = set(Policy(3, 1, hidden=(8,), nvec=(2,)).state_dict())
    assert "net.actor_logstd" not in cat and any(k.startswith("net.actor_logits.") for k in cat)


def _discrete_batch(policy, T: int, N: int, gen: torch.Generator, grouped: bool) -> TrajectoryBatch:
    """One-step episodes: reward 1 for action 2 of 3, else 0."""
    obs = torch.randn(T, N, 2, generator=gen)
    a, logp, v = policy.act(obs, generator=gen)
    ones = torch.ones(T, N, dtype=torch.bool)
    return TrajectoryBatch(obs=obs, actions=a, rewards=(a[..., 0] == 2).float(), terminated=ones,
                           truncated=~ones, behaviour_logp=logp, values=v, last_obs=torch.zeros(N, 2),
                           group_id=torch.arange(N) // 4 if grouped else None)


@pytest.mark.parametrize("name", sorted(n for n in ALGORITHMS if n != "dpo"))
def test_every_algorithm_learns_a_discrete_bandit(name):
    torch.manual_seed(0)
    algo = make_algorithm(name, 2, 1, {"action_nvec": [3], "learning_rate": 3e-3})
    gen = torch.Generator().manual_seed(0)
    grouped = name in ("grpo", "dapo")
    p_before = float(torch.softmax(algo.policy.net.actor_logits(torch.zeros(1, 2)), -1)[0, 2].detach())
    for _ in range(15):
        m = algo.update(_discrete_batch(algo.policy, 1 if grouped else 8, 32, gen, grouped))
    p_after = float(torch.softmax(algo.policy.net.actor_logits(torch.zeros(1, 2)), -1)[0, 2].detach())
    assert all(torch.isfinite(torch.tensor(v)) for v in m.values() if isinstance(v, float))
    assert p_after > p_before + 0.2, (p_before, p_after)
