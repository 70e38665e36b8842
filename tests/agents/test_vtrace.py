"""V-trace targets and the shared importance-weight rule, against hand-computed values."""

import math

import pytest
import torch

from agents.ppo.losses import compute_gae
from agents.vtrace import VTraceConfig, behaviour_weights, importance_weights, vtrace
from streams.processors.importance import ImportanceWeights
from streams.processors.pipeline import PrepareConfig


def test_vtrace_by_hand_with_truncation_termination_and_truncated_weights():
    # steps: 0 running, 1 truncated (bootstrap V(final obs) = 4), 2 running, 3 terminated
    r = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    V = torch.tensor([[0.5], [1.0], [1.5], [2.0]])
    term = torch.tensor([[False], [False], [False], [True]])
    trunc = torch.tensor([[False], [True], [False], [False]])
    final = torch.tensor([[0.0], [4.0], [0.0], [0.0]])
    rho = torch.tensor([[0.5], [1.0], [0.8], [1.0]])
    c = torch.tensor([[0.6], [1.0], [0.3], [1.0]])
    vs, adv = vtrace(r, V, term, trunc, torch.tensor([7.0]), final, rho, c, gamma=0.9, lam=1.0)
    # step 3: delta = 4 - 2 = 2; vs - V = 1 * 2
    # step 2: delta = 3 + .9 * 2 - 1.5 = 3.3; vs - V = .8 * 3.3 + .9 * .3 * 2 = 3.18; A = 3.3 + .9 * 2 = 5.1
    # step 1: delta = 2 + .9 * 4 - 1 = 4.6 (no trace across the cut); A = 4.6
    # step 0: delta = 1 + .9 * 1 - .5 = 1.4; vs - V = .5 * 1.4 + .9 * .6 * 4.6 = 3.184; A = 1.4 + .9 * 4.6 = 5.54
    torch.testing.assert_close(vs, torch.tensor([[3.684], [5.6], [4.68], [4.0]]))
    torch.testing.assert_close(adv, torch.tensor([[5.54], [4.6], [5.1], [2.0]]))


@pytest.mark.parametrize("lam", [1.0, 0.95])
def test_vtrace_on_policy_is_gae(lam):
    g = torch.Generator().manual_seed(3)
    T, N = 9, 4
    r, V = torch.randn(T, N, generator=g), torch.randn(T, N, generator=g)
    done = torch.rand(T, N, generator=g)
    term, trunc = done < 0.15, (done > 0.85)
    final, last = torch.randn(T, N, generator=g), torch.randn(N, generator=g)
    ones = torch.ones(T, N)
    vs, adv = vtrace(r, V, term, trunc, last, final, ones, ones, 0.99, lam)
    gae_adv, gae_ret = compute_gae(r, V, term, trunc, last, final, 0.99, lam)
    torch.testing.assert_close(vs, gae_ret)
    torch.testing.assert_close(adv, gae_adv)


def test_vtrace_on_policy_without_episode_ends_is_the_n_step_return():
    r = torch.tensor([[1.0], [2.0], [3.0]])
    V = torch.tensor([[9.0], [8.0], [7.0]])
    no = torch.zeros(3, 1, dtype=torch.bool)
    ones = torch.ones(3, 1)
    vs, _ = vtrace(r, V, no, no, torch.tensor([10.0]), None, ones, ones, gamma=0.5)
    assert vs[0, 0].item() == pytest.approx(1 + 0.5 * 2 + 0.25 * 3 + 0.125 * 10)


def test_one_cap_rule_drops_above_the_cap_and_truncates_below():
    lr = torch.tensor([math.log(0.5), math.log(2.0), math.log(10.0), float("nan"), math.log(4.0)])
    rho, c, capped, nonfinite = importance_weights(lr, rho_bar=1.0, c_bar=0.5, behaviour_cap=5.0)
    torch.testing.assert_close(rho, torch.tensor([0.5, 1.0, 0.0, 0.0, 1.0]))
    torch.testing.assert_close(c, torch.tensor([0.5, 0.5, 0.0, 0.0, 0.5]))
    assert capped.tolist() == [False, False, True, False, False]
    assert nonfinite.tolist() == [False, False, False, True, False]


def test_stream_processor_and_learner_share_the_rule_and_its_defaults():
    prep, algo = PrepareConfig(), VTraceConfig()
    assert (prep.rho_bar, prep.c_bar, prep.behaviour_cap) == (algo.rho_bar, algo.c_bar, algo.behaviour_cap)
    g = torch.Generator().manual_seed(0)
    behaviour, current = torch.randn(5, 3, generator=g) * 2, torch.randn(5, 3, generator=g) * 2
    res = ImportanceWeights(prep.rho_bar, prep.c_bar, prep.behaviour_cap).from_logps(behaviour.numpy(), current.numpy())
    rho, c, capped, _ = importance_weights((current - behaviour).double(), algo.rho_bar, algo.c_bar, algo.behaviour_cap)
    torch.testing.assert_close(torch.from_numpy(res.rho), rho.float())
    torch.testing.assert_close(torch.from_numpy(res.c), c.float())
    assert res.capped == int(capped.sum()) > 0


def test_behaviour_weights_follow_the_config_and_turn_off_for_the_ablation():
    lr = torch.tensor([math.log(0.5), math.log(10.0)])
    rho, c, capped = behaviour_weights(VTraceConfig(), lr)
    assert rho.tolist() == pytest.approx([0.5, 0.0]) and capped.tolist() == [False, True]
    rho, c, capped = behaviour_weights(VTraceConfig(vtrace=False), lr)
    assert rho.tolist() == [1.0, 1.0] and c.tolist() == [1.0, 1.0] and not capped.any()
