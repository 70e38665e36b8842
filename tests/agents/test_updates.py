"""Update-level tests: each algorithm's real ``update()`` on a crafted batch (T > 1, truncated and
terminated steps, known importance ratios), asserting the terms a wrong update would get wrong:
truncation bootstrapping, the decoupled behaviour weight and its anchor, the GRPO/DAPO clips,
the KL direction, the DPO preference direction. One epoch and one minibatch, so the reported
loss terms are those of the batch at the policy the update started from."""

import dataclasses
import math

import pytest
import torch

from agents.agro import AGRO, AGROConfig
from agents.core import TrajectoryBatch
from agents.dapo import DAPO, DAPOConfig
from agents.dpo import DPO, DPOConfig, PreferenceBatch, segment_log_prob
from agents.grpo import GRPO, GRPOConfig
from agents.ppo import PPO, PPOConfig
from streams.processors.importance import ImportanceWeights
from config import PrepareConfig

OBS, ACT = 2, 1
GAMMA, LAM = 0.9, 0.5
ONE_STEP = dict(update_epochs=1, num_minibatches=1, normalize_obs=False)
# steps: 0 running, 1 truncated (bootstrap from next_obs_final), 2 terminated, 3 running (bootstrap from last_obs)
TERM = torch.tensor([[False], [False], [True], [False]])
TRUNC = torch.tensor([[False], [True], [False], [False]])
REWARDS = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
RATIOS = torch.tensor([[2.0], [0.5], [10.0], [0.25]])  # pi / mu; 10 is above the default cap 5


def params(algo) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in algo.policy.parameters()])


def four_step_batch(policy, ratios=None, values=None, rewards=REWARDS) -> TrajectoryBatch:
    g = torch.Generator().manual_seed(11)
    obs = torch.randn(4, 1, OBS, generator=g)
    act = torch.randn(4, 1, ACT, generator=g)
    with torch.no_grad():
        logp = policy.log_prob(obs, act)
    blogp = logp if ratios is None else logp - ratios.log()
    return TrajectoryBatch(
        obs=obs, actions=act, rewards=rewards, terminated=TERM, truncated=TRUNC, behaviour_logp=blogp,
        values=values, last_obs=torch.randn(1, OBS, generator=g), next_obs_final=torch.randn(4, 1, OBS, generator=g) * 3,
    )


def hand_vtrace(r, V, Vf, VL, rho):
    """The 4-step pattern above by hand (c = rho, lam = LAM): ``(vs, advantages)`` as lists."""
    d3 = r[3] + GAMMA * VL - V[3]
    d2 = r[2] - V[2]
    d1 = r[1] + GAMMA * Vf - V[1]
    d0 = r[0] + GAMMA * V[1] - V[0]
    corr1 = rho[1] * d1
    corr0 = rho[0] * d0 + GAMMA * LAM * rho[0] * corr1
    vs = [V[0] + corr0, V[1] + corr1, V[2] + rho[2] * d2, V[3] + rho[3] * d3]
    adv = [d0 + GAMMA * LAM * corr1, d1, d2, d3]
    return vs, adv


def critic_values(policy, batch):
    with torch.no_grad():
        V = policy.value(batch.obs)[:, 0].tolist()
        Vf = float(policy.value(batch.next_obs_final[1, 0]))
        VL = float(policy.value(batch.last_obs[0]))
    return V, Vf, VL


# ---- PPO ------------------------------------------------------------------------------------------

def test_ppo_update_bootstraps_truncation_from_the_final_obs():
    algo = PPO(PPOConfig(gamma=GAMMA, gae_lambda=LAM, normalize_reward=False, anneal_lr=False, **ONE_STEP), OBS, ACT)
    V = [1.0, 2.0, 3.0, -1.0]
    batch = four_step_batch(algo.policy, values=torch.tensor(V).reshape(4, 1))
    _, Vf, VL = critic_values(algo.policy, batch)
    assert abs(Vf - V[2]) > 0.05  # bootstrapping from the reset obs's value would be visible
    vs, adv = hand_vtrace(REWARDS[:, 0].tolist(), V, Vf, VL, [1.0] * 4)
    m = algo.update(batch)
    assert m["return_mean"] == pytest.approx(sum(vs) / 4, abs=1e-5)
    assert m["adv_mean"] == pytest.approx(sum(adv) / 4, abs=1e-5)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-6)


def test_decoupled_ppo_anchors_the_clip_at_pi_prox_and_weights_by_pi_prox_over_mu():
    cfg = PPOConfig(decoupled=True, gamma=GAMMA, gae_lambda=LAM, normalize_reward=False, anneal_lr=False, norm_adv=False, **ONE_STEP)
    algo = PPO(cfg, OBS, ACT)
    batch = four_step_batch(algo.policy, RATIOS, values=torch.full((4, 1), 100.0))  # stale values: ignored
    V, Vf, VL = critic_values(algo.policy, batch)
    rho = [1.0, 0.5, 0.0, 0.25]  # min(1, ratio), 10 > cap 5 dropped
    vs, _ = hand_vtrace(REWARDS[:, 0].tolist(), V, Vf, VL, rho)
    m = algo.update(batch)
    assert m["behaviour_weight_mean"] == pytest.approx(sum(rho) / 4)
    assert m["behaviour_dropped"] == 1.0
    assert m["return_mean"] == pytest.approx(sum(vs) / 4, abs=1e-5)
    # the clip is anchored at pi_prox: the first (only) minibatch starts at ratio exactly 1
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and m["clipfrac"] == 0.0
    # the stream processor computes the same weights for the same pair of policies
    prep = PrepareConfig()
    res = ImportanceWeights(prep.rho_bar, prep.c_bar, prep.behaviour_cap).from_logps(
        batch.behaviour_logp.numpy(), (batch.behaviour_logp + RATIOS.log()).numpy())
    assert res.rho[:, 0].tolist() == pytest.approx(rho)


def test_decoupled_ppo_dropped_transition_does_not_move_the_policy():
    cfg = PPOConfig(decoupled=True, gamma=GAMMA, gae_lambda=LAM, normalize_reward=False, anneal_lr=False, norm_adv=False, **ONE_STEP)
    a, b = PPO(cfg, OBS, ACT), PPO(cfg, OBS, ACT)
    batch = four_step_batch(a.policy, RATIOS)
    a.update(batch)
    b.update(dataclasses.replace(batch, rewards=REWARDS + torch.tensor([[0.0], [0.0], [50.0], [0.0]])))
    torch.testing.assert_close(params(a), params(b))
    c = PPO(cfg, OBS, ACT)  # ... while the same change at a kept step does
    c.update(dataclasses.replace(batch, rewards=REWARDS + torch.tensor([[0.0], [50.0], [0.0], [0.0]])))
    assert not torch.allclose(params(a), params(c))


def test_decoupled_ppo_on_fresh_data_is_plain_ppo():
    base = dict(gamma=GAMMA, gae_lambda=LAM, anneal_lr=False, update_epochs=2, num_minibatches=2, normalize_obs=False)
    plain, dec = PPO(PPOConfig(**base), OBS, ACT), PPO(PPOConfig(decoupled=True, **base), OBS, ACT)
    batch = four_step_batch(plain.policy)  # values=None: both use the current critic
    plain.update(batch)
    dec.update(batch)
    torch.testing.assert_close(params(plain), params(dec))


# ---- AGRO (V-trace value baseline) ---------------------------------------------------------------

def test_agro_update_uses_vtrace_targets_with_its_own_ratios():
    cfg = AGROConfig(gamma=GAMMA, gae_lambda=LAM, normalize_reward=False, norm_adv=False, **ONE_STEP)
    algo = AGRO(cfg, OBS, ACT)
    batch = four_step_batch(algo.policy, RATIOS)
    V, Vf, VL = critic_values(algo.policy, batch)
    vs, adv = hand_vtrace(REWARDS[:, 0].tolist(), V, Vf, VL, [1.0, 0.5, 0.0, 0.25])
    m = algo.update(batch)
    assert m["return_mean"] == pytest.approx(sum(vs) / 4, abs=1e-5)
    # reference = policy at the start (interval 1): the baseline is the mean advantage, so the loss
    # terms see A - mean(A); loss_value is against vs
    assert m["baseline"] == pytest.approx(sum(adv) / 4, abs=1e-5)
    assert m["loss_value"] == pytest.approx(0.5 * sum((v - x) ** 2 for v, x in zip(V, vs)) / 4, rel=1e-4)


def test_agro_normalises_stale_advantages_by_the_uncorrected_spread():
    """Truncated traces shrink A on stale data; dividing by A's own std would undo that (and grow
    the step with staleness). The divisor is the std of the rho = c = 1 advantages."""
    cfg = AGROConfig(gamma=GAMMA, gae_lambda=LAM, normalize_reward=False, norm_adv=True, **ONE_STEP)
    algo = AGRO(cfg, OBS, ACT)
    batch = four_step_batch(algo.policy, RATIOS)
    V, Vf, VL = critic_values(algo.policy, batch)
    r = REWARDS[:, 0].tolist()
    _, adv = hand_vtrace(r, V, Vf, VL, [1.0, 0.5, 0.0, 0.25])
    _, plain = hand_vtrace(r, V, Vf, VL, [1.0, 1.0, 1.0, 1.0])
    std = torch.tensor(plain).std(unbiased=False).item()
    assert std != pytest.approx(torch.tensor(adv).std(unbiased=False).item(), rel=1e-2)  # the test can tell
    m = algo.update(batch)
    assert m["adv_norm_std"] == pytest.approx(std, rel=1e-5)
    assert m["baseline"] == pytest.approx(sum(adv) / 4 / std, rel=1e-4)


def first_gradient(algo, batch) -> dict[str, torch.Tensor]:
    """The gradient of ``algo``'s first minibatch step on ``batch`` (the step itself is skipped)."""
    grads: dict[str, torch.Tensor] = {}

    def record() -> None:
        if not grads:
            grads.update({n: p.grad.detach().clone() for n, p in algo.policy.named_parameters() if p.grad is not None})

    algo.optimizer.step = record
    algo.update(batch)
    return grads


def test_agro_on_fresh_data_takes_ppos_first_gradient():
    """On fresh data (mu = pi, rho = c = 1, reference = policy) AGRO's first step is PPO's: V-trace
    is GAE, the regulariser and its share of the baseline are 0, so the baseline is the mean
    advantage and the policy term is PPO's normalised advantage times grad log pi; the value loss
    is PPO's (its clip is inactive at the first step). Only the std convention differs (AGRO's
    population std, PPO's n - 1): the policy's gradient is PPO's times sqrt(n / (n - 1))."""
    shared = dict(gamma=GAMMA, gae_lambda=LAM, max_grad_norm=0.0, **ONE_STEP)
    ppo, agro = PPO(PPOConfig(**shared), OBS, ACT), AGRO(AGROConfig(**shared), OBS, ACT)
    agro.policy.load_state_dict(ppo.policy.state_dict())
    batch = four_step_batch(ppo.policy)  # fresh: behaviour log-probs are the policy's own
    g_ppo, g_agro = first_gradient(ppo, batch), first_gradient(agro, batch)
    n = batch.obs.shape[0]
    assert set(g_ppo) == set(g_agro) and any("critic" in k for k in g_ppo)
    for name, g in g_ppo.items():
        scale = 1.0 if "critic" in name else math.sqrt(n / (n - 1))
        assert float(g.abs().max()) > 0, name
        torch.testing.assert_close(g_agro[name], g * scale, rtol=1e-4, atol=1e-6, msg=name)


# ---- GRPO / DAPO: clips, mask and KL ----------------------------------------------------------------

def group_batch(policy, ratio_pos: float, ratio_neg: float, tie: bool = False) -> TrajectoryBatch:
    """Two rollouts of one group. Column 0 (higher return) terminates at step 1, its step 2 is the next
    episode (masked, ratio 1); column 1 is truncated at step 2. Known ratios pi / mu per column."""
    g = torch.Generator().manual_seed(5)
    obs, act = torch.randn(3, 2, OBS, generator=g), torch.randn(3, 2, ACT, generator=g)
    with torch.no_grad():
        logp = policy.log_prob(obs, act)
    ratios = torch.tensor([[ratio_pos, ratio_neg], [ratio_pos, ratio_neg], [1.0, ratio_neg]])
    rewards = torch.tensor([[1.0, 0.0], [1.0, 0.0], [5.0, 1.0]]) if not tie else torch.ones(3, 2)
    return TrajectoryBatch(
        obs=obs, actions=act, rewards=rewards, behaviour_logp=logp - ratios.log(),
        terminated=torch.tensor([[False, False], [True, False], [False, False]]),
        truncated=torch.tensor([[False, False], [False, False], [False, True]]),
        group_id=torch.zeros(2, dtype=torch.int64),
    )


@pytest.mark.parametrize(
    "algo_cls,cfg_cls,ratio_pos,moves",
    [
        (GRPO, GRPOConfig, 1.25, False),  # above 1 + 0.2: clipped, no gradient
        (GRPO, GRPOConfig, 1.15, True),
        (DAPO, DAPOConfig, 1.35, False),  # above 1 + 0.28
        (DAPO, DAPOConfig, 1.25, True),  # clip-higher: still inside
    ],
)
def test_group_update_respects_the_upper_and_lower_clip(algo_cls, cfg_cls, ratio_pos, moves):
    # the negative-advantage rollout sits at ratio 0.7 < 1 - 0.2: clipped below, no gradient either
    algo = algo_cls(cfg_cls(kl_coef=0.0, **ONE_STEP), OBS, ACT)
    before = params(algo)
    m = algo.update(group_batch(algo.policy, ratio_pos, 0.7))
    assert m["columns_used"] == 2
    assert (not torch.equal(before, params(algo))) is moves
    assert m["clipfrac"] == pytest.approx(1.0 if not moves else 3 / 5)


def test_group_update_lower_clip_on_its_own():
    algo = GRPO(GRPOConfig(kl_coef=0.0, **ONE_STEP), OBS, ACT)
    before = params(algo)
    algo.update(group_batch(algo.policy, 1.25, 0.9))  # the negative rollout inside the clip: moves
    assert not torch.equal(before, params(algo))


def test_grpo_kl_default_and_direction():
    assert GRPOConfig().kl_coef == 0.04 and DAPOConfig().kl_coef == 0.0
    algo = GRPO(GRPOConfig(learning_rate=1e-2, **ONE_STEP), OBS, ACT)
    with torch.no_grad():
        algo.policy.net.actor_logstd += 0.5  # the reference keeps log std 0
    g = torch.Generator().manual_seed(4)
    obs = torch.randn(2, 64, OBS, generator=g)
    act, logp, _ = algo.policy.act(obs, generator=g)
    ended = torch.tensor([[False], [True]]).expand(2, 64)
    batch = TrajectoryBatch(obs=obs, actions=act, rewards=torch.ones(2, 64), behaviour_logp=logp, terminated=ended,
                            truncated=torch.zeros(2, 64, dtype=torch.bool), group_id=torch.zeros(64, dtype=torch.int64))
    with torch.no_grad():  # tied returns: advantage 0, only the KL acts
        d = algo.ref_policy.log_prob(obs, act) - logp
    k3 = d.exp() - d - 1.0  # KL(pi || pi_ref) from samples of pi
    m = algo.update(batch)
    assert m["loss_kl"] == pytest.approx(float(k3.mean()), rel=1e-5)
    assert 0.0 < algo.policy.net.actor_logstd.item() < 0.5  # pulled towards the reference


# ---- DPO --------------------------------------------------------------------------------------------

def test_dpo_update_prefers_the_winner_with_the_right_scale():
    algo = DPO(DPOConfig(beta=0.5, learning_rate=1e-2), OBS, ACT)
    g = torch.Generator().manual_seed(2)
    L, B = 3, 4
    pb = PreferenceBatch(obs_w=torch.randn(L, B, OBS, generator=g), act_w=torch.randn(L, B, ACT, generator=g),
                         obs_l=torch.randn(L, B, OBS, generator=g), act_l=torch.randn(L, B, ACT, generator=g),
                         mask_l=torch.tensor([[True] * B, [True] * B, [False] * B]))
    m0 = algo.update(pb)
    assert m0["reward_margin"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at the start
    assert m0["loss_dpo"] == pytest.approx(math.log(2.0), rel=1e-5)
    with torch.no_grad():
        lw = segment_log_prob(algo.policy, pb.obs_w, pb.act_w, None) - segment_log_prob(algo.ref_policy, pb.obs_w, pb.act_w, None)
        ll = segment_log_prob(algo.policy, pb.obs_l, pb.act_l, pb.mask_l) - segment_log_prob(algo.ref_policy, pb.obs_l, pb.act_l, pb.mask_l)
    margin = 0.5 * (lw - ll)
    assert float(margin.mean()) > 0  # the winner became more likely relative to the loser
    m1 = algo.update(pb)
    assert m1["reward_margin"] == pytest.approx(float(margin.mean()), rel=1e-4)
    assert m1["loss_dpo"] == pytest.approx(float(-torch.nn.functional.logsigmoid(margin).mean()), rel=1e-4)
