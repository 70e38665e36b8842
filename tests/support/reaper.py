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
session's processes too.

A test that leaves a process running **fails** (an error at its teardown, naming each process):
the reaper kills them, then fails it. Its processes are those carrying its mark, and also those
it started with an environment of their own (``env={...}`` without the mark): every child of
this pytest process that started during the test and is still running, with its descendants and
the process groups and sessions it leads. A process already dying (a SIGKILL pending: the test
killed it and did not wait) is not a leak. The exemption of a session's or a module's fixture is
by construction, not by a list of names: what a wider-scoped fixture starts carries the
session's mark, or, started with an environment of its own, is recorded as the fixture's while it
is set up; neither is ever a test's. What was killed is also listed at the end of the run
(``reaped``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
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


def _mark_of(pid: int) -> str | None:
    """The value of ``ENV`` in ``pid``'s environment (None: unset, or unreadable)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return None
    for var in env.split(b"\0"):
        if var.startswith(ENV.encode() + b"="):
            return var.split(b"=", 1)[1].decode(errors="replace")
    return None


def _dying(pid: int) -> bool:
    """``pid`` has ended, or a SIGKILL is pending for it (it is past saving: not a leak)."""
    fields = _stat(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return True
    try:
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return True
    kill_bit = 1 << (signal.SIGKILL - 1)
    return any(int(status.get(key, "0").strip() or "0", 16) & kill_bit for key in ("SigPnd", "ShdPnd"))


def _table() -> dict[int, tuple[int, int, int, int]]:
    """pid -> (ppid, process group, session, start) of every running (not ended) process."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _stat(int(name))
            if fields is not None and fields[0] not in ("Z", "X"):
                out[int(name)] = (int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]))
    return out


def children() -> set[tuple[int, int]]:
    """(pid, start) of this process's running children."""
    me = os.getpid()
    return {(pid, start) for pid, (ppid, _, _, start) in _table().items() if ppid == me}


def _family(roots: set[int], table: dict[int, tuple[int, int, int, int]]) -> set[int]:
    """``roots``, their descendants, and the members of the process groups and sessions any of
    them leads (never this process's own group or session)."""
    own = {os.getpgrp(), os.getsid(0)}
    found = set(roots)
    while True:
        more = {pid for pid, (ppid, pgrp, sid, _) in table.items() if pid not in found and (
            ppid in found or (pgrp in found and pgrp not in own) or (sid in found and sid not in own))}
        if not more:
            return found
        found |= more


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


_SIGTERM = pytest.StashKey[object]()  # the SIGTERM handler before this plugin's


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    # A SIGTERM (a CI stage's budget: ``timeout --signal=TERM``) interrupts the run as Ctrl-C
    # does, so pytest still unconfigures and the session's processes (its brokers) are reaped;
    # by default it would end this process at once and leave them running.
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        config.stash[_SIGTERM] = signal.signal(signal.SIGTERM, _interrupted)
    # multiprocessing's resource tracker serves this process all session long (a spawned child
    # registers its semaphores with it): started now, before the session's mark, it is never reaped.
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    parent = os.environ.get(ENV)
    mark = f"s{os.getpid()}-{uuid.uuid4().hex[:8]}"
    config.stash[_SESSION] = f"{parent}/{mark}" if parent else mark
    config.stash[_REAPED] = []
    config.stash[_OWNED] = set()
    os.environ[ENV] = config.stash[_SESSION]


_OWNED = pytest.StashKey[set]()  # (pid, start) of children a wider-scoped fixture started


def pytest_unconfigure(config: pytest.Config) -> None:
    mark = config.stash.get(_SESSION, None)
    if mark is not None:
        reap(mark)  # the session's brokers and whatever a fixture of a wider scope left
    if _SIGTERM in config.stash:
        signal.signal(signal.SIGTERM, config.stash[_SIGTERM])


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """A fixture of a wider scope than the test (a session broker) is set up under the
    session's mark: it outlives the test that first asked for it."""
    if fixturedef.scope == "function":
        return (yield)
    before = children()
    try:
        with mark_as(_session_mark(request.config)):
            return (yield)
    finally:  # children it started with an environment of their own are the fixture's too
        request.config.stash[_OWNED].update(children() - before)


class Reaper:
    """The ``reaper`` fixture: ``mark`` is this test's; ``alive()`` its running processes."""

    def __init__(self, mark: str) -> None:
        self.mark = mark

    def alive(self) -> dict[int, str]:
        return marked(self.mark)


def leaked(mark: str, session_mark: str, before: set[tuple[int, int]], owned: set[tuple[int, int]]) -> dict[int, str]:
    """pid -> command line of what a test (``mark``) left running: the processes carrying its
    mark, and the children of this process it started without one (not among ``before``, its
    children when it began, nor ``owned`` by a wider fixture), with their families (``_family``).
    Processes already dying are left out."""
    table = _table()
    roots = set(marked(mark))
    for pid, (ppid, _, _, start) in table.items():
        if ppid != os.getpid() or (pid, start) in before or (pid, start) in owned:
            continue
        theirs = _mark_of(pid)
        if theirs is None or not (theirs == session_mark or theirs.startswith(session_mark + "/")):
            roots.add(pid)  # started during the test, with an environment of its own
    return {pid: _cmdline(pid) for pid in sorted(_family(roots, table)) if not _dying(pid)}


def kill_all(pids, timeout: float = 30.0) -> None:
    """SIGKILL ``pids`` and the groups they lead, and wait until each has ended."""
    own_group = os.getpgrp()
    starts = {pid: _start(pid) for pid in pids}
    for pid in pids:
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == pid and pid != own_group:
                os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while any(_running(pid, start) for pid, start in starts.items()):
        _collect_zombies(starts)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes survive SIGKILL: {sorted(starts)}")
        time.sleep(0.05)
    _collect_zombies(starts)


@pytest.fixture(autouse=True)
def reaper(request) -> Iterator[Reaper]:
    """Marks this test's processes; when it ends, kills whatever of them still runs and fails
    the test naming them (see the module docstring). Autouse: set up before, torn down after,
    the test's other function-scoped fixtures, so their own teardown has run by then."""
    digest = uuid.uuid5(uuid.NAMESPACE_URL, request.node.nodeid).hex[:8]
    session = _session_mark(request.config)
    mark = f"{session}/t{digest}-{uuid.uuid4().hex[:6]}"
    before = children()
    with mark_as(mark):
        yield Reaper(mark)
    owned = request.config.stash[_OWNED]
    left = leaked(mark, session, before, owned)
    if left:
        kill_all(left)
        late = leaked(mark, session, before, owned)  # started by one of them meanwhile
        kill_all(late)
        left.update(late)
    reap(mark)  # and wait for those it had killed itself to be gone
    if left:
        request.config.stash[_REAPED].append((request.node.nodeid, left))
        pytest.fail(f"the test left {len(left)} process(es) running when it ended (killed now): "
                    + "; ".join(f"{pid} {cmd[:160]}" for pid, cmd in sorted(left.items())), pytrace=False)


def pytest_terminal_summary(terminalreporter, config) -> None:
    reaped = config.stash.get(_REAPED, [])
    if reaped:
        terminalreporter.section("reaped")
        for nodeid, procs in reaped:
            terminalreporter.line(f"{nodeid}: killed {len(procs)} left-over process(es): "
                                  + "; ".join(f"{pid} {cmd[:100]}" for pid, cmd in sorted(procs.items())))
