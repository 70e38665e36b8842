"""In-flight weight updates: a free-running actor adopts a newer policy between env steps, within
the fragment, and the fragment carries each step's behaviour version and log-prob; the stream
processors and the learner weight a mixed-version fragment per step (memory bus, crafted batches)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actor.actor import Actor, ActorConfig
from actor.policy_client import PolicySubscriber
from agents.networks import Policy
from agents.registry import make_algorithm
from agents.tba import staleness_weights
from config.prepare import PrepareConfig
from learner.batching import StreamIds, step_staleness, to_trajectory_batch
from schemas.codec import Codec
from schemas.errors import InvalidEventError
from schemas.events import PreparedBatch, SampleBatch
from schemas.examples import sample_batch
from streams.bus.memory import MemoryBus
from streams.events import EventBus
from streams.policies import make_policy_version
from streams.policy.publish import publish_policy_version
from streams.policy.loader import PolicyLogpFn
from streams.processors.pipeline import Prepare
from streams.topics import all_topics

torch.set_num_threads(1)


@pytest.fixture
def events():
    bus = MemoryBus()
    bus.create_topics(all_topics())
    return EventBus(bus, Codec())


def policy(seed: int, log_std: float, obs_dim: int = 3, act_dim: int = 1) -> Policy:
    """A policy of its own weights and action std (so two versions' log-probs differ)."""
    torch.manual_seed(seed)
    p = Policy(obs_dim, act_dim)
    with torch.no_grad():
        p.net.actor_logstd.fill_(log_std)
    return p


def publish(events: EventBus, version: int, p: Policy) -> None:
    pv = make_policy_version(p, policy_id="policy", version=version, parent_version=None, learner_id="test",
                             algo="tba")
    publish_policy_version(events, pv)  # with the publish-time header: latencies are measured


def logp_of(p: Policy, batch: SampleBatch, steps: slice) -> np.ndarray:
    with torch.no_grad():
        return p.log_prob(torch.from_numpy(batch.obs[steps]), torch.from_numpy(batch.actions[steps])).numpy()


class PublishAt(PolicySubscriber):
    """Publishes ``pending`` (version, policy) just before its ``at``-th poll."""

    def __init__(self, *a, at: int, pending: tuple[int, Policy], **k) -> None:
        super().__init__(*a, **k)
        self.polls, self.at, self.pending = 0, at, pending

    def poll(self, timeout=0.0):
        self.polls += 1
        if self.polls == self.at:
            publish(self.events, *self.pending)
        return super().poll(timeout)


def test_a_newer_policy_acts_from_the_next_step_within_the_fragment(events):
    """Version 1 arrives at the look after step 16 of a 64-step fragment: the fragment keeps its
    64 steps, steps 16.. act with version 1 (actions and log-probs of that version), and the
    next fragment is all version 1."""
    p0, p1 = policy(0, 0.0), policy(1, -0.7)
    sub = PublishAt(events, "policy", "actor", at=3, pending=(1, p1))  # polls: 1 before, 2 at 8, 3 at 16
    actor = Actor(ActorConfig(env_id="Pendulum-v1", num_envs=2, fragment_steps=64, swap_every=8,
                              swap_every_s=1e9), sub, events)  # looks by step count only
    publish(events, 0, p0)
    b0, b1 = actor.step(), actor.step()
    assert (b0.policy_version, b0.num_steps, b0.newest_version) == (0, 64, 1)
    np.testing.assert_array_equal(b0.step_versions, [0] * 16 + [1] * 48)
    np.testing.assert_allclose(b0.behaviour_logp[:16], logp_of(p0, b0, slice(0, 16)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b0.behaviour_logp[16:], logp_of(p1, b0, slice(16, 64)), rtol=1e-5, atol=1e-5)
    assert not np.allclose(b0.behaviour_logp[16:], logp_of(p0, b0, slice(16, 64)), atol=1e-2)
    assert (actor.inflight_swaps, actor.cut_fragments) == (1, 0)
    assert (b1.policy_version, b1.step_versions, b1.num_steps) == (1, None, 64)
    np.testing.assert_array_equal(b0.last_obs, b1.obs[0])
    b0.validate()
    back = Codec().decode(Codec().encode(b0))  # the new field travels
    np.testing.assert_array_equal(back.step_versions, b0.step_versions)


def test_a_policy_without_the_numpy_sampler_swaps_in_flight_too(events):
    """A categorical policy acts through ``Policy.act`` step by step: the steps after the swap
    carry the new version's actions' log-probs as well."""
    def categorical(seed: int) -> Policy:
        torch.manual_seed(seed)
        p = Policy(4, 1, hidden=(16,), nvec=(2,), normalize_obs=False)
        with torch.no_grad():
            for prm in p.parameters():
                prm.add_(torch.randn_like(prm) * 0.5)
        return p.eval()

    p0, p1 = categorical(0), categorical(1)
    sub = PublishAt(events, "policy", "actor", at=3, pending=(1, p1))
    actor = Actor(ActorConfig(env_id="CartPole-v1", num_envs=2, fragment_steps=32, swap_every=8,
                              swap_every_s=1e9), sub, events)
    publish(events, 0, p0)
    b = actor.step()
    np.testing.assert_array_equal(b.step_versions, [0] * 16 + [1] * 16)
    np.testing.assert_allclose(b.behaviour_logp[:16], logp_of(p0, b, slice(0, 16)), atol=1e-5)
    np.testing.assert_allclose(b.behaviour_logp[16:], logp_of(p1, b, slice(16, 32)), atol=1e-5)
    assert not np.allclose(b.behaviour_logp[16:], logp_of(p0, b, slice(16, 32)), atol=1e-3)


def test_looks_by_time_whatever_the_step_count(events):
    """``swap_every_s`` 0: a look after every step, so a version published before the 5th poll
    acts from step 4 even though ``swap_every`` steps never pass."""
    p0, p1 = policy(0, 0.0), policy(1, -0.7)
    sub = PublishAt(events, "policy", "actor", at=5, pending=(1, p1))  # polls: 1 before, then after each step
    actor = Actor(ActorConfig(env_id="Pendulum-v1", num_envs=1, fragment_steps=32, swap_every=10 ** 6,
                              swap_every_s=0.0), sub, events)
    publish(events, 0, p0)
    b = actor.step()
    np.testing.assert_array_equal(b.step_versions, [0] * 4 + [1] * 28)
    assert sub.parts and sub.parts[-1]["where"] == "step"
    parts = actor.summary()["policy_latency_parts_ms"]
    assert parts["where"] == {"step": 1} and set(parts) >= {"in_flight", "unpolled", "poll", "load"}


def test_step_versions_must_start_at_the_policy_version_and_never_decrease():
    b = sample_batch(T=4, N=2, policy_version=3)
    for bad in ([4, 4, 5, 5], [3, 5, 4, 5], [3, 3, 3]):
        with pytest.raises(InvalidEventError, match="step_versions"):
            SampleBatch(**{**b.__dict__, "step_versions": np.array(bad, np.int64)}).validate()
    SampleBatch(**{**b.__dict__, "step_versions": np.array([3, 3, 4, 6], np.int64)}).validate()


# -- a mixed-version fragment downstream ---------------------------------------------------------

def mixed_fragment(old: Policy, new: Policy, T: int = 8, N: int = 2) -> SampleBatch:
    """Steps 0..3 acted with version 3 (``old``), steps 4.. with version 5 (``new``)."""
    rng = np.random.default_rng(0)
    b = sample_batch(T=T, N=N, obs_dim=3, act_dim=1, policy_version=3)
    obs = rng.standard_normal((T, N, 3), dtype=np.float32)
    actions = rng.standard_normal((T, N, 1), dtype=np.float32)
    versions = np.array([3] * 4 + [5] * (T - 4), np.int64)
    b = SampleBatch(**{**b.__dict__, "obs": obs, "actions": actions, "group_ids": None, "step_versions": versions})
    logp = np.where(versions[:, None] == 3, logp_of(old, b, slice(None)), logp_of(new, b, slice(None)))
    b = SampleBatch(**{**b.__dict__, "behaviour_logp": logp.astype(np.float32)})
    b.validate()
    return b


def test_processors_weight_each_step_against_its_own_behaviour_version():
    """The processors know version 5: steps that acted with 5 get IS weight 1, those of version 3
    pi_5/pi_3 (truncated); the fragment's staleness is its oldest step's (conservative)."""
    old, new = policy(0, 0.0), policy(1, -0.7)
    prepare = Prepare.from_config(PrepareConfig.for_algo("tba"), logp_factory=PolicyLogpFn.from_policy_version,
                                  clock=lambda: 1_700_000_000_100)
    for v, p in ((3, old), (5, new)):
        prepare.on_policy(make_policy_version(p, policy_id="policy", version=v, parent_version=None,
                                              learner_id="test", algo="tba"))
    b = mixed_fragment(old, new)
    (pb,) = prepare.push(b, 0, 0)
    assert isinstance(pb, PreparedBatch)
    assert (pb.current_version, pb.staleness_versions) == (5, 2)
    np.testing.assert_allclose(pb.is_rho[4:], 1.0, rtol=1e-5)
    want = np.minimum(1.0, np.exp(logp_of(new, b, slice(0, 4)) - b.behaviour_logp[:4]))
    np.testing.assert_allclose(pb.is_rho[:4], want, rtol=1e-4)
    assert (pb.is_rho[:4] < 0.99).any()


def test_the_learner_decays_each_step_by_its_own_version_lag():
    """TBA's per-sample staleness weights: steps of version 3 lag the weighting version 5 by 2,
    those of version 5 by 0 -- not the fragment's one lag of 2 for all."""
    old, new = policy(0, 0.0), policy(1, -0.7)
    b = mixed_fragment(old, new)
    pb = PreparedBatch(sample=b, current_version=5, staleness_versions=2, staleness_ms=0,
                       is_rho=np.ones((8, 2), np.float32), is_c=np.ones((8, 2), np.float32), prepared_at_ms=0)
    np.testing.assert_array_equal(step_staleness(pb), [2, 2, 2, 2, 0, 0, 0, 0])
    # a newer step than the weighting version is not stale; one version fragment: its lag throughout
    ahead = PreparedBatch(**{**pb.__dict__, "current_version": 4, "staleness_versions": 1})
    np.testing.assert_array_equal(step_staleness(ahead), [1, 1, 1, 1, 0, 0, 0, 0])
    single = PreparedBatch(**{**pb.__dict__, "sample": SampleBatch(**{**b.__dict__, "step_versions": None})})
    np.testing.assert_array_equal(step_staleness(single), [2] * 8)

    batch = to_trajectory_batch([pb], StreamIds())
    assert batch.staleness_versions.dtype == torch.float32
    np.testing.assert_array_equal(batch.staleness_versions[:, 0].numpy(), [2, 2, 2, 2, 0, 0, 0, 0])
    tba = make_algorithm("tba", 3, 1)
    w = tba._sample_weights(batch)
    lags = torch.tensor([2.0] * 4 + [0.0] * 4)[:, None].expand(8, 2)
    c = tba.config
    want = staleness_weights(lags, torch.zeros(8, 2), c.staleness_schedule, c.version_decay, c.half_life_ms,
                             c.max_versions, c.max_ms, c.min_weight)
    torch.testing.assert_close(w, want)
    assert (w[4:] == 1).all() and (w[:4] < 1).all()
    stats = tba.update(batch)  # a mixed-version batch trains
    assert all(np.isfinite(v) for v in stats.values())
