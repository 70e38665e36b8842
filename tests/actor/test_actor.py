"""Actor: fragments, version tagging, truncation bookkeeping, NaN rejection (memory bus)."""

from __future__ import annotations

import time

import gymnasium as gym
import numpy as np
import pytest
import torch

from actor.actor import Actor, ActorConfig
from actor.envs import make_vector_env
from actor.policy_client import PolicySubscriber
from agents.networks import Policy
from streams.policies import make_policy_version
from schemas.codec import Codec
from schemas.events import SampleBatch
from streams.bus.memory import MemoryBus
from streams.events import EventBus
from streams.topics import POLICY_VERSIONS, SAMPLES_RAW, all_topics

torch.set_num_threads(1)


class NaNAfter(gym.Wrapper):
    """Pendulum that emits a NaN observation at step ``at`` of its first episode."""

    def __init__(self, at: int = 5, what: str = "obs") -> None:
        super().__init__(gym.make("Pendulum-v1"))
        self.at, self.what, self.t = at, what, 0

    def step(self, action):
        obs, r, term, trunc, info = self.env.step(action)
        self.t += 1
        if self.t == self.at:
            if self.what == "obs":
                obs = obs.copy()
                obs[0] = np.nan
            else:
                r = float("inf")
        return obs, r, term, trunc, info


gym.register("rlstream-test/NaNPendulum-v0", entry_point=NaNAfter)


@pytest.fixture
def events():
    bus = MemoryBus()
    bus.create_topics(all_topics())
    return EventBus(bus, Codec())


def publish_policy(events: EventBus, version: int, policy: Policy) -> None:
    pv = make_policy_version(policy, policy_id="policy", version=version, parent_version=None,
                             learner_id="test", algo="ppo")
    events.publish(POLICY_VERSIONS, pv, key="policy")


def published(events: EventBus) -> list[SampleBatch]:
    return [events.codec.decode(r.value) for r in events.bus.read_all(SAMPLES_RAW)]


def test_actor_waits_for_a_policy_then_tags_batches_with_its_version(events):
    actor = Actor(ActorConfig(env_id="Pendulum-v1", num_envs=2, fragment_steps=150),
                  PolicySubscriber(events, "policy", "actor"), events)
    assert actor.step() is None  # no policy yet: nothing collected, nothing published
    assert published(events) == []
    publish_policy(events, 0, Policy(3, 1))
    b0 = actor.step()
    publish_policy(events, 1, Policy(3, 1))
    b1 = actor.step()
    got = published(events)
    assert [b.seq for b in got] == [0, 1]
    assert [b.policy_version for b in got] == [0, 1]
    assert b0.obs.shape == (150, 2, 3) and b0.actions.shape == (150, 2, 1)
    # Pendulum truncates at 200 steps: step 49 of the second fragment ends both episodes
    assert b1.truncated[49].all() and not b1.truncated[:49].any()
    assert sorted(b1.final_obs_index.tolist()) == [49 * 2, 49 * 2 + 1]
    assert len(b1.episode_returns) == 2 and b1.episode_lengths == [200, 200]
    # the reset obs follows the final obs, and the final obs is a real state (cos^2+sin^2 = 1)
    assert np.allclose((b1.final_obs[:, :2] ** 2).sum(-1), 1.0, atol=1e-5)
    # log-probs are those of the unclipped actions under the behaviour policy
    pol = actor.subscriber.policy
    logp = pol.log_prob(torch.from_numpy(b1.obs), torch.from_numpy(b1.actions)).detach().numpy()
    np.testing.assert_allclose(logp, b1.behaviour_logp, rtol=1e-4, atol=1e-4)


def test_actor_accounts_for_what_the_bus_acknowledged_by_seq(events):
    """The summary carries the actor's own account of its batches (``Acknowledgements``): each
    delivery report settles one seq, acknowledged or failed with the error's text."""
    actor = Actor(ActorConfig(env_id="Pendulum-v1", num_envs=1, fragment_steps=8),
                  PolicySubscriber(events, "policy", "actor"), events)
    publish_policy(events, 0, Policy(3, 1))
    for _ in range(3):
        assert actor.step() is not None
    s = actor.summary()
    assert (s["seq"], s["acknowledged"], s["acknowledged_seqs"], s["unacknowledged"], s["delivery_failed"]) == \
        (3, 3, [[0, 2]], 0, {})
    assert [b.seq for b in published(events)] == [0, 1, 2]
    # a report that has not come yet, and one of a failure (Kafka's, settled in a later flush)
    late, bad = actor.acks.sent(3), actor.acks.sent(4)
    assert actor.acks.summary()["unacknowledged"] == 2
    late(None)
    bad("_MSG_TIMED_OUT: Local: Message timed out")
    assert actor.acks.summary() == {"acknowledged": 4, "acknowledged_seqs": [[0, 3]], "unacknowledged": 0,
                                    "delivery_failed": {"4": "_MSG_TIMED_OUT: Local: Message timed out"}}


@pytest.mark.parametrize("what", ["obs", "reward"])
def test_non_finite_env_output_is_rejected_counted_and_never_published(events, what):
    rejects = []
    env = gym.vector.SyncVectorEnv([lambda: NaNAfter(at=5, what=what)],
                                   autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    actor = Actor(ActorConfig(env_id="Pendulum-v1", num_envs=1, fragment_steps=20),
                  PolicySubscriber(events, "policy", "actor"), events, on_reject=rejects.append, env=env)
    publish_policy(events, 0, Policy(3, 1))
    assert actor.step() is None
    assert actor.rejected == 1 and len(rejects) == 1
    assert ("observation" if what == "obs" else "reward") in str(rejects[0])
    assert rejects[0].step == 4
    assert published(events) == []
    # after the reset the env is healthy again (the NaN was only at step 5 of the first episode
    # of this wrapper instance, which reset does not rewind), so the next fragment goes out
    batch = actor.step()
    assert batch is not None and np.isfinite(batch.obs).all()
    assert [b.seq for b in published(events)] == [0]


def test_group_mode_gives_each_group_one_start_state(events):
    actor = Actor(ActorConfig(env_id="Pendulum-v1", num_envs=4, fragment_steps=10, group_size=2),
                  PolicySubscriber(events, "policy", "actor"), events)
    publish_policy(events, 0, Policy(3, 1))
    b = actor.step()
    assert b.group_ids.tolist()[0] == b.group_ids.tolist()[1] != b.group_ids.tolist()[2]
    np.testing.assert_array_equal(b.obs[0, 0], b.obs[0, 1])
    np.testing.assert_array_equal(b.obs[0, 2], b.obs[0, 3])
    assert not np.array_equal(b.obs[0, 0], b.obs[0, 2])


def test_make_vector_env_rejects_unknown_env():
    with pytest.raises(ValueError, match="cannot make environment"):
        make_vector_env("NoSuchEnv-v0", 1)


def test_group_mode_ends_the_fragment_once_every_rollout_is_done(events):
    # a random policy drops InvertedPendulum within a few dozen steps, far below the 1000 asked for
    actor = Actor(ActorConfig(env_id="InvertedPendulum-v5", num_envs=4, fragment_steps=1000, group_size=2),
                  PolicySubscriber(events, "policy", "actor"), events)
    publish_policy(events, 0, Policy(4, 1))
    b = actor.step()
    done = b.terminated | b.truncated
    assert b.num_steps < 1000 and done.any(0).all()  # each column (rollout) ended inside
    assert done[-1].any()  # ... and the fragment stops at the step the last one ended
    assert actor.steps == b.num_steps * 4
    # only each column's first episode is reported: later ones are cut short by the early end
    first_end = done.argmax(0)
    assert sorted(b.episode_lengths) == sorted((first_end + 1).tolist())
    assert len(b.episode_returns) == 4


def test_free_running_actor_without_inflight_ends_a_fragment_early_when_a_newer_policy_arrives(events):
    class PublishMidway(PolicySubscriber):
        """Publishes version 1 at its third poll: the check after step 16 of the first fragment."""

        polls = 0

        def poll(self, timeout=0.0):
            self.polls += 1
            if self.polls == 3:  # 1: before the fragment; then every 8 steps: 2 after 8, 3 after 16
                publish_policy(events, 1, Policy(3, 1))
            return super().poll(timeout)

    actor = Actor(ActorConfig(env_id="Pendulum-v1", num_envs=1, fragment_steps=64, swap_every=8,
                              swap_every_s=1e9, inflight=False),  # looks by step count only
                  PublishMidway(events, "policy", "actor"), events)
    publish_policy(events, 0, Policy(3, 1))
    b0 = actor.step()
    b1 = actor.step()
    assert (b0.policy_version, b0.num_steps) == (0, 16)  # cut at the first check after the publish
    assert (b1.policy_version, b1.num_steps) == (1, 64)
    assert actor.cut_fragments == 1
    np.testing.assert_array_equal(b0.last_obs, b1.obs[0])  # no step lost between the two


def test_a_lagged_actor_acts_with_the_version_k_behind_the_newest_received(events):
    """``lag=K``: the fragment's behaviour policy is the newest version <= newest - K, with that
    version's own weights, also when several versions arrive between two polls."""
    policies = {}

    def publish(v: int) -> None:
        torch.manual_seed(v)
        policies[v] = Policy(3, 1)
        publish_policy(events, v, policies[v])

    actor = Actor(ActorConfig(env_id="Pendulum-v1", num_envs=1, fragment_steps=8),
                  PolicySubscriber(events, "policy", "actor", lag=2), events)
    publish(0)
    assert actor.step().policy_version == 0  # the first version received, until two more exist
    publish(1)
    assert actor.step().policy_version == 0
    publish(2)
    assert actor.step().policy_version == 0
    publish(3)
    assert actor.step().policy_version == 1
    for v in (4, 5, 6):  # three arrive before the next poll
        publish(v)
    b = actor.step()
    assert b.policy_version == 4 and actor.subscriber.newest == 6
    want = policies[4].log_prob(torch.from_numpy(b.obs), torch.from_numpy(b.actions)).detach().numpy()
    np.testing.assert_allclose(b.behaviour_logp, want, rtol=1e-4, atol=1e-4)
    assert actor.step().policy_version == 4  # nothing new arrived: it keeps its version
    with pytest.raises(ValueError):
        PolicySubscriber(events, "policy", "other", lag=-1)


def test_policy_latency_leaves_out_the_start_up_adoption(events):
    """Version 0, published before the actor exists, is adopted at its first step: that wait is
    the actor's start-up, kept apart; a version published while it acts is policy latency."""
    from streams.policy.publish import publish_policy_version

    def publish(v: int) -> None:
        publish_policy_version(events, make_policy_version(Policy(3, 1), policy_id="policy", version=v,
                                                           parent_version=None, learner_id="test", algo="ppo"))

    publish(0)
    t_published = time.perf_counter()
    got: list[float] = []
    sub = PolicySubscriber(events, "policy", "actor", on_latency=got.append)
    actor = Actor(ActorConfig(env_id="Pendulum-v1", num_envs=1, fragment_steps=10), sub, events)
    waited = time.perf_counter() - t_published  # the start-up so far (env, imports): at least this
    actor.step()
    assert sub.version == 0 and got == [] and sub.startup_latency_s >= waited
    t1 = time.perf_counter()
    publish(1)
    actor.step()
    # policy latency: within what this test saw between the publish and the adoption, no start-up in it
    assert sub.version == 1 and len(got) == 1 and 0 <= got[0] <= time.perf_counter() - t1
    assert actor.summary()["startup_adoption_ms"] == round(sub.startup_latency_s * 1e3, 3)
