"""The role protocol every role shares (actor, processor shell, learner), the one driver loop
that runs roles in both modes, and role summaries as files.

Co-located mode drives all roles in one loop; each decoupled child drives its one role::

    ended = drive([Slot(actor), Slot(worker, timeout=0.0, drain=True), Slot(learner, timeout=0.0)],
                  done=lambda: progress.steps >= total, stop=stop, on_round=progress.maybe_log)
    write_summary(run_dir, "actor-0", actor.summary())   # the decoupled parent reads it back
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

#: Suffix of a role's summary file in its run directory: ``<run-dir>/<role>.summary.json``.
SUMMARY_SUFFIX = ".summary.json"


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
    while True:
        if done():
            return "done"
        if stop.is_set():
            return "stopped"
        if deadline is not None and time.monotonic() >= deadline:
            return "deadline"
        for slot in slots:
            while slot.role.step(slot.timeout) and slot.drain and not stop.is_set():
                pass
        if on_round is not None:
            on_round()


def summary_path(run_dir: Path, name: str) -> Path:
    return Path(run_dir) / f"{name}{SUMMARY_SUFFIX}"


def write_summary(run_dir: Path, name: str, summary: dict[str, Any]) -> Path:
    """Write role ``name``'s summary to ``<run_dir>/<name>.summary.json`` (atomically)."""
    path = summary_path(run_dir, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")
    tmp.replace(path)
    return path


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
