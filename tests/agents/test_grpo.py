import torch

from agents.base import episode_mask
from agents.grpo import GRPO, GRPOConfig, aggregate_loss, group_advantages, k3_kl, rollout_returns


def test_group_advantages_by_hand():
    R = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0])
    gid = torch.tensor([4, 4, 4, 9, 9])
    # group 4: mean 2, unbiased std 1 -> (R - 2) / (1 + eps); group 9: std 0 -> 0
    adv = group_advantages(R, gid, eps=1e-4)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0]) / torch.tensor([1.0001, 1, 1.0001, 1, 1]))
    # population std of group 4 is sqrt(2/3)
    adv_pop = group_advantages(R, gid, eps=0.0, unbiased=False)
    torch.testing.assert_close(adv_pop[:3], torch.tensor([-1.0, 0.0, 1.0]) / (2.0 / 3.0) ** 0.5)
    torch.testing.assert_close(group_advantages(R, gid, scale_by_std=False), torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0]))


def test_rollout_returns_and_episode_mask():
    term = torch.tensor([[False, False], [True, False], [False, False]])
    trunc = torch.tensor([[False, False], [False, False], [False, True]])
    mask = episode_mask(term, trunc)
    assert mask.tolist() == [[True, True], [True, True], [False, True]]
    r = torch.tensor([[1.0, 1.0], [2.0, 1.0], [100.0, 1.0]])
    torch.testing.assert_close(rollout_returns(r, mask), torch.tensor([3.0, 3.0]))
    torch.testing.assert_close(rollout_returns(r, mask, gamma=0.5), torch.tensor([2.0, 1.75]))


def test_aggregation_token_vs_sequence():
    per_step = torch.tensor([[1.0, 4.0], [3.0, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    torch.testing.assert_close(aggregate_loss(per_step, mask, "token"), torch.tensor(8.0 / 3.0))
    torch.testing.assert_close(aggregate_loss(per_step, mask, "sequence"), torch.tensor(3.0))  # (2 + 4) / 2


def test_k3_kl_is_zero_at_equality_and_positive_otherwise():
    lp = torch.tensor([-1.0, -2.0])
    torch.testing.assert_close(k3_kl(lp, lp), torch.zeros(2))
    d = torch.tensor(0.5)
    torch.testing.assert_close(k3_kl(torch.tensor([-1.0]), torch.tensor([-0.5])), (d.exp() - d - 1).reshape(1))


def test_grpo_learns_the_bandit(bandit):
    algo = GRPO(GRPOConfig(learning_rate=3e-3), bandit.OBS_DIM, bandit.ACT_DIM)
    gen = torch.Generator().manual_seed(0)
    mse0, rew0 = bandit.policy_mse(algo.policy), bandit.mean_reward(algo.policy)
    critic_before = [p.clone() for p in algo.policy.net.critic.parameters()]
    for _ in range(30):
        m = algo.update(bandit.rollout(algo.policy, 1, 256, gen, group_size=8))
    assert bandit.policy_mse(algo.policy) < 0.25 * mse0
    assert bandit.mean_reward(algo.policy) > rew0 + 0.4
    assert m["num_groups"] == 32
    for p, q in zip(critic_before, algo.policy.net.critic.parameters()):
        assert torch.equal(p, q)  # no critic training


def test_grpo_kl_to_reference_restrains_the_policy(bandit):
    def train(kl_coef):
        algo = GRPO(GRPOConfig(learning_rate=3e-3, kl_coef=kl_coef), bandit.OBS_DIM, bandit.ACT_DIM)
        gen = torch.Generator().manual_seed(0)
        for _ in range(15):
            m = algo.update(bandit.rollout(algo.policy, 1, 128, gen, group_size=8))
        return algo, m

    free, _ = train(0.0)
    tied, m = train(5.0)
    assert m["loss_kl"] > 0
    # log-std moves less from the reference's 0 when tied to it
    assert abs(tied.policy.net.actor_logstd.item()) < abs(free.policy.net.actor_logstd.item())
