from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.circuit_breaker import CircuitBreaker, State


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make(**kw):
    clock = FakeClock()
    changes: list[tuple[State, State]] = []
    cb = CircuitBreaker(
        open_above=kw.get("open_above", 10.0),
        close_below=kw.get("close_below", 4.0),
        min_open_s=kw.get("min_open_s", 5.0),
        clock=clock,
        on_change=lambda old, new: changes.append((old, new)),
    )
    return cb, clock, changes


def test_closed_allows_and_trips_when_lag_passes() -> None:
    cb, clock, changes = make()
    assert changes == [(State.CLOSED, State.CLOSED)]  # initial state published
    assert cb.update(3) is State.CLOSED and cb.allow()
    assert cb.update(10) is State.CLOSED  # at the threshold, not above
    assert cb.update(10.5) is State.OPEN
    assert not cb.allow() and cb.trips == 1
    assert changes[-1] == (State.CLOSED, State.OPEN)


def test_stays_paused_for_min_open_even_if_lag_recovers() -> None:
    cb, clock, _ = make()
    cb.update(20)
    for _ in range(4):
        clock.t += 1.0
        assert cb.update(0) is State.OPEN  # recovered, but only 4 s < 5 s open
        assert not cb.allow()
    clock.t += 1.0
    assert cb.update(0) is State.HALF_OPEN


def test_stays_paused_while_lag_is_in_the_band() -> None:
    cb, clock, _ = make()
    cb.update(20)
    clock.t += 60
    for lag in (9, 6, 4.0, 7):  # below open_above but not below close_below
        assert cb.update(lag) is State.OPEN
        assert not cb.allow()


def test_half_open_allows_one_probe_then_closes_if_lag_stays_fine() -> None:
    cb, clock, changes = make()
    cb.update(20)
    clock.t += 5
    assert cb.update(1) is State.HALF_OPEN
    assert cb.update(1) is State.HALF_OPEN  # no probe taken yet: wait for it
    assert cb.allow() is True
    assert cb.allow() is False  # exactly one probe
    assert cb.update(2) is State.CLOSED
    assert cb.allow() and cb.allow()
    assert [new for _, new in changes] == [State.CLOSED, State.OPEN, State.HALF_OPEN, State.CLOSED]
    assert cb.trips == 1


def test_half_open_reopens_if_lag_jumps_back() -> None:
    cb, clock, _ = make()
    cb.update(20)
    clock.t += 5
    cb.update(1)
    assert cb.allow()
    assert cb.update(15) is State.OPEN
    assert cb.trips == 2 and not cb.allow()
    # the open timer restarted
    clock.t += 4
    assert cb.update(0) is State.OPEN
    clock.t += 1
    assert cb.update(0) is State.HALF_OPEN


def test_half_open_back_in_band_reopens() -> None:
    cb, clock, _ = make()
    cb.update(20)
    clock.t += 5
    cb.update(1)
    cb.allow()
    assert cb.update(5) is State.OPEN


def test_no_flapping_around_the_open_threshold() -> None:
    cb, clock, changes = make(min_open_s=0.0)
    cb.update(11)  # trip once
    for i in range(200):  # noise around open_above: 9.5 .. 10.5
        clock.t += 0.1
        cb.update(10 + (0.5 if i % 2 else -0.5))
        assert not cb.allow()
    assert cb.trips == 1 and len(changes) == 2


def test_no_flapping_around_the_close_threshold() -> None:
    cb, clock, changes = make(min_open_s=0.0)
    for i in range(200):  # noise around close_below while closed never opens
        clock.t += 0.1
        cb.update(4 + (0.5 if i % 2 else -0.5))
        assert cb.allow()
    assert cb.trips == 0 and len(changes) == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=100, allow_nan=False), min_size=1, max_size=60))
def test_invariants_under_any_lag_sequence(lags: list[float]) -> None:
    cb, clock, changes = make(min_open_s=2.0)
    for lag in lags:
        clock.t += 0.5
        before = cb.state
        after = cb.update(lag)
        if before is State.CLOSED and after is State.OPEN:
            assert lag > cb.open_above
        if after is State.HALF_OPEN and before is State.OPEN:
            assert lag < cb.close_below
        if after is State.CLOSED and before is not State.CLOSED:
            assert lag < cb.close_below
        if after is State.OPEN:
            assert not cb.allow()
    assert cb.trips == sum(1 for _, new in changes if new is State.OPEN)


def test_validation_and_status() -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(open_above=1, close_below=2, min_open_s=0)
    with pytest.raises(ValueError):
        CircuitBreaker(open_above=2, close_below=1, min_open_s=-1)
    cb, clock, _ = make()
    with pytest.raises(ValueError):
        cb.update(math.nan)
    cb.update(50)
    clock.t += 3
    st_ = cb.status()
    assert st_.state is State.OPEN and st_.lag == 50 and st_.trips == 1 and st_.open_for_s == 3
    assert int(State.CLOSED) == 0 and int(State.OPEN) == 1 and int(State.HALF_OPEN) == 2


def test_feeds_the_metrics_hook() -> None:
    from runtime.metrics import Metrics

    m = Metrics(role="learner", gpu=False)
    clock = FakeClock()
    cb = CircuitBreaker(8, 4, 1.0, clock=clock, on_change=m.circuit_breaker_hook())
    cb.update(9)
    text = m.render().decode()
    assert 'rlstream_circuit_breaker_state{role="learner"} 1.0' in text
    assert 'rlstream_circuit_breaker_trips_total{role="learner"} 1.0' in text
