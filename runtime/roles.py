"""The role protocol every role shares (actor, processor shell, learner), the one driver loop
that runs roles in both modes, and role summaries as files.

Co-located mode drives all roles in one loop; each decoupled child drives its one role::

    ended = drive([Slot(actor), Slot(worker, timeout=0.0, drain=True), Slot(learner, timeout=0.0)],
                  done=lambda: progress.steps >= total, stop=stop, on_round=progress.maybe_log)
    write_summary(run_dir, "actor-0", actor.summary())   # the decoupled parent reads it back

``drive_overlapped`` is the co-located ``--actor.overlap`` loop: the actors step in a second thread
while the learner updates.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from runtime.rundir import SUMMARY_SUFFIX, RunDir, write_json_atomic

#: A round of ``drive`` running this long is logged as stalled (again every as long), with where
#: the driving thread is: a role blocked in a client call stays visible (and diagnosable) in its log.
STALL_WARN_S = 20.0

log = logging.getLogger(__name__)


@runtime_checkable
class Role(Protocol):
    """One role of a run: a loop body, a shutdown and what it did."""

    def step(self, timeout: float = 0.0) -> Any:
        """Do one round of work, waiting at most ``timeout`` seconds for input; a falsy
        return means it found nothing to do."""

    def close(self) -> None:
        """Release the role's consumers, producers and environments."""

    def summary(self) -> dict[str, Any]:
        """What the role did (JSON-serialisable), for the run's summary."""


@dataclass(frozen=True)
class Slot:
    """A role in the driver's round: its step timeout, and whether to step it until idle."""

    role: Role
    timeout: float = 0.0
    drain: bool = False


def drive(slots: Sequence[Slot], *, done: Callable[[], bool] = lambda: False,
          stop: threading.Event | None = None, deadline: float | None = None,
          on_round: Callable[[], None] | None = None) -> str:
    """Step every slot's role in turn, round after round, until ``done()``, ``stop`` or the
    ``deadline`` (``time.monotonic()``); returns which: ``done``, ``stopped`` or ``deadline``.
    ``on_round`` runs after each round (progress lines, heartbeats, flushes). Roles are not
    closed here: the caller does, after its own shutdown work (a learner's last snapshot)."""
    stop = stop or threading.Event()
    with RoundWatchdog(slots) as watch:
        while True:
            if done():
                return "done"
            if stop.is_set():
                return "stopped"
            if deadline is not None and time.monotonic() >= deadline:
                return "deadline"
            watch.begin()
            _step(slots, stop)
            if on_round is not None:
                on_round()
            watch.end()


class RoundWatchdog:
    """Logs a WARNING when one round of ``drive`` has run ``warn_s`` seconds (and again every
    ``warn_s``), naming the roles and the innermost frames of the thread that drives them: a role
    blocked in a call that neither returns nor logs (a client waiting on a dead broker) says so,
    and where, instead of going silent."""

    def __init__(self, slots: Sequence[Slot], warn_s: float = STALL_WARN_S) -> None:
        self.roles = ", ".join(type(s.role).__name__ for s in slots)
        self.warn_s = warn_s
        self.warnings = 0
        self._thread_id = threading.get_ident()
        self._started: float | None = None
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="round-watchdog", daemon=True)

    def __enter__(self) -> RoundWatchdog:
        self._watcher.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._closed.set()
        self._watcher.join(5)

    def begin(self) -> None:
        self._started = time.monotonic()

    def end(self) -> None:
        self._started = None

    def where(self) -> str:
        """The innermost frames (up to 6) of the driving thread, innermost first."""
        frame, out = sys._current_frames().get(self._thread_id), []
        while frame is not None and len(out) < 6:
            code = frame.f_code
            out.append(f"{code.co_qualname} ({'/'.join(code.co_filename.rsplit('/', 2)[-2:])}:{frame.f_lineno})")
            frame = frame.f_back
        return " <- ".join(out) or "unknown"

    def _watch(self) -> None:
        warned_at: float | None = None
        while not self._closed.wait(min(1.0, self.warn_s / 4)):
            started = self._started
            if started is None:
                warned_at = None
                continue
            now = time.monotonic()
            if now - started >= self.warn_s and (warned_at is None or now - warned_at >= self.warn_s):
                warned_at = now
                self.warnings += 1
                log.warning("round of %s running for %.0fs, in %s", self.roles, now - started, self.where())


def _step(slots: Sequence[Slot], stop: threading.Event) -> None:
    """One round of ``slots``: each stepped once, a drain slot until it is idle."""
    for slot in slots:
        while slot.role.step(slot.timeout) and slot.drain and not stop.is_set():
            pass


@dataclass
class OverlapTimes:
    """Where the rounds of ``drive_overlapped`` spent their time (seconds, summed over rounds).
    ``side_s`` and ``main_s`` are wall times, each including any time its thread waited for the
    GIL: ``overlap_saved_s`` is a real saving only where the side's work runs outside it
    (co-located ``--actor.overlap``: the actors' envs in child processes; two Python-bound roles in
    threads of one process take turns, bench/peers.py)."""

    rounds: int = 0
    side_s: float = 0.0
    """The side slots' work (the actors' collection)."""
    main_s: float = 0.0
    """The main slots' work (the learner's update), done while the side worked."""
    together_s: float = 0.0
    """Wall time of the overlapped part of the rounds (the longer of the two, plus the join)."""
    after_s: float = 0.0
    """The ``after`` slots, run alone once both were joined (the stream processor)."""

    def as_dict(self) -> dict[str, float]:
        return {"rounds": self.rounds, "side_s": round(self.side_s, 3), "main_s": round(self.main_s, 3),
                "together_s": round(self.together_s, 3), "after_s": round(self.after_s, 3),
                "overlap_saved_s": round(self.side_s + self.main_s - self.together_s, 3)}


def drive_overlapped(side: Sequence[Slot], main: Sequence[Slot], after: Sequence[Slot] = (), *,
                     before: Callable[[], None] | None = None,
                     done: Callable[[], bool] = lambda: False, stop: threading.Event | None = None,
                     deadline: float | None = None, on_round: Callable[[], None] | None = None,
                     times: OverlapTimes | None = None) -> str:
    """``drive`` with two slot lists stepped at once. Each round: ``before()`` (this thread, with
    nothing else running), then the ``side`` slots in a second thread while this thread steps
    the ``main`` slots, both joined, then the ``after`` slots, then ``on_round()``. Co-located
    ``--actor.overlap``: side = the actors, main = the learner, after = the stream processor, before =
    the actors adopting the newest version; so an actor collects fragment k+1 with version v
    while the learner trains fragment k into v+1, and the order of every event is fixed by the
    rounds, never by the threads' timing::

        drive_overlapped([Slot(actor)], [Slot(learner)], [Slot(worker, drain=True)],
                         before=actor.adopt, done=lambda: progress.steps >= total)

    When ``done()``, one last round of ``main`` alone takes what the side made in the round
    before (the learner trains the last fragment); a stop or a deadline returns at once, as
    ``drive`` does. An error in either thread ends the run after both are joined, the side's
    first. ``times``: filled with where the rounds spent their time."""
    from concurrent.futures import ThreadPoolExecutor

    stop = stop or threading.Event()
    times = times if times is not None else OverlapTimes()

    def side_round() -> float:
        t0 = time.perf_counter()
        _step(side, stop)
        return time.perf_counter() - t0

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlstream-overlap") as pool:
        while True:
            if done():
                _step(main, stop)
                return "done"
            if stop.is_set():
                return "stopped"
            if deadline is not None and time.monotonic() >= deadline:
                return "deadline"
            if before is not None:
                before()
            t0 = time.perf_counter()
            pending = pool.submit(side_round)
            try:
                _step(main, stop)
                main_s = time.perf_counter() - t0
            finally:
                side_s = pending.result()  # waits whatever happened here; re-raises the side's error
            t1 = time.perf_counter()
            _step(after, stop)
            times.rounds += 1
            times.side_s += side_s
            times.main_s += main_s
            times.together_s += t1 - t0
            times.after_s += time.perf_counter() - t1
            if on_round is not None:
                on_round()


def summary_path(run_dir: Path, name: str) -> Path:
    return RunDir(run_dir).summary_file(name)


def write_summary(run_dir: Path, name: str, summary: dict[str, Any]) -> Path:
    """Write role ``name``'s summary to ``<run_dir>/<name>.summary.json`` (atomically)."""
    return write_json_atomic(summary_path(run_dir, name), summary)


def read_summaries(run_dir: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The summaries that roles ``names`` wrote (a role that died before writing has none)."""
    out = {}
    for name in names:
        path = summary_path(run_dir, name)
        if path.is_file():
            out[name] = json.loads(path.read_text())
    return out


def clear_summaries(run_dir: Path) -> None:
    """Remove an earlier run's summaries from ``run_dir`` (they are not this run's)."""
    for old in Path(run_dir).glob(f"*{SUMMARY_SUFFIX}"):
        old.unlink()
