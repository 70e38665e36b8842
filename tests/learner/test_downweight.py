"""Down-weighting end to end: the stream processor's ``sample_weight`` (and staleness fields)
through the codec and ``to_trajectory_batch`` into the learner's loss and gradient.

One fresh and one stale batch go through ``Prepare`` in ``downweight`` mode; the stale one's
weight must be the documented ``decay ** (versions - K) * decay ** ((ms - T) / T)``, arrive per
sample in the ``TrajectoryBatch`` and scale that batch's share of the gradient exactly."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from agents.agro import AGRO, AGROConfig
from agents.ppo import PPO, PPOConfig
from agents.tba import TBA, TBAConfig
from learner.batching import StreamIds, to_trajectory_batch
from schemas.codec import Codec
from schemas.events import PolicyVersion, PreparedBatch, SampleBatch
from config import PrepareConfig
from streams.processors.pipeline import Prepare

torch.set_num_threads(1)

OBS, ACT, T_STEPS, N_ENVS = 3, 1, 6, 2
K, T_MS, DECAY = 2, 10_000, 0.5
NOW = 5_000_000
LATEST = 5
STALE_VERSION, STALE_AGE = 2, 15_000  # 3 versions behind (1 past K), 5000 ms past T
CODEC = Codec()


def expected_weight(versions: int, ms: int) -> float:
    """The formula of ``streams.processors.staleness`` (module docstring), written out."""
    return DECAY ** (versions - K) * DECAY ** ((ms - T_MS) / T_MS)


def sample(actor: str, version: int, created: int, seed: int) -> SampleBatch:
    rng = np.random.default_rng(seed)
    term = rng.random((T_STEPS, N_ENVS)) < 0.2
    return SampleBatch(
        batch_id=f"{actor}-0", actor_id=actor, seq=0, env_id="Test-v0", policy_version=version, created_at_ms=created,
        obs=rng.standard_normal((T_STEPS, N_ENVS, OBS)).astype(np.float32),
        actions=rng.uniform(-1, 1, (T_STEPS, N_ENVS, ACT)).astype(np.float32),
        rewards=rng.standard_normal((T_STEPS, N_ENVS)).astype(np.float32), terminated=term,
        truncated=np.zeros((T_STEPS, N_ENVS), bool),
        behaviour_logp=rng.uniform(-1.5, -0.5, (T_STEPS, N_ENVS)).astype(np.float32),
        last_obs=rng.standard_normal((N_ENVS, OBS)).astype(np.float32),
        final_obs_index=np.zeros((0,), np.int64), final_obs=np.zeros((0, OBS), np.float32),
    )


@pytest.fixture(scope="module")
def prepared() -> tuple[PreparedBatch, PreparedBatch]:
    """(fresh, stale) PreparedBatches as the learner decodes them off the topic."""
    cfg = PrepareConfig.for_algo("agro", max_versions=K, max_ms=T_MS, decay=DECAY, min_weight=0.01,
                                 importance=False, policy_id="policy")
    assert cfg.staleness_mode == "downweight"  # AGRO's default: what this test is about
    prepare = Prepare.from_config(cfg, clock=lambda: NOW)
    for v in range(LATEST + 1):
        prepare.on_policy(PolicyVersion("policy", v, NOW - 60_000 + v, "L", "agro", weights=b"-"))
    out = prepare.push(sample("fresh", LATEST, NOW - 100, 1), 0, 0)
    out += prepare.push(sample("stale", STALE_VERSION, NOW - STALE_AGE, 2), 0, 1)
    assert all(isinstance(o, PreparedBatch) for o in out), out
    assert prepare.stats.downweighted_batches == 1
    fresh, stale = (CODEC.decode(CODEC.encode(o), PreparedBatch) for o in out)
    return fresh, stale


def test_stale_weight_is_the_documented_formula(prepared):
    fresh, stale = prepared
    assert (fresh.sample_weight, fresh.staleness_versions) == (1.0, 0)
    assert (stale.staleness_versions, stale.staleness_ms) == (LATEST - STALE_VERSION, STALE_AGE)
    w = expected_weight(LATEST - STALE_VERSION, STALE_AGE)
    assert w == pytest.approx(0.5 ** 1.5)
    assert stale.sample_weight == pytest.approx(w, rel=1e-12)


def test_trajectory_batch_carries_weight_and_staleness_per_sample(prepared):
    fresh, stale = prepared
    tb = to_trajectory_batch([fresh, stale], StreamIds())
    w = expected_weight(LATEST - STALE_VERSION, STALE_AGE)
    want_w = torch.tensor([1.0] * N_ENVS + [w] * N_ENVS).expand(T_STEPS, -1)
    torch.testing.assert_close(tb.sample_weight, want_w.float(), rtol=0, atol=1e-7)
    assert tb.staleness_tensor("staleness_versions")[:, N_ENVS:].eq(LATEST - STALE_VERSION).all()
    assert tb.staleness_tensor("staleness_versions")[:, :N_ENVS].eq(0).all()
    assert tb.staleness_tensor("staleness_ms")[:, N_ENVS:].eq(STALE_AGE).all()
    assert tb.staleness_tensor("staleness_ms")[:, :N_ENVS].eq(100).all()


def _ppo_grad(batches: list[PreparedBatch]) -> tuple[list[torch.Tensor], dict[str, float]]:
    """The raw gradient of one PPO step on ``batches`` (read back from Adam's first moment:
    after one step from zero state ``exp_avg = (1 - beta1) * grad``) and its metrics."""
    cfg = PPOConfig(update_epochs=1, num_minibatches=1, norm_adv=False, normalize_reward=False,
                    max_grad_norm=0.0, ent_coef=0.0, anneal_lr=False, hidden=(16,), seed=3)
    algo = PPO(cfg, OBS, ACT)
    m = algo.update(to_trajectory_batch(batches, StreamIds()))
    beta1 = algo.optimizer.param_groups[0]["betas"][0]
    grads = [algo.optimizer.state[p]["exp_avg"].clone() / (1.0 - beta1) for p in algo.policy.parameters()
             if p in algo.optimizer.state]
    return grads, m


def test_the_weight_reaches_the_loss_and_scales_the_gradient(prepared):
    fresh, stale = prepared
    w = stale.sample_weight
    unweighted = dataclasses.replace(stale, sample_weight=1.0)
    g_w, m_w = _ppo_grad([stale])
    g_1, m_1 = _ppo_grad([unweighted])
    # one stale batch alone: its losses and gradient are w times those at weight 1
    assert m_w["loss_policy"] == pytest.approx(w * m_1["loss_policy"], rel=1e-5)
    assert m_w["loss_value"] == pytest.approx(w * m_1["loss_value"], rel=1e-5)
    assert m_w["grad_norm"] == pytest.approx(w * m_1["grad_norm"], rel=1e-5)
    for a, b in zip(g_w, g_1):
        torch.testing.assert_close(a, w * b, rtol=1e-5, atol=1e-7)
    # mixed with a fresh batch: each sample's gradient counts with its own weight
    g_f, _ = _ppo_grad([fresh])
    g_mix, _ = _ppo_grad([fresh, stale])
    assert len(g_mix) == len(g_f) > 0
    for mix, gf, gs in zip(g_mix, g_f, g_1):
        torch.testing.assert_close(mix, (gf + w * gs) / 2, rtol=1e-5, atol=1e-7)


def test_agro_default_turns_the_weight_into_a_smaller_step(prepared):
    """AGRO's ``decay_lr``: Adam would divide a uniform loss scale away, so the step's learning
    rate is the base rate times the batch's mean weight."""
    fresh, stale = prepared
    w = stale.sample_weight
    cfg = AGROConfig(update_epochs=1, num_minibatches=1, hidden=(16,), learning_rate=1e-3)
    m_stale = AGRO(cfg, OBS, ACT).update(to_trajectory_batch([stale], StreamIds()))
    assert m_stale["weight_mean"] == pytest.approx(w, rel=1e-6)
    assert m_stale["learning_rate"] == pytest.approx(1e-3 * w, rel=1e-6)
    m_mix = AGRO(cfg, OBS, ACT).update(to_trajectory_batch([fresh, stale], StreamIds()))
    assert m_mix["learning_rate"] == pytest.approx(1e-3 * (1 + w) / 2, rel=1e-6)


def test_tba_decays_by_the_carried_staleness_times_the_weight(prepared):
    """TBA's own schedule reads ``staleness_versions`` / ``staleness_ms`` from the batch and
    multiplies the processor's ``sample_weight`` in."""
    _, stale = prepared
    cfg = TBAConfig(update_epochs=1, num_minibatches=1, hidden=(16,), learning_rate=1e-3,
                    version_decay=0.8, half_life_ms=30_000.0)
    m = TBA(cfg, OBS, ACT).update(to_trajectory_batch([stale], StreamIds()))
    own = 0.8 ** (LATEST - STALE_VERSION) * 0.5 ** (STALE_AGE / 30_000)
    assert m["weight_mean"] == pytest.approx(own * stale.sample_weight, rel=1e-5)
    assert m["learning_rate"] == pytest.approx(1e-3 * own * stale.sample_weight, rel=1e-5)
