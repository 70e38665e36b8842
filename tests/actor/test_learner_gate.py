"""LearnerGate: an actor never runs more than ``max_steps_ahead`` env steps ahead of the learner."""

from __future__ import annotations

import pytest

from actor.flow import LearnerGate, OnPolicySync


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_gate_holds_the_actor_until_the_version_advances():
    clock = Clock()
    stalls = []
    inner = OnPolicySync(max_batches_per_version=100, max_wait_s=1.0, clock=clock)
    gate = LearnerGate(inner, max_steps_ahead=100, num_envs=2, clock=clock,
                       on_stall=lambda v, ahead: stalls.append((v, ahead)))
    published = 0
    for _ in range(10):
        if gate.allow(3):
            gate.on_published(20, 3)  # 20 steps x 2 envs
            published += 40
    assert published == 120  # the third fragment passed at 80 < 100; nothing after
    assert gate.stalled and stalls == [(3, 120)]
    clock.t = 50.0  # no time-out: a stalled learner holds the actor for as long as it stalls
    assert not gate.allow(3) and gate.stalled_for() == 50.0
    assert gate.allow(4) and not gate.stalled  # a newer version: the learner caught up
    s = gate.stats()
    assert s["learner_stalls"] == 1 and s["learner_stalled_s"] == 50.0 and s["learner_steps_ahead"] == 0
    assert s["flow"] == "on_policy_sync" and s["stalled"] is False


def test_gate_defers_to_the_inner_flow():
    clock = Clock()
    inner = OnPolicySync(max_batches_per_version=1, max_wait_s=5.0, clock=clock)
    gate = LearnerGate(inner, max_steps_ahead=10_000, clock=clock)
    assert gate.allow(0)
    gate.on_published(10, 0)
    assert not gate.allow(0) and not gate.stalled  # the inner flow waits, not the gate
    with pytest.raises(ValueError):
        LearnerGate(inner, max_steps_ahead=0)


def test_budget_cuts_the_last_fragment_and_stops_the_actor():
    inner = OnPolicySync(max_batches_per_version=1000, max_wait_s=1.0)
    gate = LearnerGate(inner, max_steps_ahead=10_000, num_envs=4, budget=250)
    total = 0
    while not gate.exhausted:
        assert gate.allow(0)
        steps = gate.fragment_steps(32)
        gate.on_published(steps, 0)
        total += steps * 4
    assert total == 248  # 32+32 steps per env, then the 62 left; never past the budget
    assert not gate.allow(0)


def test_gate_lets_a_starved_learner_have_more_data():
    """Past the bound, the actor waits only while records queue up end to end."""
    clock = Clock()
    backlog = [10.0]
    inner = OnPolicySync(max_batches_per_version=100, max_wait_s=1.0, clock=clock)
    gate = LearnerGate(inner, max_steps_ahead=50, backlog=lambda: backlog[0], max_backlog=2,
                       check_every_s=1.0, clock=clock)
    assert gate.allow(0)
    gate.on_published(50, 0)
    assert not gate.allow(0) and gate.stalled  # 50 ahead, 10 records unconsumed: the learner is behind
    backlog[0] = 1.0
    assert not gate.allow(0)  # the backlog is read at most every check_every_s
    clock.t = 1.0
    assert gate.allow(0) and not gate.stalled  # consumed, yet no new version: it needs more data
    assert gate.stats()["learner_stalled_s"] == 1.0

    def broken() -> float:
        raise RuntimeError("broker down")

    gate = LearnerGate(inner, max_steps_ahead=1, backlog=broken, max_backlog=2, clock=clock)
    gate.allow(0)
    gate.on_published(1, 0)
    assert not gate.allow(0) and gate.gate.backlog_errors == 1  # unknown backlog: assume behind
