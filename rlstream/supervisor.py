"""The children of a local decoupled run as Kubernetes would keep them: started, probed on
``/healthz``, restarted with backoff, and ``ChildExited`` once a role is out of restarts."""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from config.env import (
    ENV_PROCESS,
)
from runtime.ports import LIVENESS_PROBE, STARTUP_PROBE, Probe
from streams.bus.base import EXIT_FENCED


class ChildExited(RuntimeError):
    """A process of a decoupled run died; the message names its log file and exit code."""

    def __init__(self, name: str, code: int, log_path: Path, note: str = "") -> None:
        tail = _tail(log_path, 5)
        super().__init__(f"{name} exited with code {code}{' ' + note if note else ''}; see its log {log_path}"
                         + ("\n  last lines:\n    " + "\n    ".join(tail) if tail else ""))
        self.name, self.code, self.log_path = name, code, log_path


def _tail(path: Path, n: int) -> list[str]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line[:300] for line in lines[-n:]]


#: Probes go straight to the child, never through a proxy the environment names (as the kubelet's).
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


#: ``http_probe``'s details when the child's server is closed or closing (a child on its way
#: out): nothing listens on the port, or it dropped the connection unanswered.
REFUSED = "connection refused (no server on the port)"


RESET = "connection reset (its server closed it unanswered)"


def http_probe(url: str, timeout_s: float) -> tuple[bool, str]:
    """One ``httpGet`` probe as the kubelet runs it: ``(ok, detail)``, ok on a 2xx or 3xx answer
    within ``timeout_s``; a refused connection (``REFUSED``), a time-out or another status fails."""
    try:
        with _DIRECT.open(url, timeout=timeout_s) as resp:
            return 200 <= resp.status < 400, f"HTTP {resp.status}"
    except urllib.error.HTTPError as e:
        body = e.read(300).decode(errors="replace").strip()
        return False, f"HTTP {e.code}" + (f": {body}" if body else "")
    except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out
        reason = getattr(e, "reason", e)
        if isinstance(reason, ConnectionRefusedError):
            return False, REFUSED
        if isinstance(reason, ConnectionResetError):  # http.client.RemoteDisconnected too
            return False, RESET
        return False, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


@dataclass
class _ProbeState:
    url: str
    next_at: float  # monotonic time of the next probe
    answered: bool = False  # started: a probe has passed once
    failures: int = 0  # liveness failures in a row
    refused_since: float | None = None  # monotonic time its server stopped answering (``REFUSED``)


class Supervisor:
    """The children of a local decoupled run, restarted as Kubernetes would: a role that dies is
    started again after a backoff (``BACKOFF_S``, doubling up to ``BACKOFF_MAX_S``), at most
    ``max_restarts`` times per role; one more death raises ``ChildExited`` naming its log.
    An actor that exits 0 has spent its budget and stays down; a restarted learner resumes from
    its newest snapshot and committed offsets (``--resume``); its log files are appended to.

    A child spawned with a ``health_url`` is probed as the manifests' probes do
    (``runtime.ports``): every ``startup.period_s`` until it first answers, then every
    ``liveness.period_s``; ``liveness.failure_threshold`` failed probes in a row (no 2xx/3xx
    within ``liveness.timeout_s``: hung, stopped, or its ``/healthz`` says it is unhealthy, as
    ``rlstream serve``'s does when ``/act`` is slow) kill its process group (SIGKILL: a hung
    process does not act on SIGTERM), and it is restarted like a child that died, with the
    reason logged and in ``reasons``. Unlike a startupProbe, a child that never answers is not
    killed (it may have lost its port to a race and runs without a server). ``liveness=None``:
    no probes. ``check`` runs the probes that are due, one after another, on the caller's thread.

    A child that has exited is not probed, and one whose server refuses or resets connections after
    it answered (it closed its server on its way out: a learner past its last snapshot) has
    ``EXIT_GRACE_S`` to exit before those refusals count as failures: a clean finish logs no
    ``liveness_probe_failed``."""

    BACKOFF_S = 1.0
    BACKOFF_MAX_S = 30.0
    EXIT_GRACE_S = 20.0

    def __init__(self, env: dict[str, str], log_dir: Path, max_restarts: int, log: Any = None,
                 liveness: Probe | None = LIVENESS_PROBE, startup: Probe = STARTUP_PROBE) -> None:
        self.env, self.log_dir, self.max_restarts, self.log = env, log_dir, max_restarts, log
        self.liveness, self.startup = liveness, startup
        self.procs: dict[str, subprocess.Popen] = {}
        self.cmds: dict[str, list[str]] = {}
        self.envs: dict[str, dict[str, str]] = {}
        self.restarts: dict[str, int] = {}
        self.pending: dict[str, float] = {}  # role -> monotonic time of its restart
        self.health_urls: dict[str, str] = {}
        self.probes: dict[str, _ProbeState] = {}
        self.killed: dict[str, str] = {}  # role -> why the supervisor killed it (until restarted)
        self.reasons: list[dict[str, Any]] = []  # every restart: role, restart, reason

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None,
              health_url: str | None = None) -> None:
        """Start ``name`` (again: same command, same ``env`` over the run's, log appended; probed
        at ``health_url``, given once)."""
        self.cmds[name] = cmd
        if env is not None:
            self.envs[name] = env
        if health_url is not None:
            self.health_urls[name] = health_url
        mode = "a" if name in self.procs else "w"
        self.procs[name] = subprocess.Popen(cmd, stdout=self.log_path(name).open(mode), stderr=subprocess.STDOUT,
                                            env={**self.env, **self.envs.get(name, {}), ENV_PROCESS: name},
                                            start_new_session=True)
        if name in self.health_urls:
            self.probes[name] = _ProbeState(self.health_urls[name], next_at=time.monotonic() + self.startup.period_s)

    def probe(self) -> None:
        """Run each due probe; kill a child that has failed ``liveness.failure_threshold`` in a row."""
        if self.liveness is None:
            return
        for name, st in self.probes.items():
            p = self.procs[name]
            if name in self.pending or name in self.killed or p.poll() is not None or time.monotonic() < st.next_at:
                continue
            ok, detail = http_probe(st.url, (self.liveness if st.answered else self.startup).timeout_s)
            if not st.answered:
                st.answered = ok
                st.next_at = time.monotonic() + (self.liveness if ok else self.startup).period_s
                continue
            now = time.monotonic()
            st.next_at = now + self.liveness.period_s
            if ok:
                st.failures, st.refused_since = 0, None
                continue
            if p.poll() is not None:  # it exited while asked: ``check`` deals with an exit
                continue
            if detail in (REFUSED, RESET):  # its server is closed: on its way out, unless it stays past the grace
                st.refused_since = now if st.refused_since is None else st.refused_since
                if now - st.refused_since < self.EXIT_GRACE_S:
                    continue
            st.failures += 1
            if self.log is not None:
                self.log.warning("liveness_probe_failed", role=name, failures=st.failures,
                                 failure_threshold=self.liveness.failure_threshold, url=st.url, detail=detail)
            if st.failures >= self.liveness.failure_threshold:
                self.killed[name] = (f"liveness probe failed {st.failures} times in a row "
                                     f"(every {self.liveness.period_s:g} s, timeout {self.liveness.timeout_s:g} s): "
                                     f"{st.url}: {detail}")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=10)

    def check(self, done_ok: set[str]) -> None:
        """Probe the children that have a health URL (``probe``), schedule a restart of each role
        that died or was killed (exit 0 of a role in ``done_ok`` is done), and start those whose
        backoff is over; raises ``ChildExited`` past the bound."""
        self.probe()
        now = time.monotonic()
        for name, p in self.procs.items():
            code = p.poll()
            killed = self.killed.get(name)
            if code is None or name in self.pending or (code == 0 and name in done_ok and killed is None):
                continue
            reason = killed or f"exited with code {code}"
            if code == EXIT_FENCED and killed is None:  # a restart would fence the newer learner in turn
                raise ChildExited(name, code, self.log_path(name),
                                  note="(fenced: another learner of this run and rank took over) not restarted")
            n = self.restarts.get(name, 0) + 1
            if n > self.max_restarts:
                raise ChildExited(name, code, self.log_path(name),
                                  note=f"{f'({killed}) ' if killed else ''}after {n - 1} restart(s) (--deploy.max-restarts {self.max_restarts})")
            delay = min(self.BACKOFF_MAX_S, self.BACKOFF_S * 2 ** (n - 1))
            self.restarts[name] = n
            self.pending[name] = now + delay
            self.reasons.append({"role": name, "restart": n, "reason": reason})
            if self.log is not None:
                self.log.warning("role_restarting", role=name, exit_code=code, restart=n, reason=reason,
                                 max_restarts=self.max_restarts, backoff_s=delay, log=str(self.log_path(name)))
        for name, at in list(self.pending.items()):
            if now >= at:
                del self.pending[name]
                self.killed.pop(name, None)
                cmd = self.cmds[name]
                if name == "learner" and "--resume" not in cmd:
                    cmd = cmd + ["--resume"]  # continue from the newest snapshot, not from version 0
                self.spawn(name, cmd)

    def alive(self, name: str) -> bool:
        return name in self.pending or self.procs[name].poll() is None

    def stop(self, finishing: tuple[str, ...] = (), grace_s: float = 20.0) -> None:
        """End every child: first wait up to ``grace_s`` for the ``finishing`` ones (their work
        done, they are exiting on their own: a SIGTERM would record a clean end as -15), then
        SIGTERM the rest, and SIGKILL what is left after 30 s."""
        deadline = time.monotonic() + grace_s
        for name in finishing:
            try:
                self.procs[name].wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
