import math

import torch
from torch.distributions import Normal

from agents.networks import ActorCritic, Policy
from agents.registry import make_policy


def test_cleanrl_initialisation():
    net = ActorCritic(5, 3)
    hidden0 = net.actor_mean[0].weight  # [64, 5]: orthonormal columns scaled by sqrt(2)
    torch.testing.assert_close(hidden0.T @ hidden0, 2.0 * torch.eye(5), atol=1e-5, rtol=0)
    torch.testing.assert_close(net.actor_mean[-1].weight.norm(dim=1), torch.full((3,), 0.01), atol=1e-6, rtol=0)
    torch.testing.assert_close(net.critic[-1].weight.norm(dim=1), torch.ones(1), atol=1e-6, rtol=0)
    for m in list(net.actor_mean) + list(net.critic):
        if isinstance(m, torch.nn.Linear):
            assert torch.count_nonzero(m.bias) == 0
    assert isinstance(net.actor_mean[1], torch.nn.Tanh)
    assert torch.equal(net.actor_logstd, torch.zeros(1, 3))


def test_log_prob_and_entropy_match_torch_distributions():
    torch.manual_seed(0)
    pol = Policy(4, 2)
    with torch.no_grad():
        pol.net.actor_logstd.fill_(-0.3)
    obs, act = torch.randn(10, 4), torch.randn(10, 2)
    logp, ent, value = pol.evaluate(obs, act)
    mean = pol.net.actor_mean(pol.preprocess(obs))
    dist = Normal(mean, torch.full_like(mean, math.exp(-0.3)))
    torch.testing.assert_close(logp, dist.log_prob(act).sum(-1))
    torch.testing.assert_close(ent, dist.entropy().sum(-1))
    assert value.shape == (10,)


def test_act_logp_is_of_the_unclipped_sample_and_matches_evaluate():
    pol = Policy(3, 2)
    g = torch.Generator().manual_seed(0)
    obs = torch.randn(7, 5, 3)
    a, logp, v = pol.act(obs, generator=g)
    assert a.shape == (7, 5, 2) and logp.shape == (7, 5) and v.shape == (7, 5)
    assert (a.abs() > 1).any()  # std 1: some samples leave [-1, 1]; the actor clips, not the policy
    torch.testing.assert_close(pol.log_prob(obs, a), logp)


def test_policy_state_dict_round_trip_gives_identical_actions():
    src = make_policy("ppo", 3, 2)
    src.obs_rms.update(torch.randn(100, 3) * 5 + 2)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(0.1 * torch.randn_like(p))
    sd = src.state_dict()
    assert {"obs_rms.mean", "obs_rms.var", "obs_rms.count", "net.actor_logstd"} <= set(sd)
    dst = make_policy("ppo", 3, 2)
    dst.load_state_dict({k: v.clone() for k, v in sd.items()})
    obs = torch.randn(64, 3) * 5
    a1, l1, v1 = src.act(obs, deterministic=True)
    a2, l2, v2 = dst.act(obs, deterministic=True)
    assert torch.equal(a1, a2) and torch.equal(l1, l2) and torch.equal(v1, v2)
    s1, _, _ = src.act(obs, generator=torch.Generator().manual_seed(3))
    s2, _, _ = dst.act(obs, generator=torch.Generator().manual_seed(3))
    assert torch.equal(s1, s2)
    fresh = make_policy("ppo", 3, 2)
    assert not torch.equal(fresh.act(obs, deterministic=True)[0], a1)


def test_act_does_not_update_normaliser_and_normalisation_is_applied():
    pol = Policy(2, 1)
    pol.obs_rms.update(torch.tensor([[10.0, -10.0], [12.0, -8.0]]))
    before = {k: v.clone() for k, v in pol.obs_rms.state_dict().items()}
    pol.act(torch.randn(5, 2))
    for k, v in pol.obs_rms.state_dict().items():
        assert torch.equal(v, before[k])
    obs = torch.tensor([[11.0, -9.0]])
    torch.testing.assert_close(pol.preprocess(obs), torch.zeros(1, 2), atol=1e-3, rtol=0)
    raw = Policy(2, 1, normalize_obs=False)
    assert torch.equal(raw.preprocess(obs), obs)
