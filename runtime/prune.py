"""``rlstream prune RUNS_DIR --older-than 30d``: the lifecycle of run directories.

A run directory (``runs/<id>``) holds everything a run leaves on disk besides Kafka: the
memory bus's event log, the decoupled processes' logs, TensorBoard files, snapshots (unless
``--snapshot-store`` put them elsewhere), summaries and plots. Its age is that of its newest
entry (a resumed run is as young as its last write).

Only run directories are ever removed: those ``runtime.rundir.is_run`` recognises by their
marker (``run.json``), never a plain file, never a link nor what it points to, never
``runs/latest``'s target. A folder holding no run at all is refused (``NoRuns``): it is not a
runs folder. Dry run by default (lists what it would remove); ``yes=True`` (``--yes``) removes.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from runtime.rundir import LATEST, find_runs, is_run

__all__ = ["DEFAULT_OLDER_THAN", "NoRuns", "PruneEntry", "newest_mtime", "plan", "prune"]

DEFAULT_OLDER_THAN = "30d"
"""The deployment guide keeps logs 30 days."""


class NoRuns(ValueError):
    """The folder given holds no run directory: nothing there is prune's to remove."""


@dataclass(frozen=True)
class PruneEntry:
    path: Path
    age_s: float
    bytes: int


def newest_mtime(path: Path) -> tuple[float, int]:
    """``(newest mtime, total bytes)`` of ``path`` and everything under it (links not followed)."""
    st = os.lstat(path)
    newest, size = st.st_mtime, st.st_size
    if path.is_dir() and not path.is_symlink():
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                try:
                    s = os.lstat(os.path.join(root, name))
                except FileNotFoundError:  # a live run removed it meanwhile
                    continue
                newest = max(newest, s.st_mtime)
                size += s.st_size
    return newest, size


def _protected(runs_dir: Path) -> set[Path]:
    latest = runs_dir / LATEST
    keep = {latest.absolute()}
    if latest.exists():
        keep.add(latest.resolve())
    return keep


def plan(runs_dir: Path, older_than_s: float, now: float | None = None) -> list[PruneEntry]:
    """The run directories in ``runs_dir`` whose newest write is over ``older_than_s`` seconds
    old, oldest first, never ``latest`` nor its target; ``NoRuns`` if it holds no run."""
    if older_than_s <= 0:
        raise ValueError("older_than must be positive")
    if not runs_dir.is_dir():
        raise FileNotFoundError(f"no directory {runs_dir}")
    if is_run(runs_dir):
        raise NoRuns(f"{runs_dir} is a run directory itself; give the folder that holds runs "
                     f"(e.g. {runs_dir.parent})")
    runs = find_runs(runs_dir)
    if not runs:
        raise NoRuns(f"{runs_dir} holds no rlstream runs (no subdirectory with a run.json); nothing to prune")
    now = time.time() if now is None else now
    keep = _protected(runs_dir)
    out = []
    for entry in runs:
        if entry.absolute() in keep or entry.resolve() in keep:
            continue
        try:
            newest, size = newest_mtime(entry)
        except FileNotFoundError:
            continue
        age = now - newest
        if age > older_than_s:
            out.append(PruneEntry(entry, age, size))
    return sorted(out, key=lambda e: -e.age_s)


def prune(runs_dir: Path, older_than_s: float, *, yes: bool = False, now: float | None = None) -> list[PruneEntry]:
    """Remove (``yes``) or only list the entries ``plan`` finds; returns them."""
    entries = plan(runs_dir, older_than_s, now)
    if yes:
        for e in entries:
            if e.path.is_symlink() or not is_run(e.path):  # changed since planned: not ours to touch
                continue
            shutil.rmtree(e.path)  # removes links inside, never what they point to
    return entries
