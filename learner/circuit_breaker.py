"""Circuit breaker on a lag signal, with hysteresis: a pure state machine.

The learner pauses gradient steps while the lag it is fed (policy lag in
versions or ms, or consumer lag in messages: any float where higher is worse)
is too high, and resumes once it has recovered::

    breaker = CircuitBreaker(open_above=8, close_below=4, min_open_s=5.0,
                             on_change=metrics.circuit_breaker_hook())
    while running:
        breaker.update(current_lag())
        if not breaker.allow():
            wait_a_little()          # keep consuming/heartbeating, skip the step
            continue
        step()

States::

    CLOSED --lag > open_above--> OPEN --(open >= min_open_s and lag < close_below)--> HALF_OPEN
    HALF_OPEN: allow() grants exactly one probe step
    HALF_OPEN --probe taken, lag < close_below--> CLOSED
    HALF_OPEN --lag >= close_below--> OPEN (the open timer restarts; counted as a trip)

Why hysteresis: with one threshold, a lag that hovers around it would flip the
breaker every update. Opening above ``open_above`` but closing only below
``close_below < open_above`` (and never before ``min_open_s``) means a signal
has to move across the whole band to change the state, so noise inside the
band cannot cause flapping. The half-open probe checks that stepping again
does not immediately push the lag back up before fully closing.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["BreakerStatus", "CircuitBreaker", "State"]


class State(enum.IntEnum):
    """Breaker state; the int value is what ``rlstream_circuit_breaker_state`` exports."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


@dataclass(frozen=True)
class BreakerStatus:
    """A snapshot for logs and ``/readyz`` details."""

    state: State
    lag: float | None
    trips: int
    open_for_s: float | None


class CircuitBreaker:
    """Hysteresis breaker over a generic lag signal.

    Args:
        open_above: trip (open) when the lag rises strictly above this.
        close_below: recover only when the lag falls strictly below this;
            must be ``<= open_above`` (the gap is the hysteresis band).
        min_open_s: stay open at least this long after tripping.
        clock: monotonic clock in seconds (tests pass a fake).
        on_change: called as ``on_change(old_state, new_state)`` on every
            transition (e.g. ``Metrics.circuit_breaker_hook()``).
    """

    def __init__(
        self,
        open_above: float,
        close_below: float,
        min_open_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[State, State], None] | None = None,
    ) -> None:
        if close_below > open_above:
            raise ValueError(f"close_below ({close_below}) must be <= open_above ({open_above})")
        if min_open_s < 0:
            raise ValueError("min_open_s must be >= 0")
        self.open_above = float(open_above)
        self.close_below = float(close_below)
        self.min_open_s = float(min_open_s)
        self._clock = clock
        self._on_change = on_change
        self._state = State.CLOSED
        self._opened_at: float | None = None
        self._probe_granted = False
        self._lag: float | None = None
        self.trips = 0
        if on_change is not None:
            on_change(State.CLOSED, State.CLOSED)  # publish the initial state

    @property
    def state(self) -> State:
        return self._state

    def update(self, lag: float) -> State:
        """Feed the latest lag; returns the (possibly new) state."""
        lag = float(lag)
        if math.isnan(lag):
            raise ValueError("lag is NaN")
        self._lag = lag
        now = self._clock()
        if self._state is State.CLOSED:
            if lag > self.open_above:
                self._open(now)
        elif self._state is State.OPEN:
            assert self._opened_at is not None
            if now - self._opened_at >= self.min_open_s and lag < self.close_below:
                self._probe_granted = False
                self._transition(State.HALF_OPEN)
        else:  # HALF_OPEN
            if lag >= self.close_below:
                self._open(now)
            elif self._probe_granted:
                self._transition(State.CLOSED)
        return self._state

    def allow(self) -> bool:
        """May the learner take a step now? In HALF_OPEN, true once (the probe)."""
        if self._state is State.CLOSED:
            return True
        if self._state is State.HALF_OPEN and not self._probe_granted:
            self._probe_granted = True
            return True
        return False

    def status(self) -> BreakerStatus:
        open_for = None if self._opened_at is None else self._clock() - self._opened_at
        return BreakerStatus(self._state, self._lag, self.trips, open_for)

    def _open(self, now: float) -> None:
        self._opened_at = now
        self.trips += 1
        self._transition(State.OPEN)

    def _transition(self, new: State) -> None:
        old, self._state = self._state, new
        if new is State.CLOSED:
            self._opened_at = None
        if self._on_change is not None and old is not new:
            self._on_change(old, new)
