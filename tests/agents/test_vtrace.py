"""V-trace targets and the shared importance-weight rule, against hand-computed values."""

import math

import pytest
import torch

from agents.ppo.losses import compute_gae
from agents.scan import discounted_scan
from agents.vtrace import VTraceConfig, behaviour_weights, importance_weights, vtrace
from streams.processors.importance import ImportanceWeights
from config import PrepareConfig


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


# ---- the log-depth scan against a plain sequential loop ------------------------------------------

def sequential_vtrace(r, V, term, trunc, last, final, rho, c, gamma, lam):
    """The docstring's recurrence step by step, in Python floats (float64): ``(vs, advantages)``."""
    r, V, term, trunc, rho, c = (x.double().tolist() for x in (r, V, term, trunc, rho, c))
    last = last.double().tolist()
    final = final.double().tolist() if final is not None else None
    T, N = len(r), len(r[0])
    vs = [[0.0] * N for _ in range(T)]
    adv = [[0.0] * N for _ in range(T)]
    for n in range(N):
        nxt = 0.0  # vs_{t+1} - V_{t+1}
        for t in reversed(range(T)):
            if term[t][n]:
                v_next = 0.0
            elif trunc[t][n]:
                v_next = final[t][n] if final is not None else 0.0
            else:
                v_next = last[n] if t == T - 1 else V[t + 1][n]
            delta = r[t][n] + gamma * v_next - V[t][n]
            k = 0.0 if (term[t][n] or trunc[t][n]) else gamma * lam
            adv[t][n] = delta + k * nxt
            nxt = rho[t][n] * delta + k * c[t][n] * nxt
            vs[t][n] = V[t][n] + nxt
    return torch.tensor(vs, dtype=torch.float64), torch.tensor(adv, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("discount", ["below_one", "one"])
@pytest.mark.parametrize("weights", ["truncated", "ones"])
@pytest.mark.parametrize("N", [1, 3])
@pytest.mark.parametrize("T", [1, 2, 7, 64, 2048])
def test_vtrace_matches_the_sequential_recurrence(T, N, weights, discount, dtype):
    g = torch.Generator().manual_seed(1000 * T + N)
    r, V = torch.randn(T, N, generator=g, dtype=dtype), torch.randn(T, N, generator=g, dtype=dtype)
    last, final = torch.randn(N, generator=g, dtype=dtype), torch.randn(T, N, generator=g, dtype=dtype) * 3
    # column 0: frequent ends (both flags at once too); the others: rare ones, so traces span hundreds of steps
    p = torch.full((1, N), 0.002)
    p[0, 0] = 0.2
    term, trunc = torch.rand(T, N, generator=g) < p, torch.rand(T, N, generator=g) < p
    if T == 7:
        term[:, 0] = torch.tensor([False, True, False, True, False, False, False])
        trunc[:, 0] = torch.tensor([False, False, True, True, False, True, False])
    if weights == "ones":
        rho = c = torch.ones(T, N, dtype=dtype)
    else:  # independent rho and c in [0, 1), some dropped
        keep = (torch.rand(T, N, generator=g) > 0.05).to(dtype)
        rho, c = torch.rand(T, N, generator=g, dtype=dtype) * keep, torch.rand(T, N, generator=g, dtype=dtype) * keep
    gamma, lam = (0.99, 0.95) if discount == "below_one" else (1.0, 1.0)
    for fv in (final, None):
        ref_vs, ref_adv = sequential_vtrace(r, V, term, trunc, last, fv, rho, c, gamma, lam)
        _, plain_adv = sequential_vtrace(r, V, term, trunc, last, fv, torch.ones_like(rho), torch.ones_like(c), gamma, lam)
        vs, adv = vtrace(r, V, term, trunc, last, fv, rho, c, gamma, lam)
        vs2, adv2, plain = vtrace(r, V, term, trunc, last, fv, rho, c, gamma, lam, uncorrected=True)
        assert vs.dtype == adv.dtype == plain.dtype == dtype and vs.shape == adv.shape == plain.shape == (T, N)
        checks = [(vs, ref_vs), (adv, ref_adv), (vs2, ref_vs), (adv2, ref_adv), (plain, plain_adv)]
        if weights == "ones":  # GAE runs the same scan
            gae_adv, gae_ret = compute_gae(r, V, term, trunc, last, fv, gamma, lam)
            checks += [(gae_adv, ref_adv), (gae_ret, ref_vs)]
        for got, want in checks:
            # float32: at most 7.6e-6 here (T = 2048, undiscounted); a 2,048-step trace with no end at
            # all reaches |x| ~ 100, where float32's spacing is 7.6e-6, and misses 1e-5 (the loop by more)
            tol = 1e-10 if dtype == torch.float64 else 1e-5
            assert float((got.double() - want).abs().max()) <= tol


def test_discounted_scan_any_trailing_shape():
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(37, 2, 3, generator=g, dtype=torch.float64), torch.rand(37, 2, 3, generator=g, dtype=torch.float64)
    want, x = torch.empty_like(a), torch.zeros_like(a[0])
    for t in reversed(range(37)):
        x = a[t] + b[t] * x
        want[t] = x
    torch.testing.assert_close(discounted_scan(a, b), want, rtol=0, atol=1e-12)
    assert discounted_scan(a[:0], b[:0]).shape == (0, 2, 3)
