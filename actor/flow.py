"""Flow control of a decoupled actor: when it may collect its next fragment, and how long it is.

    flow = OnPolicySync(max_batches_per_version=1, max_wait_s=20)          # PPO, GRPO, DAPO
    flow = Backpressure(backlog=lambda: bus.group_lag(STREAMS_GROUP, SAMPLES_RAW),
                        max_backlog=64, sizes=FragmentSizeController())       # AGRO, TBA
    actor = Actor(config, subscriber, events, flow=flow)
    while not stop.is_set():
        actor.step()      # None while the flow holds the actor back (it waited up to flow.poll_s)

Co-located mode needs neither: one driver steps actor, processors and learner in turn.

* ``OnPolicySync``: after ``max_batches_per_version`` fragments collected with one policy version
  (the actor's share of one learner batch), wait for a newer version. The wait is bounded: after
  ``max_wait_s`` one more fragment is let through under the old version (counted in
  ``timeouts``), so a batch lost on the way (dropped, dead-lettered) cannot stall training
  for good. Without it a decoupled actor free-runs ahead of the learner and nearly everything
  it sends is dropped as stale.
* ``Backpressure``: free-running, but pause while the stream processors' backlog on
  ``rl.samples.raw`` (records their group has not committed) is above ``max_backlog``, and
  resume once it is back to ``resume_below`` (hysteresis). With ``sizes`` (a
  ``actor.fragment_size.FragmentSizeController``, or anything with ``size`` and
  ``update(backlog)``), the fragment length follows the backlog too: longer fragments when
  records queue up (less per-record overhead), shorter ones when the processors keep up
  (fresher data). ``on_size`` reports every size (``Metrics.set_fragment_length``).

* ``LearnerGate`` wraps either and watches end-to-end progress: the learner publishes a new
  policy version per update, so env steps an actor published since the version it follows last
  advanced are steps the learner has not caught up on. Past ``max_steps_ahead`` the actor waits
  for a newer version, without a time-out, as long as the end-to-end ``backlog`` (records the
  processors and the learner have not consumed) is above ``max_backlog``: a stalled (or absent)
  learner holds its actors back, while a learner that has consumed everything and still waits
  for data (a fragment was lost or dropped) gets more. ``stalled`` says so, for progress lines
  and ``/readyz``. With ``budget`` it also
  ends the actor's run: fragments are cut to what is left of it, so an actor never publishes
  more env steps than its budget, and ``exhausted`` tells the loop to stop.

All are pure apart from the injected ``clock`` and ``backlog`` callables.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol


class Flow(Protocol):
    """What an ``Actor`` asks before each fragment."""

    poll_s: float
    """How long the actor waits for a policy version (or room) when held back, per step."""

    def allow(self, version: int) -> bool:
        """May the actor collect a fragment with policy ``version`` now?"""

    def fragment_steps(self, default: int) -> int:
        """Steps per env of the next fragment."""

    def on_published(self, num_steps: int, version: int) -> None:
        """A fragment of ``num_steps`` collected with ``version`` was published."""

    def stats(self) -> dict[str, Any]:
        ...


@dataclass
class SyncStats:
    waits: int = 0
    """Times the actor had published its share and waited for a newer version."""
    wait_s: float = 0.0
    """Seconds spent waiting (completed waits)."""
    timeouts: int = 0
    """Waits that ran out (``max_wait_s``) and let a fragment through under the old version."""


class OnPolicySync:
    """Wait for a newer policy version after ``max_batches_per_version`` fragments. See the module
    docstring."""

    def __init__(self, max_batches_per_version: int = 1, max_wait_s: float = 20.0, poll_s: float = 0.1,
                 clock: Callable[[], float] = time.monotonic, on_timeout: Callable[[int, float], None] | None = None
                 ) -> None:
        if max_batches_per_version < 1:
            raise ValueError("max_batches_per_version must be >= 1")
        if max_wait_s <= 0 or poll_s <= 0:
            raise ValueError("max_wait_s and poll_s must be > 0")
        self.max_batches_per_version = int(max_batches_per_version)
        self.max_wait_s = float(max_wait_s)
        self.poll_s = float(poll_s)
        self.clock = clock
        self.on_timeout = on_timeout
        self._version: int | None = None
        self._published = 0  # fragments published under _version
        self._waiting_since: float | None = None
        self.sync = SyncStats()

    def allow(self, version: int) -> bool:
        now = self.clock()
        if version != self._version:
            if self._waiting_since is not None:
                self.sync.wait_s += now - self._waiting_since
                self._waiting_since = None
            self._version, self._published = version, 0
        if self._published < self.max_batches_per_version:
            return True
        if self._waiting_since is None:
            self._waiting_since = now
            self.sync.waits += 1
            return False
        waited = now - self._waiting_since
        if waited < self.max_wait_s:
            return False
        self.sync.timeouts += 1
        self.sync.wait_s += waited
        self._waiting_since = None
        self._published -= 1  # one more fragment under this version, then wait again
        if self.on_timeout is not None:
            self.on_timeout(version, waited)
        return True

    def fragment_steps(self, default: int) -> int:
        return default

    def on_published(self, num_steps: int, version: int) -> None:
        if version == self._version:
            self._published += 1

    def stats(self) -> dict[str, Any]:
        return {"flow": "on_policy_sync", "max_batches_per_version": self.max_batches_per_version,
                **asdict(self.sync)}


class SizeController(Protocol):
    size: int

    def update(self, backlog: float, step_time_s: float | None = None) -> int: ...


@dataclass
class BackpressureStats:
    pauses: int = 0
    """Times production paused because the backlog passed ``max_backlog``."""
    paused_s: float = 0.0
    """Seconds spent paused (completed pauses)."""
    backlog_errors: int = 0
    """Backlog reads that failed (the last known value was kept)."""
    last_backlog: float = 0.0
    """Records the stream processors had not committed at the last read."""
    max_backlog_seen: float = 0.0
    size_changes: int = 0
    """Times the dynamic fragment length changed."""


class Backpressure:
    """Pause while the processors' backlog is high; optionally size fragments by it. See the
    module docstring.

    Args:
        backlog: records waiting for the stream processors (``bus.group_lag``).
        max_backlog: pause above this many records.
        resume_below: resume at or below this (default ``max_backlog // 2``).
        check_every_s: while producing, read the backlog at most this often (a Kafka read is a
            broker round trip); while paused, on every ``allow``.
        sizes: dynamic fragment length controller (None: the actor's fixed length).
        on_size: called with every size the controller returns.
        poll_s: how long a paused actor waits per step.
    """

    def __init__(self, backlog: Callable[[], float], max_backlog: int = 64, resume_below: int | None = None,
                 check_every_s: float = 0.2, sizes: SizeController | None = None,
                 on_size: Callable[[int], None] | None = None, poll_s: float = 0.05,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_backlog < 1:
            raise ValueError("max_backlog must be >= 1")
        self.backlog = backlog
        self.max_backlog = int(max_backlog)
        self.resume_below = max(0, int(max_backlog // 2 if resume_below is None else resume_below))
        if self.resume_below >= self.max_backlog:
            raise ValueError("resume_below must be < max_backlog")
        self.check_every_s = float(check_every_s)
        self.sizes = sizes
        self.on_size = on_size
        self.poll_s = float(poll_s)
        self.clock = clock
        self.paused = False
        self._paused_since = 0.0
        self._read_at: float | None = None
        self.pressure = BackpressureStats()
        if sizes is not None and on_size is not None:
            on_size(sizes.size)

    def _read(self, now: float, force: bool) -> float:
        if force or self._read_at is None or now - self._read_at >= self.check_every_s:
            try:
                value = float(self.backlog())
            except Exception:  # a failed read must not stop the actor: keep the last value
                self.pressure.backlog_errors += 1
                value = self.pressure.last_backlog
            self._read_at = now
            self.pressure.last_backlog = value
            self.pressure.max_backlog_seen = max(self.pressure.max_backlog_seen, value)
        return self.pressure.last_backlog

    def allow(self, version: int) -> bool:
        now = self.clock()
        lag = self._read(now, force=self.paused)
        if self.paused:
            if lag > self.resume_below:
                return False
            self.paused = False
            self.pressure.paused_s += now - self._paused_since
            return True
        if lag > self.max_backlog:
            self.paused = True
            self._paused_since = now
            self.pressure.pauses += 1
            return False
        return True

    def fragment_steps(self, default: int) -> int:
        return default if self.sizes is None else self.sizes.size

    def on_published(self, num_steps: int, version: int) -> None:
        if self.sizes is None:
            return
        before = self.sizes.size
        # The backlog read before this fragment was collected (the processors had the whole
        # collection time to catch up; a read now would count the fragment just sent), in env
        # steps per env: records x the fragment length, so the controller's ratio backlog/size
        # is the number of fragments queued.
        size = self.sizes.update(self.pressure.last_backlog * before)
        if size != before:
            self.pressure.size_changes += 1
        if self.on_size is not None:
            self.on_size(size)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"flow": "backpressure", "max_backlog": self.max_backlog,
                               "resume_below": self.resume_below, **asdict(self.pressure)}
        if self.sizes is not None:
            out["fragment_steps"] = self.sizes.size
        return out


@dataclass
class GateStats:
    stalls: int = 0
    """Times the actor got ``max_steps_ahead`` ahead of the learner and waited."""
    stalled_s: float = 0.0
    """Seconds spent waiting for the learner (completed waits)."""
    steps_ahead: int = 0
    """Env steps published since the policy version last advanced."""
    published: int = 0
    """Env steps published in all (counted against ``budget``)."""
    backlog_errors: int = 0
    """End-to-end backlog reads that failed (the last value was kept)."""


class LearnerGate:
    """Hold ``inner`` back while the learner lags ``max_steps_ahead`` env steps behind this actor.
    See the module docstring."""

    def __init__(self, inner: Flow, max_steps_ahead: int, num_envs: int = 1, budget: int | None = None,
                 backlog: Callable[[], float] | None = None, max_backlog: int = 0, check_every_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic,
                 on_stall: Callable[[int, int], None] | None = None) -> None:
        if max_steps_ahead < 1:
            raise ValueError("max_steps_ahead must be >= 1")
        if budget is not None and budget < 1:
            raise ValueError("budget must be >= 1")
        self.inner = inner
        self.budget = budget
        self.backlog = backlog
        self.max_backlog = max_backlog
        self.check_every_s = check_every_s
        self._backlog_at: float | None = None
        self._backlog = float("inf")  # unknown: assume the learner is behind
        self.max_steps_ahead = int(max_steps_ahead)
        self.num_envs = max(1, int(num_envs))
        self.clock = clock
        self.on_stall = on_stall
        self.poll_s = inner.poll_s
        self._version: int | None = None
        self._stalled_since: float | None = None
        self.gate = GateStats()

    @property
    def stalled(self) -> bool:
        return self._stalled_since is not None

    def _left_per_env(self) -> int | None:
        return None if self.budget is None else (self.budget - self.gate.published) // self.num_envs

    @property
    def exhausted(self) -> bool:
        """The budget is spent (less than one step per env is left)."""
        left = self._left_per_env()
        return left is not None and left < 1

    def stalled_for(self) -> float:
        return 0.0 if self._stalled_since is None else self.clock() - self._stalled_since

    def allow(self, version: int) -> bool:
        now = self.clock()
        if version != self._version:
            self._version = version
            self.gate.steps_ahead = 0
            if self._stalled_since is not None:
                self.gate.stalled_s += now - self._stalled_since
                self._stalled_since = None
        if self.exhausted:
            return False
        if self.gate.steps_ahead >= self.max_steps_ahead and self._behind(now):
            if self._stalled_since is None:
                self._stalled_since = now
                self.gate.stalls += 1
                if self.on_stall is not None:
                    self.on_stall(version, self.gate.steps_ahead)
            return False
        if self._stalled_since is not None:  # the backlog cleared: the learner waits for data
            self.gate.stalled_s += now - self._stalled_since
            self._stalled_since = None
        return self.inner.allow(version)

    def _behind(self, now: float) -> bool:
        """Is the end-to-end backlog above ``max_backlog``? (read at most every ``check_every_s``;
        a failed read keeps the last value)"""
        if self.backlog is None:
            return True
        if self._backlog_at is None or now - self._backlog_at >= self.check_every_s:
            self._backlog_at = now
            try:
                self._backlog = float(self.backlog())
            except Exception:
                self.gate.backlog_errors += 1
        return self._backlog > self.max_backlog

    def fragment_steps(self, default: int) -> int:
        steps, left = self.inner.fragment_steps(default), self._left_per_env()
        return steps if left is None else max(1, min(steps, left))

    def on_published(self, num_steps: int, version: int) -> None:
        self.gate.published += num_steps * self.num_envs
        if version == self._version:
            self.gate.steps_ahead += num_steps * self.num_envs
        self.inner.on_published(num_steps, version)

    def stats(self) -> dict[str, Any]:
        return {**self.inner.stats(), "max_steps_ahead": self.max_steps_ahead, "budget": self.budget,
                "stalled": self.stalled,
                **{f"learner_{k}": v for k, v in asdict(self.gate).items()}}
