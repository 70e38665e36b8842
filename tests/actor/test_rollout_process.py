"""``RolloutProcess``: an actor's envs in a spawned child give the batches a ``Rollout`` in this
process gives, env errors reach the actor as themselves, and the child never outlives its owner."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from actor.actor import Actor, ActorConfig
from actor.envs import NonFiniteEnvError
from actor.policy_client import PolicySubscriber
from actor.rollout import Rollout
from actor.rollout_process import RolloutProcess, RolloutProcessError
from agents.networks import Policy
from schemas.codec import Codec
from streams.bus.memory import MemoryBus
from streams.events import EventBus
from streams.policies import make_policy_version
from streams.topics import POLICY_VERSIONS, SAMPLES_RAW, all_topics

ENVS = Path(__file__).resolve().parents[1] / "envs"
FIELDS = ("obs", "actions", "rewards", "terminated", "truncated", "behaviour_logp", "last_obs",
          "final_obs_index", "final_obs")


@pytest.fixture
def owned():
    """Rollout processes a test starts; each is closed, and no child is left, pass or fail."""
    started: list[RolloutProcess] = []
    yield started
    for r in started:
        r.close()
    assert not mp.active_children()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("env_id, dims", [("Pendulum-v1", (3, 1, ())),       # Gaussian: the numpy sampler
                                          ("CartPole-v1", (4, 1, (2,)))])    # categorical: Policy.act
def test_a_rollout_process_gives_the_batches_an_in_process_rollout_gives(owned, env_id, dims):
    torch.manual_seed(0)
    obs_dim, act_dim, nvec = dims
    policy = Policy(obs_dim, act_dim, nvec=nvec)
    cfg = ActorConfig(env_id=env_id, num_envs=2, fragment_steps=150, seed=3)
    here, there = Rollout(cfg), RolloutProcess(cfg)
    owned.append(there)
    got: list[tuple] = []
    for seq, version in enumerate([0, 0, 1, 1]):
        if seq == 2:  # a new version, loaded into the same module (as the subscriber does): the
            # child must be sent it (mutation-checked: sending the module once fails both cases)
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(0.3 * torch.randn_like(p))
        got.append((here.collect(policy, version, 150, seq), there.collect(policy, version, 150, seq)))
    here.close()
    # the child got a copy: sending the live module would have moved its tensors into shared memory
    assert not any(t.is_shared() for t in policy.state_dict().values())
    for a, b in got:
        for f in FIELDS:
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
        assert (a.seq, a.policy_version, a.episode_returns, a.episode_lengths) == \
               (b.seq, b.policy_version, b.episode_returns, b.episode_lengths)


def test_an_env_error_in_the_child_is_rejected_by_the_actor_as_in_process(owned, monkeypatch):
    monkeypatch.syspath_prepend(str(ENVS))  # the child inherits sys.path and imports the env's module
    bus = MemoryBus()
    bus.create_topics(all_topics())
    events = EventBus(bus, Codec())
    cfg = ActorConfig(env_id="faulty_envs:NaNPendulum-v0", num_envs=1, fragment_steps=20)
    rollout = RolloutProcess(cfg)
    owned.append(rollout)
    rejects: list[NonFiniteEnvError] = []
    actor = Actor(cfg, PolicySubscriber(events, "policy", "actor"), events, on_reject=rejects.append, rollout=rollout)
    events.publish(POLICY_VERSIONS, make_policy_version(Policy(3, 1), policy_id="policy", version=0,
                                                        parent_version=None, learner_id="t", algo="ppo"), key="policy")
    assert actor.step() is None
    assert actor.rejected == 1 and isinstance(rejects[0], NonFiniteEnvError)
    assert (rejects[0].what, rejects[0].step, rejects[0].envs) == ("observation", 4, [0])
    batch = actor.step()  # the child reset its envs: the next fragment goes out
    assert batch is not None and np.isfinite(batch.obs).all() and batch.seq == 0
    assert len(list(bus.read_all(SAMPLES_RAW))) == 1


def test_an_env_that_cannot_be_made_fails_the_start_with_its_own_error(owned):
    with pytest.raises(ValueError, match="cannot make environment"):
        RolloutProcess(ActorConfig(env_id="NoSuchEnv-v0"))


def test_a_child_that_dies_is_an_error_naming_its_exit_code(owned):
    rollout = RolloutProcess(ActorConfig(env_id="Pendulum-v1", fragment_steps=10))
    owned.append(rollout)
    os.kill(rollout.pid, signal.SIGKILL)
    with pytest.raises(RolloutProcessError, match="exit code -9"):
        rollout.collect(Policy(3, 1), 0, 10, 0)


def test_close_ends_the_child_and_a_swap_is_refused(owned):
    cfg = ActorConfig(env_id="Pendulum-v1", fragment_steps=10)
    rollout = RolloutProcess(cfg)
    owned.append(rollout)
    with pytest.raises(ValueError, match="cannot swap"):
        rollout.collect(Policy(3, 1), 0, 10, 0, newer=lambda: None)
    pid = rollout.pid
    assert alive(pid)
    rollout.close()
    assert not alive(pid)
    with pytest.raises(ValueError, match="swap_every must be 0"):
        RolloutProcess(ActorConfig(env_id="Pendulum-v1", swap_every=8))
