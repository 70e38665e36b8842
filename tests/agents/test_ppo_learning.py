import copy

import torch

from agents.ppo import PPO, PPOConfig

FAST = dict(update_epochs=4, num_minibatches=4, anneal_lr=False, learning_rate=3e-3)


def test_ppo_learns_the_bandit(bandit):
    algo = PPO(PPOConfig(**FAST), bandit.OBS_DIM, bandit.ACT_DIM)
    gen = torch.Generator().manual_seed(0)
    mse0, rew0 = bandit.policy_mse(algo.policy), bandit.mean_reward(algo.policy)
    for _ in range(30):
        m = algo.update(bandit.rollout(algo.policy, 64, 8, gen))
    assert bandit.policy_mse(algo.policy) < 0.25 * mse0
    assert bandit.mean_reward(algo.policy) > rew0 + 0.4
    assert {"loss_policy", "loss_value", "loss_entropy", "loss_total", "approx_kl", "clipfrac", "explained_variance"} <= set(m)


def test_fresh_on_policy_batch_starts_at_ratio_one(bandit):
    algo = PPO(PPOConfig(update_epochs=1, num_minibatches=1), bandit.OBS_DIM, bandit.ACT_DIM)
    algo.policy.obs_rms.update(torch.randn(50, bandit.OBS_DIM) * 3 + 1)  # actor and learner share these stats
    batch = bandit.rollout(algo.policy, 16, 4, torch.Generator().manual_seed(1))
    m = algo.update(batch)  # one minibatch: its diagnostics are from before the step
    assert abs(m["approx_kl"]) < 1e-7 and m["clipfrac"] == 0.0 and abs(m["ratio_mean"] - 1.0) < 1e-6


def test_normaliser_is_updated_after_the_step_with_batch_obs(bandit):
    algo = PPO(PPOConfig(**FAST), bandit.OBS_DIM, bandit.ACT_DIM)
    batch = bandit.rollout(algo.policy, 8, 4, torch.Generator().manual_seed(2))
    algo.update(batch)
    torch.testing.assert_close(algo.policy.obs_rms.mean, batch.obs.reshape(-1, 2).double().mean(0), atol=1e-5, rtol=0)
    assert abs(float(algo.policy.obs_rms.count) - 32) < 1e-3


def test_learning_rate_anneals_linearly(bandit):
    algo = PPO(PPOConfig(update_epochs=1, num_minibatches=1, total_updates=4, learning_rate=1e-3), bandit.OBS_DIM, bandit.ACT_DIM)
    gen = torch.Generator().manual_seed(0)
    lrs = [algo.update(bandit.rollout(algo.policy, 4, 2, gen))["learning_rate"] for _ in range(5)]
    torch.testing.assert_close(torch.tensor(lrs), torch.tensor([1e-3, 7.5e-4, 5e-4, 2.5e-4, 0.0]))


def test_resume_from_state_dict_reproduces_the_next_update(bandit):
    gen = torch.Generator().manual_seed(0)
    a = PPO(PPOConfig(**FAST), bandit.OBS_DIM, bandit.ACT_DIM)
    a.update(bandit.rollout(a.policy, 16, 4, gen))
    snap = copy.deepcopy(a.state_dict())  # state_dict() returns live tensors, like torch's
    b2 = bandit.rollout(a.policy, 16, 4, gen)
    ma = a.update(b2)
    b = PPO(PPOConfig(**FAST, seed=99), bandit.OBS_DIM, bandit.ACT_DIM)
    b.load_state_dict(snap)
    mb = b.update(b2)
    assert ma == mb
    for (k, pa), pb in zip(a.policy.state_dict().items(), b.policy.state_dict().values()):
        assert torch.equal(pa, pb), k


def test_sample_weight_zero_freezes_the_policy_head(bandit):
    algo = PPO(PPOConfig(**FAST, vf_coef=0.0), bandit.OBS_DIM, bandit.ACT_DIM)
    batch = bandit.rollout(algo.policy, 16, 4, torch.Generator().manual_seed(0))
    import dataclasses

    zero = dataclasses.replace(batch, sample_weight=torch.zeros(16, 4))
    before = copy.deepcopy(algo.policy.net.actor_mean.state_dict())
    algo.update(zero)
    for k, v in algo.policy.net.actor_mean.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_decoupled_mode_matches_plain_ppo_on_fresh_data(bandit):
    gen = torch.Generator().manual_seed(0)
    plain = PPO(PPOConfig(**FAST), bandit.OBS_DIM, bandit.ACT_DIM)
    dec = PPO(PPOConfig(**FAST, decoupled=True), bandit.OBS_DIM, bandit.ACT_DIM)
    batch = bandit.rollout(plain.policy, 16, 4, gen)
    mp, md = plain.update(batch), dec.update(batch)
    for k in ("loss_policy", "loss_value", "approx_kl", "clipfrac"):
        assert abs(mp[k] - md[k]) < 1e-4, k
    assert md["behaviour_weight_mean"] > 0.999


def test_decoupled_mode_recentres_the_trust_region_on_stale_data(bandit):
    gen = torch.Generator().manual_seed(0)
    algo = PPO(PPOConfig(**FAST), bandit.OBS_DIM, bandit.ACT_DIM)
    stale = copy.deepcopy(algo.policy)
    for _ in range(5):
        algo.update(bandit.rollout(algo.policy, 32, 8, gen))
    batch = bandit.rollout(stale, 16, 4, gen)  # behaviour 5 versions behind
    plain = copy.deepcopy(algo)
    one = dict(FAST, update_epochs=1, num_minibatches=1)
    plain.config = PPOConfig(**one)
    dec = copy.deepcopy(algo)
    dec.config = PPOConfig(**one, decoupled=True)
    mp, md = plain.update(batch), dec.update(batch)
    assert mp["approx_kl"] > 1e-3  # against the stale behaviour policy the ratio is far from 1
    assert md["approx_kl"] < 1e-7 and md["behaviour_weight_mean"] < 1.0
