"""The circuit breaker on policy lag: the learner holds updates while the newest data it reads
was collected too many versions behind its policy, reads on meanwhile, and resumes once the
actors' data is fresh again; a full buffer trains anyway (no wait for data it will not read)."""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np
import pytest

from config import TrainConfig
from learner.circuit_breaker import CircuitBreaker, State
from learner.snapshots.url import open_store
from rlstream import wiring
from runtime.metrics import Metrics
from schemas.events import PolicyVersion
from streams.topics import POLICY_VERSIONS, SAMPLES_PREPARED
from tests.learner.test_learner import N, T, events, make, prepared  # noqa: F401 (fixture)


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def published(events) -> list[int]:
    return [events.codec.decode(r.value, PolicyVersion).version for r in events.bus.read_all(POLICY_VERSIONS)]


def feed(events, seq: int, version: int) -> None:
    events.publish(SAMPLES_PREPARED, prepared(seq, version=version), key="actor-0")


def test_policy_lag_opens_the_breaker_holds_updates_and_fresh_data_resumes_training(events, tmp_path):  # noqa: F811
    clock = Clock()
    lr = make(events, open_store(tmp_path), snapshot_every=0)
    lr.policy_breaker = CircuitBreaker(open_above=2, close_below=1, min_open_s=1.0, clock=clock)
    lr.start()
    for seq in range(4):  # actors stuck on version 0 while the learner moves on: lag 0, 1, 2, 3
        feed(events, seq, 0)
        assert lr.step(0) is not None
    assert lr.version == 4 and lr.stats.policy_lag == 3
    feed(events, 4, 0)
    assert lr.step(0) is None  # lag 3 > 2: open; the batch is read (lag now 4) but not trained
    assert lr.policy_breaker.state is State.OPEN and lr.stats.policy_lag == 4
    assert lr.stats.policy_lag_holds == 1 and lr.buffered == T * N
    feed(events, 5, 1)  # one more stale and one fresh fragment in the same read: the fresh one counts
    feed(events, 6, 4)
    assert lr.step(0) is None and lr.stats.policy_lag == 0  # still open: min_open_s not over
    assert lr.version == 4 and published(events) == [0, 1, 2, 3, 4]
    clock.t += 1.0
    assert lr.step(0) is not None  # half-open: the probe update trains all that waited
    assert lr.version == 5 and lr.buffered == 0
    feed(events, 7, 5)
    assert lr.step(0) is not None and lr.policy_breaker.state is State.CLOSED
    assert lr.policy_breaker.trips == 1 and lr.stats.policy_lag_overrides == 0
    s = lr.summary()["policy_lag_breaker"]
    assert (s["trips"], s["holds"], s["state"]) == (1, lr.stats.policy_lag_holds, "CLOSED")


def test_policy_lag_counts_a_mixed_version_fragment_by_its_newest_step(events, tmp_path):  # noqa: F811
    # an actor that adopted versions 1 and 3 mid-fragment (in-flight updates) acted last with 3
    lr = make(events, open_store(tmp_path), snapshot_every=0)
    lr.start()
    for seq in range(4):
        feed(events, seq, 0)
        assert lr.step(0) is not None
    assert lr.version == 4
    pb = prepared(4, version=1)
    steps = np.array([1] * (T - 2) + [3, 3], np.int64)
    events.publish(SAMPLES_PREPARED, replace(pb, sample=replace(pb.sample, step_versions=steps)), key="actor-0")
    lr.step(0)
    assert lr.stats.policy_lag == 4 - 3  # not 4 - 1, the fragment's oldest step


def test_a_full_buffer_trains_although_the_breaker_is_open(events, tmp_path):  # noqa: F811
    lr = make(events, open_store(tmp_path), snapshot_every=0)
    lr.policy_breaker = CircuitBreaker(open_above=0, close_below=0, min_open_s=60.0, clock=Clock())
    lr.hold_cap = 3 * T * N
    lr.start()
    for seq in (0, 1):  # lag 0 at each check: trained (the second read says lag 1)
        feed(events, seq, 0)
        assert lr.step(0) is not None
    for seq in (2, 3):  # open, and it stays so (the data is stale): held, read on
        feed(events, seq, 0)
        assert lr.step(0) is None
    assert lr.policy_breaker.state is State.OPEN and lr.stats.policy_lag_holds == 2
    feed(events, 4, 0)
    assert lr.step(0) is not None and lr.stats.policy_lag_overrides == 1  # 3 fragments waited: trained
    assert lr.policy_breaker.state is State.OPEN and lr.buffered == 0 and lr.version == 3


def test_the_bound_defaults_to_the_staleness_window_and_is_wired_in_build_learner(events, tmp_path):  # noqa: F811
    cfg = TrainConfig(algo="ppo", env_id="Pendulum-v1", run_dir=tmp_path)
    assert cfg.policy_lag_bound() == cfg.prepare_config().max_versions == 4
    assert TrainConfig(algo="grpo").policy_lag_bound() == 1
    assert TrainConfig(mode="decoupled", algo="ppo", actor_lag_versions=3).policy_lag_bound() is None  # stale on purpose
    assert TrainConfig(algo="ppo", breaker_policy_lag_versions=0).policy_lag_bound() is None
    assert TrainConfig(algo="ppo", breaker_policy_lag_versions=9).policy_lag_bound() == 9
    with pytest.raises(ValueError):
        TrainConfig(breaker_policy_lag_versions=-1)
    metrics = Metrics(role="learner", gpu=False)
    algo = wiring.build_algo(cfg, 3, 1)
    lr = wiring.build_learner(replace(cfg, snapshot_store=str(tmp_path / "snaps")), events, metrics, algo)
    assert (lr.policy_breaker.open_above, lr.policy_breaker.close_below) == (4.0, 2.0)
    lr.policy_breaker.update(5)  # the metrics hook is wired: a trip shows on the learner's gauge
    assert metrics.render().decode().count('rlstream_circuit_breaker_trips_total{role="learner"} 1.0') == 1
    off = wiring.build_learner(replace(cfg, breaker_policy_lag_versions=0, snapshot_store=str(tmp_path / "s2")),
                               events, None, algo)
    assert off.policy_breaker is None


def test_the_bound_is_a_training_flag():
    from rlstream.cli import parse_training

    a = argparse.Namespace(command="train", help=False)
    parse_training(a, ["--breaker-policy-lag-versions", "6"])
    assert a.train.breaker_policy_lag_versions == 6
