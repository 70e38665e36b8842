"""Discrete action spaces end to end below the CLI: the actor on CartPole, the policy's trip
through a PolicyVersion event, IS weights over discrete log-probs in the stream processors,
and users' own environments (``module:EnvId``) with selectable wrappers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from actor.actor import Actor, ActorConfig
from actor.envs import env_dims, make_vector_env
from actor.policy_client import PolicySubscriber
from agents.networks import Policy
from streams.policies import arch_of, load_policy, make_policy_version
from schemas.codec import Codec
from schemas.events import SampleBatch
from streams.bus.memory import MemoryBus
from streams.events import EventBus
from streams.policies import PolicyLogpFn
from streams.processors.importance import ImportanceWeights
from streams.topics import POLICY_VERSIONS, SAMPLES_RAW, all_topics

torch.set_num_threads(1)
USER_ENVS = Path(__file__).resolve().parents[1] / "envs"


@pytest.fixture
def events() -> EventBus:
    bus = MemoryBus()
    bus.create_topics(all_topics())
    return EventBus(bus, Codec())


def _publish(events: EventBus, policy: Policy, version: int) -> None:
    pv = make_policy_version(policy, policy_id="policy", version=version, parent_version=None,
                             learner_id="test", algo="ppo")
    events.publish(POLICY_VERSIONS, pv, key=b"policy")
    events.flush()


def _categorical(seed: int, obs_dim: int = 4, nvec=(2,)) -> Policy:
    torch.manual_seed(seed)
    p = Policy(obs_dim, len(nvec), hidden=(16,), nvec=nvec, normalize_obs=False)
    with torch.no_grad():
        for prm in p.parameters():
            prm.add_(torch.randn_like(prm) * 0.3)
    return p.eval()


def test_cartpole_spec_is_discrete():
    spec = env_dims("CartPole-v1")
    assert (spec.obs_dim, spec.act_dim, spec.nvec) == (4, 1, (2,))
    assert spec.to_env(np.array([[1.0], [0.0]], np.float32)).tolist() == [1, 0]


def test_actor_publishes_discrete_batches_that_round_trip_through_the_codec(events):
    _publish(events, _categorical(0), 0)
    sub = PolicySubscriber(events, policy_id="policy", stage="actor-0")
    actor = Actor(ActorConfig(env_id="CartPole-v1", num_envs=2, fragment_steps=64), sub, events)
    try:
        batch = actor.step(policy_timeout=5.0)
    finally:
        actor.close()
    assert batch is not None and batch.actions.shape == (64, 2, 1) and batch.actions.dtype == np.float32
    assert set(np.unique(batch.actions).tolist()) == {0.0, 1.0}
    # the behaviour log-probs are the policy's own log-probs of the discrete actions it took
    lp = sub.policy.log_prob(torch.from_numpy(batch.obs), torch.from_numpy(batch.actions)).detach().numpy()
    np.testing.assert_allclose(batch.behaviour_logp, lp, atol=1e-5)
    assert (batch.behaviour_logp <= 0).all()
    rec = events.bus.consumer(None, [SAMPLES_RAW], start="earliest").poll(5.0)[0]
    decoded = events.codec.decode(rec.value)
    assert isinstance(decoded, SampleBatch) and np.array_equal(decoded.actions, batch.actions)


def test_categorical_policy_version_rebuilds_and_gives_is_weights_over_discrete_log_probs():
    old, new = _categorical(1, nvec=(3, 2)), _categorical(2, nvec=(3, 2))
    pv = make_policy_version(new, policy_id="policy", version=5, parent_version=4, learner_id="t", algo="ppo")
    assert arch_of(new)["kind"] == "categorical_mlp" and arch_of(new)["nvec"] == [3, 2]
    rebuilt = load_policy(pv)
    assert rebuilt.nvec == (3, 2)
    fn = PolicyLogpFn.from_policy_version(pv)  # what the stream processors build
    gen = torch.Generator().manual_seed(0)
    obs = torch.randn(6, 2, 4, generator=gen)
    actions, behaviour_logp, _ = old.act(obs, generator=gen)
    current = fn(obs.numpy(), actions.numpy())
    np.testing.assert_allclose(current, new.log_prob(obs, actions).detach().numpy(), atol=1e-5)
    result = ImportanceWeights(rho_bar=1.0).from_logps(behaviour_logp.numpy(), current)
    expected = np.minimum(1.0, np.exp(current - behaviour_logp.numpy()))
    np.testing.assert_allclose(result.rho, expected, rtol=1e-5)
    assert result.computed and 0 < result.rho.min() < 1


def test_user_env_by_module_id_with_wrappers(monkeypatch):
    monkeypatch.syspath_prepend(str(USER_ENVS))
    spec = env_dims("user_envs:Corridor-v0")
    assert (spec.obs_dim, spec.nvec) == (2, (2,))
    env = make_vector_env("user_envs:Corridor-v0", 2, wrappers=["normalize_obs", "clip_reward"])
    try:
        inner = env.envs[0]
        names = []
        while hasattr(inner, "env"):
            names.append(type(inner).__name__)
            inner = inner.env
        assert "NormalizeObservation" in names and "ClipReward" in names
        obs, _ = env.reset(seed=0)
        for _ in range(3):
            obs, *_ = env.step(np.array([1, 1]))
        assert not np.allclose(obs[:, 0], np.array([3 / 8, 3 / 8], np.float32))  # normalised
    finally:
        env.close()


def test_unknown_wrapper_and_unimportable_module_are_clear_errors():
    with pytest.raises(ValueError, match="unknown wrapper.*choose from"):
        make_vector_env("CartPole-v1", 1, wrappers=["nope"])
    with pytest.raises(ValueError, match="cannot import 'no_such_pkg_x'"):
        make_vector_env("no_such_pkg_x:Foo-v0", 1)
    with pytest.raises(ValueError, match="flat Box observation space.*flatten_obs"):
        env_dims("Blackjack-v1")  # Tuple observations ...
    spec = env_dims("Blackjack-v1", ["flatten_obs"])  # ... are one-hot vectors once flattened
    assert (spec.obs_dim, spec.nvec) == (32 + 11 + 2, (2,))
