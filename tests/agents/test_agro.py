import pytest
import torch

from agents.agro import AGRO, AGROConfig, agro_loss
from agents.base import frozen_copy


def test_agro_loss_by_hand():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0])
    adv = torch.tensor([2.0, 1.0])
    out = agro_loss(logp, ref, adv, beta=0.5)
    # policy: mean(-A logp) = mean(2, 2) = 2; reg: mean(0.25 * 0.5^2, 0.25 * 1^2) = 0.15625
    torch.testing.assert_close(out["loss_policy"], torch.tensor(2.0))
    torch.testing.assert_close(out["loss_reg"], torch.tensor(0.15625))
    (out["loss_policy"] + out["loss_reg"]).backward()
    # d/dlogp_i = (-A_i + beta (logp_i - ref_i)) / 2 = [(-2 + 0.25) / 2, (-1 - 0.5) / 2]
    torch.testing.assert_close(logp.grad, torch.tensor([-0.875, -0.75]))


def test_agro_learns_on_policy(bandit):
    algo = AGRO(AGROConfig(learning_rate=3e-3), bandit.OBS_DIM, bandit.ACT_DIM)
    gen = torch.Generator().manual_seed(0)
    mse0, rew0 = bandit.policy_mse(algo.policy), bandit.mean_reward(algo.policy)
    for _ in range(25):
        m = algo.update(bandit.rollout(algo.policy, 64, 8, gen))
    assert bandit.policy_mse(algo.policy) < 0.25 * mse0
    assert bandit.mean_reward(algo.policy) > rew0 + 0.4
    assert {"loss_policy", "loss_reg", "loss_value", "loss_total"} <= set(m)


def test_agro_learns_from_fully_stale_data(bandit):
    """All data from the frozen initial policy (unbounded staleness), no IS ratio: still improves."""
    algo = AGRO(AGROConfig(learning_rate=3e-3, baseline="mean", normalize_obs=False), bandit.OBS_DIM, bandit.ACT_DIM)
    behaviour = frozen_copy(algo.policy)
    gen = torch.Generator().manual_seed(0)
    mse0 = bandit.policy_mse(algo.policy)
    for _ in range(25):
        algo.update(bandit.rollout(behaviour, 64, 8, gen))
    assert bandit.policy_mse(algo.policy) < 0.5 * mse0


def test_agro_group_baseline(bandit):
    algo = AGRO(AGROConfig(learning_rate=3e-3, baseline="group"), bandit.OBS_DIM, bandit.ACT_DIM)
    gen = torch.Generator().manual_seed(0)
    mse0 = bandit.policy_mse(algo.policy)
    for _ in range(20):
        m = algo.update(bandit.rollout(algo.policy, 1, 256, gen, group_size=8))
    assert "loss_value" not in m
    assert bandit.policy_mse(algo.policy) < 0.25 * mse0


# ---- the KL-regularised optimum under any sampler (4-action tabular bandit) ----------------------
REF_LOGITS = torch.tensor([0.5, 0.0, -0.5, 0.2])
REWARDS = torch.tensor([1.0, 0.2, -0.5, 0.6])
STALE = torch.tensor([0.1, 0.15, 0.6, 0.15])  # a fixed behaviour policy far from pi_ref and pi*
BETA = 0.5


@pytest.mark.parametrize("baseline", ["mean", "value"])
@pytest.mark.parametrize("sampler", ["fresh", "stale"])
def test_agro_reaches_the_regularised_optimum_under_any_sampler(baseline, sampler, tabular):
    cfg = AGROConfig(beta=BETA, baseline=baseline, norm_adv=False, normalize_reward=False, normalize_obs=False,
                     ref_update_interval=0, update_epochs=1, num_minibatches=1, learning_rate=0.03, max_grad_norm=0.0)
    algo = AGRO(cfg, 1, 1)
    pol = tabular.install(algo, REF_LOGITS)
    ref = torch.softmax(REF_LOGITS, -1)
    target = ref * torch.exp(REWARDS / BETA)
    target = target / target.sum()
    gen = torch.Generator().manual_seed(0)
    for _ in range(600):
        probs = STALE if sampler == "stale" else pol.probs().detach()
        algo.update(tabular.bandit_batch(probs, REWARDS, 256, gen))
    assert tabular.kl(target, pol.probs().detach()) < 1e-3
