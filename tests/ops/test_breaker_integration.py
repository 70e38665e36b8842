"""Circuit breaker end to end on the memory bus: a real backlog pauses and resumes the learner.

The wiring is decoupled mode's (``rlstream.decoupled.run_learner``): the breaker's lag signal is
the stream processors' group backlog on rl.samples.raw, read from the bus. Here the processors
(a ``PrepareWorker`` in that group) stop consuming while samples keep arriving: the backlog
grows past ``open_above``, the breaker opens and the learner takes no update although prepared
batches are waiting for it; the processors come back, the backlog drains, and after
``min_open_s`` the breaker half-opens, the probe update goes through, it closes, and training
catches up on everything.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from agents.registry import make_algorithm
from learner.circuit_breaker import CircuitBreaker, State
from learner.learner import Learner, LearnerConfig
from rlstream.wiring import consumer_lag_gauge
from runtime.metrics import Metrics
from schemas.codec import Codec
from schemas.events import SampleBatch, new_id, now_ms
from streams.bus.memory import MemoryBus
from streams.events import EventBus
from streams.policies import PolicyLogpFn
from config import PrepareConfig
from streams.processors.pipeline import Prepare
from streams.topics import (
    LEARNER_STEPS,
    SAMPLES_PREPARED,
    SAMPLES_RAW,
    STREAMS_GROUP,
    all_topics,
)
from streams.worker import PrepareWorker

torch.set_num_threads(1)
T, N, OBS, ACT = 8, 2, 3, 1
OPEN_ABOVE, CLOSE_BELOW, MIN_OPEN_S = 6, 2, 5.0


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


RNG = np.random.default_rng(0)


def sample(seq: int) -> SampleBatch:
    rng = RNG
    return SampleBatch(
        batch_id=new_id(), actor_id="actor-0", seq=seq, env_id="Pendulum-v1", policy_version=0,
        created_at_ms=now_ms(), obs=rng.normal(size=(T, N, OBS)).astype(np.float32),
        actions=rng.normal(size=(T, N, ACT)).astype(np.float32), rewards=rng.normal(size=(T, N)).astype(np.float32),
        terminated=np.zeros((T, N), bool), truncated=np.zeros((T, N), bool),
        behaviour_logp=np.full((T, N), -1.0, np.float32), last_obs=np.zeros((N, OBS), np.float32),
        final_obs_index=np.zeros(0, np.int64), final_obs=np.zeros((0, OBS), np.float32),
    )


def gauge(metrics: Metrics, name: str, **labels: str) -> float:
    text = metrics.render().decode()
    sel = ",".join(f'{k}="{v}"' for k, v in sorted({"role": metrics.role, **labels}.items()))
    for line in text.splitlines():
        if line.startswith(name + "{"):
            got = dict(re.findall(r'(\w+)="([^"]*)"', line[len(name) + 1:line.index("}")]))
            if got == {"role": metrics.role, **labels}:
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name}{{{sel}}} in:\n{text}")


def test_backlog_opens_the_breaker_pauses_updates_and_training_resumes_after_it_drains(tmp_path):
    bus = MemoryBus()
    bus.create_topics(all_topics())
    events = EventBus(bus, Codec())
    metrics = Metrics(role="learner", gpu=False)
    clock = Clock()
    hook = metrics.circuit_breaker_hook()
    transitions: list[tuple[State, State]] = []

    def on_change(old, new):
        transitions.append((State(old), State(new)))
        hook(old, new)

    breaker = CircuitBreaker(OPEN_ABOVE, CLOSE_BELOW, MIN_OPEN_S, clock=clock, on_change=on_change)
    lag = consumer_lag_gauge(metrics, bus, STREAMS_GROUP, SAMPLES_RAW)
    algo = make_algorithm("ppo", OBS, ACT, {"num_minibatches": 1, "update_epochs": 1}, "cpu")
    learner = Learner(LearnerConfig(train_batch_size=T * N, snapshot_every=0), algo, events,
                      breaker=breaker, lag_signal=lag)
    learner.start()
    prepare = Prepare.from_config(PrepareConfig(max_versions=1000, max_ms=None), PolicyLogpFn.from_policy_version)
    worker = PrepareWorker(events, prepare, group=STREAMS_GROUP)
    state = lambda: gauge(metrics, "rlstream_circuit_breaker_state")
    seq = 0

    def produce(n: int) -> None:
        nonlocal seq
        for _ in range(n):
            events.publish(SAMPLES_RAW, sample(seq), key="actor-0")
            seq += 1

    def drain_worker() -> None:
        while worker.step(0):
            pass

    def trained() -> list[str]:
        return [i for r in bus.read_all(LEARNER_STEPS) for i in events.codec.decode(r.value).batch_ids]

    # 1. healthy: the processors keep up and the learner trains what they prepare
    produce(3)
    drain_worker()
    learner.step(0)
    assert len(trained()) == 3 and state() == State.CLOSED
    updates = learner.stats.updates

    # 2. the processors prepare 4 more, then stop consuming while samples keep arriving
    produce(4)
    drain_worker()
    produce(OPEN_ABOVE + 2)
    assert bus.group_lag(STREAMS_GROUP, SAMPLES_RAW) == OPEN_ABOVE + 2
    assert bus.end_offsets(SAMPLES_PREPARED)[0] - len(trained()) == 4  # waiting for the learner
    for _ in range(20):
        assert learner.step(0) is None
        clock.t += 0.1
    assert breaker.state is State.OPEN and state() == State.OPEN
    assert learner.stats.updates == updates and len(trained()) == 3, "an update went through while open"
    assert learner.stats.paused_polls == 20
    assert gauge(metrics, "rlstream_consumer_lag", group=STREAMS_GROUP, topic=SAMPLES_RAW) == OPEN_ABOVE + 2
    assert gauge(metrics, "rlstream_circuit_breaker_trips_total") == 1

    # 3. the processors come back and drain the backlog; the breaker stays open for min_open_s
    drain_worker()
    assert bus.group_lag(STREAMS_GROUP, SAMPLES_RAW) == 0
    assert learner.step(0) is None
    assert breaker.state is State.OPEN and learner.stats.updates == updates  # open for 2 s only
    assert gauge(metrics, "rlstream_consumer_lag", group=STREAMS_GROUP, topic=SAMPLES_RAW) == 0

    # 4. past min_open_s: half-open, one probe update, then closed; training catches up
    clock.t += MIN_OPEN_S
    assert learner.step(0) is not None and learner.stats.updates == updates + 1
    assert breaker.state is State.HALF_OPEN and state() == State.HALF_OPEN
    learner.step(0)
    assert breaker.state is State.CLOSED and state() == State.CLOSED
    assert transitions == [(State.CLOSED, State.CLOSED), (State.CLOSED, State.OPEN),
                           (State.OPEN, State.HALF_OPEN), (State.HALF_OPEN, State.CLOSED)]
    produce(2)
    drain_worker()
    for _ in range(3):
        learner.step(0)
    total = 3 + 4 + OPEN_ABOVE + 2 + 2
    produced = [events.codec.decode(r.value).batch_id for r in bus.read_all(SAMPLES_RAW)]
    assert sorted(trained()) == sorted(produced) and len(set(trained())) == total
    assert gauge(metrics, "rlstream_circuit_breaker_trips_total") == 1
    learner.close()
    worker.close()
