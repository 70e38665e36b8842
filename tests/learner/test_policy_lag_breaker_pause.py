"""The policy-lag breaker beside the backlog breaker (tests/learner/test_policy_lag_breaker.py):
while the backlog breaker holds polling, nothing is read and the policy lag is as it was, so the
policy-lag breaker is left alone; a half-open probe is not spent on a step that trains nothing.
And DPO, whose staleness window is unbounded, gets no policy-lag breaker by default."""

from __future__ import annotations

from config import TrainConfig
from learner.circuit_breaker import CircuitBreaker, State
from learner.snapshots.url import open_store
from tests.learner.test_learner import events, make  # noqa: F401 (fixture)
from tests.learner.test_policy_lag_breaker import Clock, feed


def test_a_backlog_pause_leaves_the_policy_lag_breaker_and_its_probe_alone(events, tmp_path):  # noqa: F811
    clock = Clock()
    backlog = [100.0]
    lr = make(events, open_store(tmp_path), snapshot_every=0)
    lr.breaker = CircuitBreaker(open_above=10, close_below=5, min_open_s=0.0, clock=clock)
    lr.lag_signal = lambda: backlog[0]
    pb = lr.policy_breaker = CircuitBreaker(open_above=2, close_below=1, min_open_s=1.0, clock=clock)
    lr.start()
    pb.update(5)  # tripped earlier on stale data ...
    clock.t += 1.0
    assert pb.update(0) is State.HALF_OPEN  # ... and now waiting for its probe update
    feed(events, 0, 0)
    for _ in range(3):  # the backlog is too long: polling held, nothing read, nothing trained
        assert lr.step(0) is None
    assert lr.stats.paused_polls == 3 and lr.buffered == 0
    assert pb.state is State.HALF_OPEN and pb.trips == 1  # untouched: its probe is still to come
    assert pb.allow() is True and pb.allow() is False  # the probe is still there to grant (once)


def test_dpo_gets_no_policy_lag_breaker_by_default():
    cfg = TrainConfig(algo="dpo")
    assert cfg.prepare_config().max_versions >= 1 << 20  # nothing is ever stale for DPO
    assert cfg.policy_lag_bound() is None
    assert TrainConfig(algo="dpo", breaker_policy_lag_versions=3).policy_lag_bound() == 3  # unless asked
