import copy

import pytest
import torch

from config.algos import ALGO_DEFAULTS
from agents.dpo import PreferenceBatch
from agents.registry import ALGORITHMS, make_algorithm, make_config, make_policy
from config import PrepareConfig

EXPECTED = {"ppo": True, "grpo": True, "dapo": True, "agro": False, "tba": False, "dpo": False}


def test_registry_names_flags_and_staleness_defaults():
    assert set(ALGORITHMS) == set(EXPECTED) == set(ALGO_DEFAULTS)  # one row per algorithm
    for name, on_policy in EXPECTED.items():
        cfg_cls, algo_cls = ALGORITHMS[name]
        assert algo_cls.is_on_policy is on_policy is ALGO_DEFAULTS[name].on_policy
        row = ALGO_DEFAULTS[name]  # on-policy: drop stale data; off-policy: keep it at a lower weight
        assert row.staleness_mode == "drop" if on_policy else row.staleness_mode in ("downweight", "drop")
        assert PrepareConfig.for_algo(name).max_versions == row.max_versions


def test_overrides_are_applied_and_validated():
    algo = make_algorithm("ppo", 3, 2, {"clip_coef": 0.1, "hidden": [32, 16]})
    assert algo.config.clip_coef == 0.1 and algo.config.hidden == (32, 16)
    assert algo.policy.net.actor_mean[0].out_features == 32
    assert make_config("dapo").clip_high == 0.28 and make_config("dapo").loss_aggregation == "token"
    with pytest.raises(ValueError, match="cliip"):
        make_algorithm("ppo", 3, 2, {"cliip_coef": 0.1})
    with pytest.raises(ValueError, match="unknown algorithm"):
        make_algorithm("a2c", 3, 2)
    with pytest.raises(Exception):
        algo.config.clip_coef = 0.3  # frozen


def test_ppo_defaults_are_cleanrl():
    c = make_config("ppo")
    assert (c.learning_rate, c.adam_eps, c.gamma, c.gae_lambda, c.update_epochs, c.num_minibatches) == (3e-4, 1e-5, 0.99, 0.95, 10, 32)
    assert (c.clip_coef, c.clip_vloss, c.ent_coef, c.vf_coef, c.max_grad_norm, c.norm_adv, c.anneal_lr) == (0.2, True, 0.0, 0.5, 0.5, True, True)
    assert (c.normalize_obs, c.normalize_reward, c.obs_clip, c.reward_clip, c.hidden, c.activation) == (True, True, 10.0, 10.0, (64, 64), "tanh")


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_actor_policy_loads_published_weights(name):
    algo = make_algorithm(name, 3, 2)
    actor_policy = make_policy(name, 3, 2)
    actor_policy.load_state_dict(algo.policy.state_dict())
    obs = torch.randn(5, 3)
    assert torch.equal(actor_policy.act(obs, deterministic=True)[0], algo.policy.act(obs, deterministic=True)[0])


def _batch_for(name, algo, bandit, gen):
    if name == "dpo":
        L, B = 2, 16
        return PreferenceBatch(torch.randn(L, B, 2, generator=gen), torch.randn(L, B, 1, generator=gen),
                               torch.randn(L, B, 2, generator=gen), torch.randn(L, B, 1, generator=gen))
    if name in ("grpo", "dapo"):
        return bandit.rollout(algo.policy, 1, 32, gen, group_size=4)
    return bandit.rollout(algo.policy, 8, 4, gen)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_resume_reproduces_the_next_update(name, bandit):
    overrides = {"update_epochs": 2, "num_minibatches": 2} if name != "dpo" else {"num_minibatches": 2}
    gen = torch.Generator().manual_seed(0)
    a = make_algorithm(name, 2, 1, overrides)
    a.update(_batch_for(name, a, bandit, gen))
    snap = copy.deepcopy(a.state_dict())
    batch = _batch_for(name, a, bandit, gen)
    ma = a.update(batch)
    b = make_algorithm(name, 2, 1, {**overrides, "seed": 5})
    b.load_state_dict(snap)
    mb = b.update(batch)
    assert ma == mb
    for k, v in a.state_dict()["policy"].items():
        assert torch.equal(v, b.state_dict()["policy"][k]), k
