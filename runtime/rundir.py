"""A run's directory (``runs/<run-id>/``): who owns it, what its files are called, and the one
atomic JSON write.

Every run (co-located, decoupled, a DPO replay, a fork) gets its own directory with a marker,
``run.json``: the run id, the mode, what it trains and when it started. The marker is how the
other commands recognise a run: ``rlstream prune`` removes only directories that carry one,
``rlstream runs`` lists them, and a role started against a directory that belongs to another
run refuses (``RunDirError``) unless it resumes that run. ``runs/latest`` follows the newest.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from config.bus import LATEST_RUN, NAMESPACE_FILE
from config.runfile import CONFIG_FILE, write_text_atomic

__all__ = ["CONFIG_SUFFIX", "LATEST", "MARKER", "STATE_SUFFIX", "SUMMARY_FILE", "SUMMARY_SUFFIX", "RunDir",
           "RunDirError", "RunInfo", "find_runs", "is_run", "write_json_atomic"]

#: The marker file of a run directory.
MARKER = "run.json"
#: ``<runs>/latest``: a link to the newest run's directory.
LATEST = LATEST_RUN.name
#: The run's summary (co-located: the whole run's; decoupled: the supervisor's).
SUMMARY_FILE = "summary.json"
#: A role's summary in its run directory: ``<run-dir>/<role>.summary.json``.
SUMMARY_SUFFIX = ".summary.json"
#: A role's progress so far: ``<run-dir>/<role>.state.json``.
STATE_SUFFIX = ".state.json"
#: The config a role runs with: ``<run-dir>/<role>.config.json`` (the run's: ``config.json``).
CONFIG_SUFFIX = ".config.json"
#: Version of the marker's layout.
MARKER_SCHEMA = 1

#: The names a run writes at its top level (``*`` stands for a role: ``learner``, ``actor-0``,
#: ``streams``...); ``is_run`` reads them for runs from before markers existed.
RUN_FILES = (
    MARKER, "config.json", "*.config.json", "summary.json", "*.summary.json", "*.state.json",
    "timeline.json", "namespace", "curve.json", "*.png", "*.log", "log", "tb", "snapshots",
    "streams-data*", "actor-*", "prometheus.targets.json", "policy.safetensors", "*.tmp",
)


class RunDirError(ValueError):
    """A directory that cannot be used as this run's: another run's, or not a run at all."""


def write_json_atomic(path: str | Path, obj: Any, *, indent: int | None = 2) -> Path:
    """Write ``obj`` as JSON to ``path`` through a temp file of this process and a rename, so a
    reader sees the old file or the new one, never half of one (``config.runfile.write_text_atomic``)."""
    return write_text_atomic(path, json_text(obj, indent))


def json_text(obj: Any, indent: int | None = 2) -> str:
    """A run file's JSON text: sorted keys, anything else as its ``str``, one final newline."""
    return json.dumps(obj, indent=indent, sort_keys=True, default=str) + "\n"


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


@dataclass(frozen=True)
class RunInfo:
    """What ``run.json`` says of a run."""

    run_id: str
    mode: str
    created: float
    algo: str = ""
    env_id: str = ""
    namespace: str = ""
    host: str = ""
    pid: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"schema": MARKER_SCHEMA, "run_id": self.run_id, "mode": self.mode, "created": self.created,
                "algo": self.algo, "env_id": self.env_id, "namespace": self.namespace, "host": self.host,
                "pid": self.pid}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunInfo:
        return cls(run_id=str(d.get("run_id", "")), mode=str(d.get("mode", "")), created=float(d.get("created", 0)),
                   algo=str(d.get("algo", "")), env_id=str(d.get("env_id", "")),
                   namespace=str(d.get("namespace", "")), host=str(d.get("host", "")), pid=int(d.get("pid", 0)))


def _matches_run_file(name: str) -> bool:
    from fnmatch import fnmatchcase

    return any(fnmatchcase(name, pattern) for pattern in RUN_FILES) or name.startswith(".")


def is_run(path: str | Path) -> bool:
    """Whether ``path`` is a run directory (never following a link): it carries ``run.json``, or
    it is a run from before markers: only a run's files, with a co-located run's event log
    (``log/_topics.json``) or a decoupled run's config (``config.json`` naming a run id)."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        return False
    marker = path / MARKER
    if marker.is_file() and not marker.is_symlink():
        return _read_json(marker) is not None
    try:
        names = [p.name for p in path.iterdir()]
    except OSError:
        return False
    if not all(_matches_run_file(n) for n in names):
        return False
    if (path / "log" / "_topics.json").is_file():  # a co-located run's event log
        return True
    config = _read_json(path / "config.json") if "config.json" in names else None  # a decoupled run's config
    body = config.get("config") if isinstance(config, dict) else None  # (sections, or the flat layout of before)
    return isinstance(body, dict) and ("run_id" in body or "run_id" in (body.get("run") or {}))


def find_runs(runs_dir: str | Path) -> list[Path]:
    """The run directories directly under ``runs_dir`` (links, ``latest`` included, are skipped)."""
    runs_dir = Path(runs_dir)
    return sorted(p for p in runs_dir.iterdir() if not p.is_symlink() and is_run(p))


class RunDir:
    """One run's directory: its marker, its files' names, and writes through ``write_json_atomic``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # --- files -------------------------------------------------------------------------------
    @property
    def marker(self) -> Path:
        return self.path / MARKER

    def summary_file(self, role: str | None = None) -> Path:
        """``summary.json`` (the run's) or ``<role>.summary.json``."""
        return self.path / (SUMMARY_FILE if role is None else f"{role}{SUMMARY_SUFFIX}")

    def summary_files(self, prefix: str = "") -> list[Path]:
        """Every role summary whose role starts with ``prefix``, by name."""
        return sorted(self.path.glob(f"{prefix}*{SUMMARY_SUFFIX}"))

    def state_file(self, role: str) -> Path:
        return self.path / f"{role}{STATE_SUFFIX}"

    def state_files(self) -> list[Path]:
        """Every role's state file, by name."""
        return sorted(self.path.glob(f"*{STATE_SUFFIX}"))

    def config_file(self, role: str | None = None) -> Path:
        """``config.json`` (the run's, ``config.runfile``) or ``<role>.config.json``."""
        return self.path / (CONFIG_FILE if role is None else f"{role}{CONFIG_SUFFIX}")

    @property
    def namespace_file(self) -> Path:
        return self.path / NAMESPACE_FILE

    def write_summary(self, summary: dict[str, Any], role: str | None = None) -> Path:
        return write_json_atomic(self.summary_file(role), summary)

    # --- ownership ---------------------------------------------------------------------------
    def info(self) -> RunInfo | None:
        """The marker's contents (None: no marker)."""
        doc = _read_json(self.marker) if self.marker.is_file() else None
        return RunInfo.from_dict(doc) if doc else None

    def claim(self, run_id: str, *, mode: str, resume: bool = False, join: bool = False, adopt: bool = False,
              algo: str = "", env_id: str = "", namespace: str = "") -> str:
        """Make this directory run ``run_id``'s, and return the run id to use.

        A new (or empty) directory gets a marker. ``join`` (a role of a run started elsewhere)
        accepts a directory already marked as ``run_id``'s; with ``adopt`` (a role not told its run's
        id) also one whose run has this mode and namespace: the same topics, so the same run.
        ``resume`` continues the run a
        directory holds, under its recorded id. Anything else that holds a run is refused, and so
        is a directory holding anything a run does not write: a run never writes among other files.
        One holding only a run's file names (a role's log, redirected there before it started) is
        taken."""
        info = self.info()
        if info is None:
            if self.path.is_symlink() and not resume:
                raise RunDirError(f"{self.path} is a link; give the run directory itself")
            if self.path.exists() and not self.path.is_dir():
                raise RunDirError(f"{self.path} is a file, not a run directory")
            entries = sorted(p.name for p in self.path.iterdir()) if self.path.is_dir() else []
            foreign = [n for n in entries if not _matches_run_file(n)]
            if foreign:
                shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
                raise RunDirError(f"{self.path} is not empty and is not a run directory (it holds {shown}); "
                                  "choose a new or empty --run-dir")
            info = self.info()  # a role of the same run, started beside this one, may have marked it since
            if info is None and entries and is_run(self.path) and not resume:  # a run from before markers
                raise RunDirError(f"{self.path} holds an earlier run; pass --resume to continue it, "
                                  "or choose another --run-dir")
        if info is None:  # new, empty, or holding only what a run's roles write first (their logs): this run's
            self.path.mkdir(parents=True, exist_ok=True)
            mine = RunInfo(run_id=run_id, mode=mode, created=time.time(), algo=algo, env_id=env_id,
                           namespace=namespace, host=socket.gethostname(), pid=os.getpid())
            marked = self._mark(mine)
            info = None if marked else self.info()  # a role started beside this one marked it first
            if info is None:
                if not marked:  # an unreadable marker, not a sibling's (those are linked in whole)
                    write_json_atomic(self.marker, mine.as_dict())
                if mode == "decoupled":  # what the tools and --resume read (config.bus.run_namespace)
                    self.namespace_file.write_text(namespace + "\n")
                return run_id
        same = info.run_id == run_id or (adopt and info.mode == mode and info.namespace == namespace)
        if resume or (join and same):
            return info.run_id
        raise RunDirError(
            f"{self.path} belongs to run {info.run_id!r} ({info.mode}, started "
            f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(info.created))}"
            + (f", namespace {info.namespace!r}" if info.namespace != namespace else "")
            + "); pass --resume to continue that run, or choose another --run-dir / --run-id")

    def _mark(self, info: RunInfo) -> bool:
        """Write the marker unless one exists (False): complete or absent to any reader (a temp
        file linked into place), and of one run only when two roles mark at once."""
        tmp = self.path / f".{MARKER}.{os.getpid()}.{time.monotonic_ns()}.tmp"
        try:
            tmp.write_text(json_text(info.as_dict()))
            try:
                os.link(tmp, self.marker)
            except FileExistsError:
                return False
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def point_latest(self) -> None:
        """Make ``<parent>/latest`` a relative link to this directory (atomically)."""
        latest = self.path.parent / LATEST
        if latest.exists() and not latest.is_symlink():
            return  # a real directory called "latest" is a user's: never replace it
        if latest.resolve() == self.path.resolve():
            return
        tmp = self.path.parent / f".latest-{os.getpid()}-{time.monotonic_ns()}"
        tmp.symlink_to(self.path.name)
        tmp.replace(latest)

    # --- what ``rlstream runs`` shows ----------------------------------------------------------
    def status(self) -> str:
        """``finished`` (a summary), ``running`` (its starting process lives on this host) or
        ``stopped`` (neither)."""
        if self.summary_file().is_file():
            return "finished"
        info = self.info()
        if info is not None and info.host == socket.gethostname() and info.pid > 0:
            try:
                os.kill(info.pid, 0)
                return "running"
            except ProcessLookupError:
                pass
            except PermissionError:
                return "running"
        return "stopped"

    def overview(self) -> dict[str, Any]:
        """One row of ``rlstream runs``: id, mode, algo, env, steps, return, status."""
        info = self.info()
        summary = src = _read_json(self.summary_file()) or {}
        created = info.created if info is not None else self.path.stat().st_mtime
        return {
            "run_id": info.run_id if info is not None else self.path.name,
            "mode": (info.mode if info is not None else summary.get("mode")) or "?",
            "algo": (info.algo if info is not None and info.algo else summary.get("algo")) or "",
            "env": (info.env_id if info is not None and info.env_id else summary.get("env")) or "",
            "namespace": info.namespace if info is not None else "",
            "steps": src.get("steps"),
            "return": src.get("return_mean20"),
            "status": self.status(),
            "created": created,
            "path": str(self.path),
        }
