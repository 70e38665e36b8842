"""The captured update (``agents.capture``, ``BaseAlgorithm.enable_capture``): every algorithm's
update equals its eager update within float tolerance (the eager one is held to the hand-written
oracles; tests/agents/test_ppo_reference.py runs PPO's oracle on both paths), a new shape compiles
once and is counted, past the cap it runs eagerly and is counted, and state moves between paths.

The fast tests compile with torch.compile's "eager" backend (the same tracing, graph breaks and
traceable Adam with a tensor rate; no code generation); the slow ones with inductor, as a run does."""

from __future__ import annotations

import copy

import pytest
import torch

from agents.agro import AGRO, AGROConfig
from agents.capture import CapturedStep, CaptureStats, pays_to_capture
from agents.dapo import DAPO, DAPOConfig
from agents.grpo import GRPO, GRPOConfig
from agents.ppo import PPO, PPOConfig
from agents.tba import TBA, TBAConfig

SMALL = dict(hidden=(8, 8), update_epochs=2, num_minibatches=2, seed=3)
CASES = {
    "ppo": (PPO, PPOConfig, dict(SMALL, total_updates=4), None),
    "vtrace-ppo": (PPO, PPOConfig, dict(SMALL, decoupled=True, total_updates=4), None),
    "agro": (AGRO, AGROConfig, dict(SMALL, ent_coef=0.01), None),
    "grpo": (GRPO, GRPOConfig, dict(SMALL, kl_coef=0.05), 4),
    "dapo": (DAPO, DAPOConfig, SMALL, 4),
    "tba": (TBA, TBAConfig, SMALL, None),
    "tba-tb": (TBA, TBAConfig, dict(SMALL, objective="tb", tb_logz="learned", ref_update_interval=0), 4),
}


def params(algo) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in algo.policy.parameters()])


def pair(case: str, backend: str):
    cls, cfg_cls, cfg, group = CASES[case]
    eager, captured = cls(cfg_cls(**cfg), 2, 1), cls(cfg_cls(**cfg), 2, 1)
    captured.enable_capture(backend=backend)
    return eager, captured, group


def batches(algo, bandit, group, n=2):
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        if group:
            b = bandit.rollout(algo.policy, 1, 16, gen, group_size=group)
        else:
            b = bandit.rollout(algo.policy, 8, 4, gen)
        out.append(b)
    return out


def check_equal(case, backend, bandit):
    eager, captured, group = pair(case, backend)
    for b in batches(eager, bandit, group):
        want, got = eager.update(b), captured.update(b)
        assert set(got) == set(want)
        for k, v in want.items():
            assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    torch.testing.assert_close(params(captured), params(eager), rtol=1e-5, atol=1e-6)
    assert params(captured).ne(params(cls_fresh(case))).any()  # the updates moved the policy
    stats = captured.capture
    assert stats.captured_steps > 0 and stats.eager_steps == 0 and 1 <= stats.compiles <= 2
    return captured


def cls_fresh(case):
    cls, cfg_cls, cfg, _ = CASES[case]
    return cls(cfg_cls(**cfg), 2, 1)


@pytest.mark.parametrize("case", sorted(CASES))
def test_captured_update_equals_the_eager_one(case, bandit):
    check_equal(case, "eager", bandit)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["agro", "grpo", "tba-tb"])
def test_captured_update_equals_the_eager_one_compiled_by_inductor(case, bandit):
    check_equal(case, "inductor", bandit)


def test_each_new_shape_compiles_once_and_past_the_cap_runs_eagerly_counted():
    stats = CaptureStats()
    step = CapturedStep(lambda x: (x * 2).sum(), stats, max_shapes=2, backend="eager")
    for n in (4, 4, 5, 4, 5, 6, 6):
        assert float(step(torch.ones(n))) == 2 * n
    assert (stats.compiles, stats.captured_steps, stats.eager_steps) == (2, 5, 2)
    assert stats.compile_s > 0


def test_a_ragged_last_minibatch_is_one_more_graph_not_one_per_step(bandit):
    """30 samples in 4 minibatches: chunks of 7, 7, 7, 7 and 2 -- two shapes, whatever the epochs."""
    algo = PPO(PPOConfig(hidden=(8, 8), update_epochs=3, num_minibatches=4), 2, 1)
    algo.enable_capture(backend="eager")
    b = bandit.rollout(algo.policy, 10, 3, torch.Generator().manual_seed(1))
    algo.update(b)
    algo.update(b)
    assert (algo.capture.compiles, algo.capture.captured_steps, algo.capture.eager_steps) == (2, 30, 0)
    capped = PPO(PPOConfig(hidden=(8, 8), update_epochs=3, num_minibatches=4), 2, 1)
    capped.enable_capture(max_shapes=1, backend="eager")
    capped.update(b)
    assert (capped.capture.compiles, capped.capture.eager_steps) == (1, 3)  # the 2-sample chunk, counted


def test_state_moves_between_the_paths_with_float_rates(bandit):
    eager, captured, _ = pair("ppo", "eager")
    b = batches(eager, bandit, None, 1)[0]
    captured.update(b)
    state = captured.state_dict()  # (live tensors: each load below gets its own copy, as from a snapshot)
    assert all(isinstance(g["lr"], float) for g in state["optimizer"]["param_groups"])
    eager.load_state_dict(copy.deepcopy(state))
    assert eager.optimizer.param_groups[0]["fused"] is True  # an eager learner keeps its fused Adam
    again = cls_fresh("ppo")
    again.enable_capture(backend="eager")
    again.load_state_dict(copy.deepcopy(state))
    rate = again.optimizer.param_groups[0]["lr"]
    assert isinstance(rate, torch.Tensor) and float(rate) == pytest.approx(captured.learning_rate)
    again.set_learning_rate(1e-4)
    assert again.optimizer.param_groups[0]["lr"] is rate and float(rate) == pytest.approx(1e-4)
    want, got = eager.update(b), again.update(b)
    assert got["loss_total"] == pytest.approx(want["loss_total"], rel=1e-5)


def test_auto_captures_long_single_rank_runs_of_the_measured_algorithms():
    assert pays_to_capture("ppo", "cpu", 156_160)  # CleanRL's 1M steps: 488 updates x 320 steps
    assert not pays_to_capture("ppo", "cpu", 3_200)  # a short run: the compile would not pay
    assert not pays_to_capture("agro", "cpu", 488 * 32)  # AGRO's 32 steps an update: 1M steps do not pay
    assert not pays_to_capture("ppo", "cpu", 156_160, ranks=2)
    assert not pays_to_capture("grpo", "cpu", 156_160)


def test_a_compile_that_fails_runs_the_same_update_eagerly_and_says_so():
    """No C++ compiler, or an op the compiler refuses: warned once, counted, and the update is the
    eager one (the failed graph never ran), then and on every later step."""
    import warnings

    import torch

    from agents.capture import CapturedStep, CaptureStats

    def failing_backend(gm, example_inputs):
        raise RuntimeError("no working C++ compiler found")

    def make():
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)

        def body(x):
            opt.zero_grad(set_to_none=True)
            loss = lin(x).pow(2).mean()
            loss.backward()
            opt.step()
            return loss.detach()
        return lin, body

    x = torch.randn(8, 4)
    lin_e, body_e = make()
    for _ in range(3):
        body_e(x)
    lin_c, body_c = make()
    stats = CaptureStats()
    step = CapturedStep(body_c, stats, backend=failing_backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            step(x)
    assert [str(w.message) for w in caught if "could not be compiled" in str(w.message)] != []
    assert len([w for w in caught if "could not be compiled" in str(w.message)]) == 1
    assert (stats.compile_failures, stats.eager_steps, stats.captured_steps, stats.compiles) == (1, 3, 0, 0)
    assert torch.equal(lin_c.weight, lin_e.weight) and torch.equal(lin_c.bias, lin_e.bias)
