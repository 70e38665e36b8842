"""Role processes (``rlstream ...``, ``faust -A streams worker``) with their output in files,
and reading the JSON summary a role prints last."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def summary_from_text(text: str) -> dict | None:
    """The ``summary`` object a role prints as its last JSON line (``{"summary": ...}``), or the
    pretty-printed one ``rlstream train`` ends its stdout with; None if there is none."""
    start = text.rfind('{\n  "summary"')
    if start >= 0:
        return json.JSONDecoder().raw_decode(text[start:])[0]["summary"]  # a verdict line may follow
    for line in reversed(text.splitlines()):
        if line.startswith('{"summary"'):
            return json.loads(line)["summary"]
    return None


def summary_of(log: Path) -> dict | None:
    """``summary_from_text`` of a log file."""
    return summary_from_text(log.read_text(errors="replace"))


def http_json(url: str, timeout: float = 2.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


class Role:
    """One process in its own session (a kill takes its children too), output in ``log``."""

    def __init__(self, name: str, cmd: list[str], log: Path, env: dict[str, str], cwd: Path = ROOT) -> None:
        self.name = name
        self.log = log
        self._out = log.open("ab")
        self.proc = subprocess.Popen(cmd, cwd=str(cwd), stdout=self._out, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.ended_by_test = False  # set by kill and terminate: an exit the test caused

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no snapshot, no flush, no commit, no goodbye to the group."""
        self.ended_by_test = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self._out.close()

    def pause(self) -> None:
        """SIGSTOP: the process (and its children) freeze where they are."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait; SIGKILL and fail if it ignores it. Returns the exit status."""
        if self.alive():
            self.ended_by_test = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"{self.name} ignored SIGTERM for {timeout:.0f}s:\n{self.tail()}") from None
        self._out.close()
        return self.proc.returncode

    def stop(self, timeout: float = 30.0) -> dict:
        """``terminate`` and return the role's JSON summary (``{}`` if it printed none)."""
        self.terminate(timeout)
        return summary_of(self.log) or {}

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.text().splitlines()[-lines:])


class Procs:
    """Named role processes under one directory; ``close`` kills whatever still runs."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.tmp, self.env = tmp, env
        self.roles: dict[str, Role] = {}

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> Role:
        role = Role(name, cmd, self.tmp / f"{name}.log", {**self.env, **(env or {})})
        self.roles[name] = role
        return role

    def log(self, name: str, tail: int = 4000) -> str:
        return self.roles[name].text()[-tail:]

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{self.log(n)}" for n in self.roles)

    def dead(self) -> list[str]:
        return [n for n, r in self.roles.items() if not r.alive()]

    def close(self) -> None:
        for r in self.roles.values():
            if r.alive():
                r.kill()
