"""``rlstream prune RUNS_DIR --older-than 30d``: the lifecycle of run directories.

A run directory (``runs/<id>``) holds everything a run leaves on disk besides Kafka: the
memory bus's event log, the decoupled processes' logs (``<role>.log``), the TensorBoard
directory (``tb/``), snapshots (unless ``--snapshot-store`` put them elsewhere), summaries
and plots. Its age is that of its newest entry (a resumed run is as young as its last write).
Every entry of ``RUNS_DIR`` older than the bound is removed: a run directory, or a plain file
(e.g. a log kept beside the runs); so the same command prunes a ``--tensorboard DIR`` kept
outside the runs. ``runs/latest`` and the directory it points to are never removed.

Dry run by default (prints what it would remove); ``yes=True`` (``--yes``) removes.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEFAULT_OLDER_THAN", "PruneEntry", "newest_mtime", "plan", "prune"]

DEFAULT_OLDER_THAN = "30d"
"""The deployment guide keeps logs 30 days."""

LATEST = "latest"


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
    """The entries of ``runs_dir`` whose newest write is over ``older_than_s`` seconds old,
    oldest first, never ``latest`` nor its target."""
    if older_than_s <= 0:
        raise ValueError("older_than must be positive")
    if not runs_dir.is_dir():
        raise FileNotFoundError(f"no directory {runs_dir}")
    now = time.time() if now is None else now
    keep = _protected(runs_dir)
    out = []
    for entry in runs_dir.iterdir():
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
            if e.path.is_dir() and not e.path.is_symlink():
                shutil.rmtree(e.path)
            else:
                e.path.unlink()
    return entries
