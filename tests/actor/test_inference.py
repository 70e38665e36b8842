"""The actor's numpy inference mirrors the torch Policy it snapshots."""

from __future__ import annotations

import numpy as np
import torch

from actor.inference import GaussianSampler
from agents.networks import Policy


def trained_looking_policy(activation: str = "tanh") -> Policy:
    torch.manual_seed(3)
    p = Policy(5, 3, hidden=(16, 8), activation=activation, init_log_std=-0.7)
    with torch.no_grad():
        for param in p.net.actor_mean.parameters():
            param.add_(torch.randn_like(param) * 0.3)  # non-zero head and biases
    p.obs_rms.update(torch.randn(200, 5) * 4 + 2)
    return p


def test_sampler_actions_are_the_policy_mean_plus_std_noise_and_logp_its_density():
    for activation in ("tanh", "relu"):
        policy = trained_looking_policy(activation)
        s = GaussianSampler.of(policy)
        obs = (np.random.default_rng(0).normal(size=(7, 5)) * 30).astype(np.float32)  # some obs clip
        noise, logp = s.noise((7,), torch.Generator().manual_seed(1))
        actions = s.sample(obs, noise)
        with torch.no_grad():
            mean, _, _ = policy.act(torch.from_numpy(obs), deterministic=True)
            want_logp = policy.log_prob(torch.from_numpy(obs), torch.from_numpy(actions))
        np.testing.assert_allclose(actions - noise * np.exp(-0.7), mean.numpy(), atol=1e-5)
        np.testing.assert_allclose(logp, want_logp.numpy(), atol=1e-4)
        assert actions.dtype == np.float32 and logp.dtype == np.float32


def test_sampler_snapshot_does_not_follow_later_weight_changes_and_noise_follows_the_seed():
    policy = trained_looking_policy()
    s = GaussianSampler.of(policy)
    obs = np.ones((2, 5), np.float32)
    zero = np.zeros((2, 3), np.float32)
    before = s.sample(obs, zero)
    with torch.no_grad():
        policy.net.actor_mean[-1].bias.add_(1.0)
    np.testing.assert_array_equal(s.sample(obs, zero), before)
    np.testing.assert_allclose(GaussianSampler.of(policy).sample(obs, zero), before + 1.0, atol=1e-5)
    a, _ = s.noise((4, 2), torch.Generator().manual_seed(5))
    b, _ = s.noise((4, 2), torch.Generator().manual_seed(5))
    np.testing.assert_array_equal(a, b)
    assert a.shape == (4, 2, 3) and abs(float(a.std()) - 1.0) < 0.6


def test_policies_it_cannot_mirror_fall_back():
    assert GaussianSampler.of(Policy(4, 1, nvec=(3,))) is None  # categorical head
    assert GaussianSampler.of(Policy(4, 2, activation="gelu")) is None
