import copy

import torch

from agents.core import TrajectoryBatch
from agents.dapo import DAPO, DAPOConfig, dynamic_sampling_mask, overlong_penalty, unfinished_rollouts
from agents.ppo.losses import clipped_surrogate


def test_clip_higher_is_asymmetric():
    ratio = torch.tensor([1.25, 1.3, 0.75])
    adv = torch.tensor([1.0, 1.0, -1.0])
    # [1.25 < 1.28 unclipped -> -1.25; 1.3 clipped at 1.28 -> -1.28; A<0, 0.75 clipped up to 0.8 -> 0.8]
    torch.testing.assert_close(clipped_surrogate(ratio, adv, 0.2, 0.28), torch.tensor([-1.25, -1.28, 0.8]))
    # symmetric 0.2 would have clipped the first one too
    torch.testing.assert_close(clipped_surrogate(ratio, adv, 0.2), torch.tensor([-1.2, -1.2, 0.8]))


def test_dynamic_sampling_drops_zero_variance_groups():
    R = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 5.0])
    gid = torch.tensor([0, 0, 0, 1, 1, 2])  # group 1 identical, group 2 singleton
    keep, dropped, total = dynamic_sampling_mask(R, gid, 1e-8)
    assert keep.tolist() == [True, True, True, False, False, False]
    assert (dropped, total) == (2, 3)


def _group_batch(rewards, group_id, obs_dim=2):
    N = len(rewards)
    g = torch.Generator().manual_seed(0)
    obs = torch.randn(1, N, obs_dim, generator=g)
    return TrajectoryBatch(
        obs=obs, actions=torch.randn(1, N, 1, generator=g), rewards=torch.tensor([rewards]),
        terminated=torch.ones(1, N, dtype=torch.bool), truncated=torch.zeros(1, N, dtype=torch.bool),
        behaviour_logp=torch.full((1, N), -1.0), group_id=torch.tensor(group_id),
    )


def test_dapo_update_reports_drops_and_skips_when_everything_is_dropped():
    algo = DAPO(DAPOConfig(), 2, 1)
    m = algo.update(_group_batch([1.0, 2.0, 3.0, 10.0, 10.0], [0, 0, 0, 1, 1]))
    assert (m["groups_total"], m["groups_dropped"], m["groups_kept"], m["columns_used"]) == (2, 1, 1, 3)
    assert m["skipped"] == 0.0
    before = copy.deepcopy(algo.policy.state_dict())
    m = algo.update(_group_batch([4.0, 4.0, 7.0, 7.0], [0, 0, 1, 1]))
    assert m["skipped"] == 1.0 and m["groups_dropped"] == 2 and m["columns_used"] == 0
    for k, v in algo.policy.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_overlong_penalty_and_unfinished_rollouts():
    pen = overlong_penalty(torch.tensor([5, 6, 8, 9, 10, 11]), max_length=10, cache=4)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.5, -0.75, -1.0, -1.0]))
    term = torch.tensor([[False, False, False], [True, False, False], [False, True, False]])
    mask = torch.tensor([[True, True, True], [True, True, True], [False, True, True]])
    # col 0 terminated at its last valid step; col 1 ends with a termination; col 2 is cut off
    assert unfinished_rollouts(term, mask).tolist() == [False, False, True]


def test_truncation_mask_mode_excludes_unfinished_rollouts():
    T, N = 3, 4
    term = torch.zeros(T, N, dtype=torch.bool)
    term[1, 0] = term[2, 1] = True  # cols 0, 1 finish; cols 2, 3 are cut by the horizon
    batch = TrajectoryBatch(
        obs=torch.randn(T, N, 2), actions=torch.randn(T, N, 1), rewards=torch.tensor([[1.0, 0.0, 5.0, 9.0]] * T),
        terminated=term, truncated=torch.zeros(T, N, dtype=torch.bool), behaviour_logp=torch.full((T, N), -1.0),
        group_id=torch.zeros(N, dtype=torch.int64),
    )
    m = DAPO(DAPOConfig(truncation_mode="mask"), 2, 1).update(batch)
    assert m["rollouts_masked"] == 2 and m["columns_used"] == 2
    m = DAPO(DAPOConfig(truncation_mode="none"), 2, 1).update(batch)
    assert m["rollouts_masked"] == 0 and m["columns_used"] == 4
    m = DAPO(DAPOConfig(truncation_mode="soft_penalty", overlong_cache=1), 2, 1).update(batch)
    # lengths [2, 3, 3, 3] with L_max = T = 3, cache 1: [0, -1, -1, -1]
    assert abs(m["overlong_penalty_mean"] + 0.75) < 1e-6


def test_dapo_learns_the_bandit(bandit):
    algo = DAPO(DAPOConfig(learning_rate=3e-3), bandit.OBS_DIM, bandit.ACT_DIM)
    gen = torch.Generator().manual_seed(0)
    mse0, rew0 = bandit.policy_mse(algo.policy), bandit.mean_reward(algo.policy)
    for _ in range(30):
        algo.update(bandit.rollout(algo.policy, 1, 256, gen, group_size=8))
    assert bandit.policy_mse(algo.policy) < 0.25 * mse0
    assert bandit.mean_reward(algo.policy) > rew0 + 0.4
