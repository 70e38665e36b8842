"""The role-process harness: what runs beside the roles of one process, in both modes.

A ``RoleProcess`` holds the roles of one process (co-located: the actors, the stream processor
and the learner; a decoupled child: its one role) with their progress lines (and state file),
TensorBoard runs, policy latencies, policy lag and health checks. ``wiring`` builds each role
into it (``wiring.add_actor``, ``add_prepare_worker``, ``add_learner``: the role's hooks and how
it closes); ``drive`` runs them (``runtime.roles.drive``); leaving the ``with`` block closes every
role built so far, last built first, also when a later one failed to build::

    with RoleProcess(cfg, "actor-0", total_steps=cfg.actor_budget(), state=True) as proc:
        actor = wiring.add_actor(proc, cfg, events, metrics, 0)
        proc.drive([Slot(actor)], done=lambda: flow.exhausted, stop=stop)
    proc.write_summary("actor-0", {**actor.summary(), "steps": proc.progress.steps})
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from config import TrainConfig
from runtime.gpu import GpuSampler
from runtime.logging import bind_policy_version
from runtime.progress import Progress, quantiles_ms
from runtime.roles import OverlapTimes, Slot, drive, drive_overlapped, write_summary
from runtime.rundir import RunDir
from runtime.tensorboard import TensorBoardRun


class Latencies:
    """Policy latencies (s: a version's publish -> an actor acts with it), the newest 100,000,
    with their running count; ``window``: also those since the last ``window_p99_ms``."""

    def __init__(self, window: bool = False) -> None:
        self.values: deque[float] = deque(maxlen=100_000)
        self.count = 0
        self._window: list[float] | None = [] if window else None

    def __call__(self, seconds: float) -> None:
        self.values.append(seconds)
        self.count += 1
        if self._window is not None:
            self._window.append(seconds)

    def window_p99_ms(self) -> float | None:
        """The p99 (ms) of the latencies since the last call (a progress line's window)."""
        p99 = quantiles_ms(self._window or []).get("p99")
        if self._window is not None:
            self._window.clear()
        return p99

    def newest_ms(self, n: int) -> list[float]:
        """The newest ``n`` (ms), oldest first."""
        return [round(x * 1e3, 3) for x in reversed(list(itertools.islice(reversed(self.values), n)))]

    def quantiles_ms(self) -> dict[str, Any]:
        return quantiles_ms(self.values)


class PolicyLag:
    """Policy lag per counted fragment over the run: the learner's version minus the fragment's."""

    def __init__(self) -> None:
        self.fragments = self.total = self.max = 0

    def add(self, lag: int) -> None:
        self.fragments += 1
        self.total += lag
        self.max = max(self.max, lag)

    def as_dict(self) -> dict[str, Any]:
        return {"mean": round(self.total / self.fragments, 4) if self.fragments else 0.0,
                "max": self.max, "fragments": self.fragments}


class RoleProcess:
    """The roles of one process and what runs beside them (see the module docstring).
    ``name``: the process (its state file ``<run_dir>/<name>.state.json`` with ``state``);
    ``timeline``: keep every progress line (``timeline.json``) and each line's latency window;
    ``gpu``: sample GPU utilisation (the process holds the learner); ``defer_batches``: count
    fragments when their round ends (co-located ``--actor.overlap``: the learner's version is known
    once the round is joined); ``flush``: flushed after every round (a decoupled actor's bus)."""

    def __init__(self, cfg: TrainConfig, name: str, *, total_steps: int, log: Any = None, health: Any = None,
                 state: bool = False, timeline: bool = False, gpu: bool = False, defer_batches: bool = False,
                 flush: Any = None) -> None:
        self.cfg, self.name, self.log, self.health, self.flush = cfg, name, log, health, flush
        self.on_flush: Callable[[float], None] | None = None  # told each round's flush time (wiring.add_actor)
        self.progress = Progress(total_steps=total_steps, log_every_s=cfg.run.log_every_s, log=log,
                                 state_path=RunDir(cfg.run.run_dir).state_file(name) if state else None,
                                 record_timeline=timeline)
        self.latencies = Latencies(window=timeline)
        self.lag = PolicyLag()
        self.gpu = GpuSampler() if gpu else None
        self.roles: dict[str, Any] = {}
        self.collect_s = 0.0  # actors' time collecting and publishing (waits left out)
        self.last_update = time.monotonic()
        self.ran = False  # the roles were driven (a learner snapshots on close only then)
        self._closers: list[Callable[[], None]] = []
        self._boards: dict[str, TensorBoardRun] = {}
        self._deferred: list[tuple[Callable[[Any], None], Any]] | None = [] if defer_batches else None

    def board(self, name: str) -> TensorBoardRun:
        """The TensorBoard run ``<tensorboard>/<run id>/<name>`` (closed with the process)."""
        if name not in self._boards:
            self._boards[name] = TensorBoardRun(self.cfg.run.tensorboard, self.cfg.effective_run_id(), name)
        return self._boards[name]

    def add(self, name: str, role: Any, close: Callable[[], None] | None = None) -> Any:
        """Hold ``role`` as ``name``: closed (``close``, else ``role.close``) with the process."""
        self.roles[name] = role
        self.on_close(close or role.close)
        return role

    def on_close(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` when the process closes, before what was registered earlier."""
        self._closers.append(fn)

    def check(self, name: str, fn: Callable[[], tuple[bool, dict[str, Any]]]) -> None:
        """A health check of ``/healthz`` (none without a health server)."""
        if self.health is not None:
            self.health.register(name, fn)

    def batch_hook(self, board: str, lag: Callable[[Any], int] | None = None) -> Callable[[Any, float], None]:
        """An actor's ``on_batch``: the fragment counted in the progress and TensorBoard run
        ``board`` with its policy lag ``lag(batch)``; None (no learner in this process): lag 0,
        and the progress line's version is the fragment's."""
        tb = self.board(board)

        def count(batch: Any) -> None:
            n = lag(batch) if lag is not None else 0
            self.lag.add(n)
            self.progress.on_batch(batch.size, batch.episode_returns, n)
            if lag is None:
                self.progress.version = batch.policy_version
                bind_policy_version(batch.policy_version)
            tb.episodes(self.progress.steps, batch.episode_returns, batch.episode_lengths)
            tb.sps(self.progress.steps)

        def on_batch(batch: Any, seconds: float) -> None:
            self.collect_s += seconds
            if self._deferred is not None:  # (the actors' thread) counted when the round ends
                self._deferred.append((count, batch))
            else:
                count(batch)
        return on_batch

    def update_hook(self, board: str = "learner", steps_trained: bool = False) -> Callable[[Any, dict, float], None]:
        """A learner's ``on_update``: updates and version in the progress, losses in TensorBoard
        run ``board``; ``steps_trained``: the progress counts the samples trained (no actor here)."""
        tb = self.board(board)

        def on_update(learner: Any, m: dict[str, float], seconds: float) -> None:
            p = self.progress
            p.updates, p.version = learner.stats.updates, learner.version
            if steps_trained:
                p.steps = learner.stats.samples_trained
            self.last_update = time.monotonic()
            bind_policy_version(learner.version)
            tb.losses(p.steps, m)
            tb.sps(p.steps)
        return on_update

    def after_round(self) -> None:
        """After each round: count deferred fragments, flush what the round produced, heartbeat
        (a role waiting for data, a version or room is alive) and log progress."""
        while self._deferred:
            count, batch = self._deferred.pop(0)
            count(batch)
        if self.flush is not None:
            began = time.monotonic()
            self.flush.flush()
            if self.on_flush is not None:
                self.on_flush(time.monotonic() - began)
        if self.health is not None:
            self.health.heartbeat("loop")
        self.progress.maybe_log()

    def drive(self, slots: Sequence[Slot], *, done: Callable[[], bool], stop: threading.Event | None) -> str:
        """``runtime.roles.drive`` with ``after_round``, then the last progress line."""
        self.ran = True
        ended = drive(slots, done=done, stop=stop, on_round=self.after_round)
        self.progress.maybe_log(force=True)
        return ended

    def drive_overlapped(self, side: Sequence[Slot], main: Sequence[Slot], after: Sequence[Slot], *,
                         before: Callable[[], None], done: Callable[[], bool], stop: threading.Event | None,
                         times: OverlapTimes) -> str:
        """``runtime.roles.drive_overlapped`` with ``after_round``, then the last progress line."""
        self.ran = True
        ended = drive_overlapped(side, main, after, before=before, done=done, stop=stop,
                                 on_round=self.after_round, times=times)
        self.progress.maybe_log(force=True)
        return ended

    def write_summary(self, name: str, summary: dict[str, Any]) -> None:
        write_summary(self.cfg.run.run_dir, name, summary)

    def write_summaries(self) -> None:
        """Each role's own summary, as ``<run_dir>/<name>.summary.json``."""
        for name, role in self.roles.items():
            self.write_summary(name, role.summary())

    def close(self) -> None:
        """Close what was built, last first, then the TensorBoard runs; every closer runs, and
        the first error is raised after."""
        error: BaseException | None = None
        for fn in [*reversed(self._closers), *(b.close for b in self._boards.values())]:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 (the rest still close)
                error = error or e
        self._closers.clear()
        self._boards.clear()
        if error is not None:
            raise error

    def __enter__(self) -> RoleProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
