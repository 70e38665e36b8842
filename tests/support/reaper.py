"""Every process a test starts ends with the test, pass or fail (a pytest plugin, loaded by
``tests/conftest.py``).

Each test runs with ``RLSTREAM_TEST_PROCS`` set to a mark of its own; every process it starts
inherits the variable, however far down (the decoupled supervisor's children, each in its own
session; a Faust worker; a broker; a daemonised grandchild). At the test's teardown, after its
other fixtures, the ``reaper`` fixture SIGKILLs every process whose environment carries the
mark, and the process groups they lead. Nothing else is touched: a mark names one test of one
session, so other people's runs, a shared broker and other pytest sessions are never hit.

Processes started while a session- or module-scoped fixture is set up (the suite's brokers, a
module's training run) carry the session's mark instead, and are reaped when the session ends.
A nested pytest's mark extends its parent's (``outer/inner``), so the outer test reaps the inner
session's processes too. What was reaped is listed at the end of the run (``reaped``): a test
there left processes behind when it ended.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator

import pytest

ENV = "RLSTREAM_TEST_PROCS"
_SESSION = pytest.StashKey[str]()  # this session's mark
_REAPED = pytest.StashKey[list]()  # (test, {pid: command line}) of what tests left behind


def marked(mark: str) -> dict[int, str]:
    """pid -> command line of every other process whose environment carries ``mark`` (or a
    mark nested under it). Reads ``/proc``; a process that vanishes meanwhile is skipped."""
    want = f"{ENV}={mark}".encode()
    out: dict[int, str] = {}
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        for var in env.split(b"\0"):
            if var == want or var.startswith(want + b"/"):
                out[int(name)] = _cmdline(int(name))
                break
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def reap(mark: str, timeout: float = 30.0) -> dict[int, str]:
    """SIGKILL every process ``marked(mark)`` and each process group one of them leads (never
    this process's own group), until none is left and each has ended (a killed process loses its
    environment before it has finished exiting); returns what was found. Raises ``RuntimeError``
    if some survive ``timeout`` (an uninterruptible sleep)."""
    found: dict[int, str] = {}
    starts: dict[int, int | None] = {}
    own_group = os.getpgrp()
    deadline = time.monotonic() + timeout
    while True:
        alive = marked(mark)
        for pid in alive:
            starts.setdefault(pid, _start(pid))
        exiting = [pid for pid, start in starts.items() if pid not in alive and _running(pid, start)]
        if not alive and not exiting:
            _collect_zombies(found)
            return found
        found.update(alive)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes of {mark} survive SIGKILL: {alive or exiting}")
        for pid in alive:
            with contextlib.suppress(OSError):  # gone meanwhile
                if os.getpgid(pid) == pid and pid != own_group:
                    os.killpg(pid, signal.SIGKILL)  # a child that cleared its environment, too
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        _collect_zombies(found)
        time.sleep(0.05)


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def _running(pid: int, start: int | None) -> bool:
    """``pid`` is still the process that started at ``start`` and has not ended (a zombie has)."""
    fields = _stat(pid)
    return fields is not None and int(fields[19]) == start and fields[0] not in ("Z", "X")


def _collect_zombies(pids) -> None:
    """Wait for those of ``pids`` that are this process's children (a zombie keeps no
    environment, but a Popen that is never waited for would leave one per test)."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


@contextlib.contextmanager
def mark_as(mark: str) -> Iterator[None]:
    """Processes started inside carry ``mark``."""
    old = os.environ.get(ENV)
    os.environ[ENV] = mark
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old


def _session_mark(config: pytest.Config) -> str:
    return config.stash[_SESSION]


def pytest_configure(config: pytest.Config) -> None:
    # multiprocessing's resource tracker serves this process all session long (a spawned child
    # registers its semaphores with it): started now, before the session's mark, it is never reaped.
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    parent = os.environ.get(ENV)
    mark = f"s{os.getpid()}-{uuid.uuid4().hex[:8]}"
    config.stash[_SESSION] = f"{parent}/{mark}" if parent else mark
    config.stash[_REAPED] = []
    os.environ[ENV] = config.stash[_SESSION]


def pytest_unconfigure(config: pytest.Config) -> None:
    mark = config.stash.get(_SESSION, None)
    if mark is not None:
        reap(mark)  # the session's brokers and whatever a fixture of a wider scope left


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """A fixture of a wider scope than the test (a session broker) is set up under the
    session's mark: it outlives the test that first asked for it."""
    if fixturedef.scope == "function":
        return (yield)
    with mark_as(_session_mark(request.config)):
        return (yield)


class Reaper:
    """The ``reaper`` fixture: ``mark`` is this test's; ``alive()`` its running processes."""

    def __init__(self, mark: str) -> None:
        self.mark = mark

    def alive(self) -> dict[int, str]:
        return marked(self.mark)


@pytest.fixture(autouse=True)
def reaper(request) -> Iterator[Reaper]:
    """Marks this test's processes and SIGKILLs whatever of them is left when it ends (see the
    module docstring). Autouse: set up before, torn down after, the test's other fixtures."""
    digest = uuid.uuid5(uuid.NAMESPACE_URL, request.node.nodeid).hex[:8]
    mark = f"{_session_mark(request.config)}/t{digest}-{uuid.uuid4().hex[:6]}"
    with mark_as(mark):
        yield Reaper(mark)
    left = reap(mark)
    if left:
        request.config.stash[_REAPED].append((request.node.nodeid, left))


def pytest_terminal_summary(terminalreporter, config) -> None:
    reaped = config.stash.get(_REAPED, [])
    if reaped:
        terminalreporter.section("reaped")
        for nodeid, procs in reaped:
            terminalreporter.line(f"{nodeid}: killed {len(procs)} left-over process(es): "
                                  + "; ".join(f"{pid} {cmd[:100]}" for pid, cmd in sorted(procs.items())))
