import math

import torch

from agents.dpo import DPO, DPOConfig, PreferenceBatch, dpo_loss


def test_dpo_loss_by_hand():
    out = dpo_loss(torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.5]), beta=0.1)
    # chosen = 0.1 * (-1 + 2) = 0.1, rejected = 0.1 * (-3 + 2.5) = -0.05, logit 0.15
    # -log sigmoid(0.15) = log(1 + e^-0.15) = 0.6209573
    assert abs(float(out["loss_dpo"]) - 0.6209573) < 1e-6
    assert float(out["reward_accuracy"]) == 1.0
    assert abs(float(out["reward_margin"]) - 0.15) < 1e-7
    assert abs(float(out["reward_chosen"]) - 0.1) < 1e-7 and abs(float(out["reward_rejected"]) + 0.05) < 1e-7
    # at the reference the loss is log 2
    z = torch.zeros(3)
    assert abs(float(dpo_loss(z, z, z, z)["loss_dpo"]) - math.log(2.0)) < 1e-6


def _pairs(bandit, n, seed, L=2):
    """Segments of L one-step decisions; the winner's actions are closer to the target in total."""
    g = torch.Generator().manual_seed(seed)
    obs_a, obs_b = torch.randn(L, n, 2, generator=g), torch.randn(L, n, 2, generator=g)
    act_a, act_b = torch.randn(L, n, 1, generator=g), torch.randn(L, n, 1, generator=g)
    ra, rb = bandit.reward(obs_a, act_a).sum(0), bandit.reward(obs_b, act_b).sum(0)
    a_wins = (ra > rb).view(1, n, 1)
    pick = lambda x, y: torch.where(a_wins, x, y)  # noqa: E731
    return PreferenceBatch(obs_w=pick(obs_a, obs_b), act_w=pick(act_a, act_b), obs_l=pick(obs_b, obs_a), act_l=pick(act_b, act_a))


def _policy_prefers_winner(algo, batch):
    with torch.no_grad():
        lw = algo.policy.log_prob(batch.obs_w, batch.act_w).sum(0)
        ll = algo.policy.log_prob(batch.obs_l, batch.act_l).sum(0)
    return float((lw > ll).float().mean())


def test_dpo_learns_preferences_that_generalise(bandit):
    algo = DPO(DPOConfig(learning_rate=3e-3, num_minibatches=4), bandit.OBS_DIM, bandit.ACT_DIM)
    train, held_out = _pairs(bandit, 512, 0), _pairs(bandit, 512, 1)
    pref0, mse0 = _policy_prefers_winner(algo, held_out), bandit.policy_mse(algo.policy)
    assert algo.evaluate(held_out)["reward_accuracy"] == 0.0  # policy == reference: no margin yet
    for _ in range(60):
        m = algo.update(train)
    ev = algo.evaluate(held_out)
    assert ev["reward_accuracy"] > 0.75 and ev["reward_margin"] > 0 and ev["loss_dpo"] < math.log(2.0) - 0.05
    assert _policy_prefers_winner(algo, held_out) > pref0 + 0.1
    assert bandit.policy_mse(algo.policy) < mse0  # and the mean action moved toward the target
    assert {"loss_dpo", "reward_accuracy", "reward_margin", "reward_chosen", "reward_rejected"} <= set(m)


def test_masks_exclude_padding_steps():
    algo = DPO(None, 2, 1)
    obs, act = torch.randn(3, 4, 2), torch.randn(3, 4, 1)
    mask = torch.tensor([[True] * 4, [True] * 4, [False] * 4])
    b1 = PreferenceBatch(obs, act, obs.flip(1), act.flip(1), mask, mask)
    garbage = obs.clone()
    garbage[2] = 1e3
    b2 = PreferenceBatch(garbage, act, garbage.flip(1), act.flip(1), mask, mask)
    with torch.no_grad():
        algo.policy.net.actor_logstd.fill_(0.3)  # make policy != reference so losses are non-trivial
    assert algo.evaluate(b1) == algo.evaluate(b2)
