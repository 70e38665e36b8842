"""Actor flow control (actor/flow.py): on-policy version sync, backpressure, dynamic fragment length."""

from __future__ import annotations

import re

import pytest
import torch

from actor.actor import Actor, ActorConfig
from actor.envs import make_vector_env
from actor.flow import Backpressure, LearnerGate, OnPolicySync
from actor.policy_client import PolicySubscriber
from agents.networks import Policy
from actor.fragment_size import FragmentSizeController
from rlstream import wiring
from config import TrainConfig
from runtime.metrics import Metrics
from streams.policies import make_policy_version
from schemas.codec import Codec
from streams.bus.memory import MemoryBus
from streams.events import EventBus
from streams.topics import POLICY_VERSIONS, SAMPLES_RAW, STREAMS_GROUP, all_topics

torch.set_num_threads(1)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_on_policy_sync_waits_after_its_share_and_times_out():
    clock = Clock()
    timeouts = []
    f = OnPolicySync(max_batches_per_version=2, max_wait_s=5.0, clock=clock,
                     on_timeout=lambda v, w: timeouts.append((v, w)))
    assert f.allow(0)
    f.on_published(64, 0)
    assert f.allow(0)
    f.on_published(64, 0)
    assert not f.allow(0)  # share of version 0 sent: wait
    clock.t = 2.0
    assert not f.allow(0)
    assert f.allow(1)  # a newer version ends the wait
    assert f.sync.waits == 1 and f.sync.wait_s == pytest.approx(2.0)
    f.on_published(64, 1)
    f.on_published(64, 1)
    assert not f.allow(1)
    clock.t = 7.5  # no version for 5.5 s: one more fragment under version 1, then wait again
    assert f.allow(1) and timeouts == [(1, pytest.approx(5.5))]
    f.on_published(64, 1)
    assert not f.allow(1)
    assert f.stats()["timeouts"] == 1 and f.stats()["waits"] == 3


def test_backpressure_pauses_above_bound_and_resumes_at_half():
    clock = Clock()
    lag = {"v": 0.0}
    reads = []

    def backlog():
        reads.append(clock.t)
        if lag["v"] < 0:
            raise RuntimeError("broker away")
        return lag["v"]

    f = Backpressure(backlog, max_backlog=10, check_every_s=1.0, clock=clock)
    assert f.allow(0)
    lag["v"] = 50
    assert f.allow(0)  # cached reading (checked at most once a second while producing)
    clock.t = 1.0
    assert not f.allow(0) and f.paused and f.pressure.pauses == 1
    lag["v"] = 8
    clock.t = 1.1
    assert not f.allow(0)  # paused: read every time, resume only at <= 5
    lag["v"] = 5
    clock.t = 1.5
    assert f.allow(0) and not f.paused and f.pressure.paused_s == pytest.approx(0.5)
    lag["v"] = -1  # a failed read keeps the last value
    clock.t = 3.0
    assert f.allow(0) and f.pressure.backlog_errors == 1
    assert f.fragment_steps(77) == 77  # no size controller: the actor's own length


def test_build_flow_follows_the_algorithm():
    bus = MemoryBus()
    bus.create_topics(all_topics())
    gate = wiring.build_flow(TrainConfig(algo="ppo", num_actors=2, train_batch_size=2048, fragment_steps=256),
                             bus, None)
    assert isinstance(gate, LearnerGate) and gate.max_steps_ahead == 4 * 2048
    ppo = gate.inner
    assert isinstance(ppo, OnPolicySync) and ppo.max_batches_per_version == 4  # 2048 / (2 actors x 256)
    assert wiring.build_flow(TrainConfig(algo="ppo", max_batches_per_version=3), bus,
                             None).inner.max_batches_per_version == 3
    agro = wiring.build_flow(TrainConfig(algo="agro", max_backlog=16), bus, None).inner
    assert isinstance(agro, Backpressure) and agro.max_backlog == 16
    assert isinstance(agro.sizes, FragmentSizeController) and agro.fragment_steps(2048) == 32
    fixed = wiring.build_flow(TrainConfig(algo="tba", fragment_steps=100), bus, None).inner
    assert fixed.sizes is None and fixed.fragment_steps(100) == 100


@pytest.fixture
def events():
    bus = MemoryBus()
    bus.create_topics(all_topics())
    return EventBus(bus, Codec())


def publish_policy(events: EventBus, version: int) -> None:
    torch.manual_seed(0)
    pv = make_policy_version(Policy(3, 1, hidden=(8,)), policy_id="policy", version=version, parent_version=None,
                             learner_id="test", algo="ppo")
    events.publish(POLICY_VERSIONS, pv, key="policy")


def make_actor(events: EventBus, flow, fragment_steps: int = 16) -> Actor:
    sub = PolicySubscriber(events, policy_id="policy", stage="test")
    cfg = ActorConfig(actor_id="actor-0", env_id="Pendulum-v1", fragment_steps=fragment_steps)
    assert sub.wait_for(0, timeout=5.0)
    return Actor(cfg, sub, events, env=make_vector_env("Pendulum-v1", 1), flow=flow)


def test_actor_waits_for_a_newer_version_after_its_share(events):
    publish_policy(events, 0)
    actor = make_actor(events, OnPolicySync(max_batches_per_version=2, max_wait_s=60, poll_s=0.01))
    try:
        got = [actor.step() for _ in range(4)]
        assert [b.policy_version for b in got if b is not None] == [0, 0]
        assert got[2] is None and got[3] is None
        publish_policy(events, 1)
        b = actor.step()
        assert b is not None and b.policy_version == 1 and b.seq == 2
    finally:
        actor.close()


def test_dynamic_fragment_length_grows_under_backlog_and_shrinks_when_drained(events):
    """The processors' group falls behind (reads nothing): fragments grow 32 -> 256; it catches up
    (reads and commits everything): they shrink back to 32. Reported as set_fragment_length."""
    bus = events.bus
    publish_policy(events, 0)
    metrics = Metrics(role="actor")
    sizes: list[int] = []

    def on_size(n: int) -> None:
        metrics.set_fragment_length(n)
        sizes.append(n)

    flow = Backpressure(lambda: bus.group_lag(STREAMS_GROUP, SAMPLES_RAW), max_backlog=10_000, check_every_s=0.0,
                        sizes=FragmentSizeController(patience=2, cooldown=2, smoothing=0.5), on_size=on_size,
                        poll_s=0.01)
    actor = make_actor(events, flow)
    slow = bus.consumer(STREAMS_GROUP, [SAMPLES_RAW])  # the stream processors, stalled

    def gauge() -> float:
        m = re.search(r'^rlstream_fragment_length\{role="actor"\} (\S+)$', metrics.render().decode(), re.MULTILINE)
        return float(m.group(1))

    try:
        lengths = []
        while flow.sizes.size < 256:
            b = actor.step()
            lengths.append(b.num_steps)
            assert len(lengths) < 40, f"never grew to 256: {sizes}"
        assert lengths[0] == 32 and sorted(set(sizes)) == [32, 64, 128, 256]
        assert gauge() == 256 and bus.group_lag(STREAMS_GROUP, SAMPLES_RAW) == len(lengths)
        grown = len(sizes)
        while flow.sizes.size > 32:
            slow.poll(0.0, max_records=10_000)  # caught up: read and commit everything
            slow.commit()
            b = actor.step()
            assert b is not None and len(sizes) - grown < 40, f"never shrank to 32: {sizes[grown:]}"
        shrink = sizes[grown:]
        assert shrink == sorted(shrink, reverse=True) and shrink[-1] == 32 and gauge() == 32
        assert flow.stats()["size_changes"] == 6 and flow.pressure.pauses == 0
    finally:
        slow.close()
        actor.close()
