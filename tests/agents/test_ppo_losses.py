import math

import pytest
import torch

from agents.ppo.learning import bootstrap_values
from agents.ppo.losses import clipped_surrogate, compute_gae, policy_loss, value_loss
from agents.core import TrajectoryBatch
from agents.networks import Policy


def test_gae_three_steps_with_truncation_and_termination():
    # column 0: step 1 truncated (true final obs value 4.0), step 2 terminated.
    # column 1: no episode end; bootstrap from last_value = 10.
    gamma, lam = 0.9, 0.8
    rewards = torch.tensor([[1.0, 1.0], [2.0, 1.0], [3.0, 1.0]])
    values = torch.tensor([[0.5, 0.0], [1.0, 0.0], [1.5, 0.0]])
    terminated = torch.tensor([[False, False], [False, False], [True, False]])
    truncated = torch.tensor([[False, False], [True, False], [False, False]])
    last_value = torch.tensor([2.0, 10.0])
    final_values = torch.tensor([[99.0, 99.0], [4.0, 99.0], [99.0, 99.0]])  # only [1, 0] is valid
    adv, ret = compute_gae(rewards, values, terminated, truncated, last_value, final_values, gamma, lam)
    # by hand, column 0:
    #   t=2 terminated: delta = 3 - 1.5 = 1.5                  A2 = 1.5
    #   t=1 truncated:  delta = 2 + 0.9 * 4.0 - 1.0 = 4.6      A1 = 4.6 (trace cut)
    #   t=0:            delta = 1 + 0.9 * 1.0 - 0.5 = 1.4      A0 = 1.4 + 0.72 * 4.6 = 4.712
    # column 1:
    #   t=2: delta = 1 + 0.9 * 10 = 10                         A2 = 10
    #   t=1: delta = 1                                         A1 = 1 + 0.72 * 10 = 8.2
    #   t=0: delta = 1                                         A0 = 1 + 0.72 * 8.2 = 6.904
    expected = torch.tensor([[4.712, 6.904], [4.6, 8.2], [1.5, 10.0]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected + values)


def test_gae_without_final_values_treats_truncation_as_termination():
    rewards = torch.tensor([[1.0], [2.0], [3.0]])
    values = torch.tensor([[0.5], [1.0], [1.5]])
    terminated = torch.tensor([[False], [False], [True]])
    truncated = torch.tensor([[False], [True], [False]])
    adv, _ = compute_gae(rewards, values, terminated, truncated, torch.tensor([2.0]), None, 0.9, 0.8)
    # t=1: delta = 2 - 1 = 1; t=0: 1.4 + 0.72 * 1 = 2.12
    torch.testing.assert_close(adv[:, 0], torch.tensor([2.12, 1.0, 1.5]))


def test_clipped_surrogate_known_ratios():
    ratio = torch.tensor([1.5, 0.5, 1.1])
    adv = torch.tensor([1.0, 1.0, -1.0])
    # max(-A r, -A clip(r, .8, 1.2)): [max(-1.5, -1.2), max(-0.5, -0.8), max(1.1, 1.1)] = [-1.2, -0.5, 1.1]
    torch.testing.assert_close(clipped_surrogate(ratio, adv, 0.2), torch.tensor([-1.2, -0.5, 1.1]))
    logp = torch.log(ratio).requires_grad_()
    out = policy_loss(logp, torch.zeros(3), adv, 0.2)
    torch.testing.assert_close(out["loss_policy"], torch.tensor(-0.2))
    torch.testing.assert_close(out["clipfrac"], torch.tensor(2.0 / 3.0))
    kl = sum((r - 1) - math.log(r) for r in (1.5, 0.5, 1.1)) / 3  # 0.0974573
    torch.testing.assert_close(out["approx_kl"], torch.tensor(kl))
    out["loss_policy"].backward()
    # d/dlogp of -A r / 3 where unclipped; zero where the clipped branch is active
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, -0.5 / 3, 1.1 / 3]))


def test_value_loss_clipping():
    new, old, ret = torch.tensor([2.0, 1.1]), torch.tensor([1.0, 1.0]), torch.tensor([3.0, 1.0])
    # sample 0: unclipped (2-3)^2 = 1, clipped (1.2-3)^2 = 3.24 -> 3.24; sample 1: both 0.01 -> 0.01
    torch.testing.assert_close(value_loss(new, old, ret, 0.2), torch.tensor(0.5 * (3.24 + 0.01) / 2))
    torch.testing.assert_close(value_loss(new, old, ret, None), torch.tensor(0.5 * (1.0 + 0.01) / 2))


def _trunc_batch(with_final=True):
    T, N, D = 3, 2, 4
    g = torch.Generator().manual_seed(0)
    obs = torch.randn(T, N, D, generator=g)
    trunc = torch.zeros(T, N, dtype=torch.bool)
    trunc[1, 0] = True
    return TrajectoryBatch(
        obs=obs, actions=torch.zeros(T, N, 1), rewards=torch.zeros(T, N), terminated=torch.zeros(T, N, dtype=torch.bool),
        truncated=trunc, behaviour_logp=torch.zeros(T, N), last_obs=torch.randn(N, D, generator=g),
        next_obs_final=torch.randn(T, N, D, generator=g) if with_final else None,
    )


def test_bootstrap_values_uses_final_obs_not_reset_obs():
    pol = Policy(4, 1)
    b = _trunc_batch()
    values, last_value, final_values = bootstrap_values(pol, b, True)
    with torch.no_grad():
        torch.testing.assert_close(final_values[1, 0], pol.value(b.next_obs_final[1, 0]))
        assert not torch.allclose(final_values[1, 0], pol.value(b.obs[2, 0]))
        torch.testing.assert_close(last_value, pol.value(b.last_obs))
        torch.testing.assert_close(values, pol.value(b.obs))
    assert float(final_values[0, 0]) == 0.0
    with pytest.raises(ValueError, match="next_obs_final"):
        bootstrap_values(pol, _trunc_batch(with_final=False), True)
    assert bootstrap_values(pol, _trunc_batch(with_final=False), False)[2] is None
