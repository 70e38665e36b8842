"""The decoupled run's supervisor ends its children: one that finished its work exits on its
own (exit 0), the others get SIGTERM; it probes their /healthz as the manifests' livenessProbe
does and restarts one that stops answering in time. Real child processes."""

from __future__ import annotations

import os
import signal
import sys

from config import BusConfig
from rlstream.supervisor import Supervisor
from rlstream.wiring import build_bus, build_events
from runtime.ports import LIVENESS_PROBE, STARTUP_PROBE, Probe
from tests.rlstream.conftest import make_policy, publish_version
from tests.rlstream.test_serve import act, call
from tests.support import free_port, wait_for
from tests.timetravel.test_verify_colocated import ROOT


def test_stop_lets_a_finishing_child_exit_on_its_own_and_terminates_the_rest(tmp_path):
    sup = Supervisor(dict(os.environ), tmp_path, max_restarts=0)
    sup.spawn("actor-0", [sys.executable, "-c", "import time; time.sleep(1.5)"])  # its teardown, still going
    sup.spawn("streams", [sys.executable, "-c", "import time; time.sleep(600)"])  # never ends by itself
    sup.stop(finishing=("actor-0",))
    assert sup.procs["actor-0"].returncode == 0
    assert sup.procs["streams"].returncode == -signal.SIGTERM


def test_a_finishing_child_that_does_not_exit_within_the_grace_is_terminated(tmp_path):
    sup = Supervisor(dict(os.environ), tmp_path, max_restarts=0)
    sup.spawn("actor-0", [sys.executable, "-c", "import time; time.sleep(600)"])
    sup.stop(finishing=("actor-0",), grace_s=0.5)
    assert sup.procs["actor-0"].returncode == -signal.SIGTERM


# -- liveness probes: a child that stops answering in time is killed and restarted ---------------

#: The manifests' probe, scaled down in time (same shape: period, timeout, 3 failures in a row).
FAST_LIVENESS = Probe(path=LIVENESS_PROBE.path, period_s=0.3, timeout_s=1.0,
                      failure_threshold=LIVENESS_PROBE.failure_threshold)
FAST_STARTUP = Probe(path=STARTUP_PROBE.path, period_s=0.3, timeout_s=1.0, failure_threshold=10_000)

#: A child whose /healthz always answers 200 at once.
HEALTHY_CHILD = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/healthz" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


class Events:
    """Records the supervisor's log calls (event, fields)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def warning(self, event: str, **kw) -> None:
        self.lines.append((event, kw))

    info = warning


def test_a_serve_child_that_stops_answering_or_is_slow_is_restarted_and_a_healthy_one_is_not(tmp_path):
    """A real ``rlstream serve`` under the supervisor, probed at the manifests' liveness path:
    SIGSTOPped, its probes time out and it is killed and restarted; the new one, made slow on
    ``/act`` (a bound every request exceeds), fails ``/healthz`` with 503 and is restarted again.
    A healthy child beside it is probed all along and never restarted."""
    log = tmp_path / "log"
    bus = build_bus(BusConfig(kind="memory", log_dir=str(log)))
    publish_version(build_events(bus, None), 0, make_policy(0))
    bus.close()
    port, healthy_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    events = Events()
    sup = Supervisor(env, tmp_path, max_restarts=2, log=events, liveness=FAST_LIVENESS, startup=FAST_STARTUP)
    sup.BACKOFF_S = 0.1
    sup.spawn("serve", [sys.executable, "-m", "rlstream.cli", "serve", "--log-dir", str(log), "--port", str(port),
                        "--metrics-port", "-1", "--max-act-p99-ms", "0.001", "--act-min-requests", "5"],
              health_url=url + LIVENESS_PROBE.path)
    sup.spawn("healthy", [sys.executable, "-c", HEALTHY_CHILD, str(healthy_port)],
              health_url=f"http://127.0.0.1:{healthy_port}{LIVENESS_PROBE.path}")
    healthy_pid = sup.procs["healthy"].pid

    def logs() -> str:
        return sup.log_path("serve").read_text()[-2000:] + f"\nrestarts: {sup.restarts}\nevents: {events.lines}"

    def serving(restarts: int):
        sup.check(done_ok=set())
        return (sup.restarts.get("serve", 0) == restarts and sup.probes["serve"].answered
                and sup.probes["healthy"].answered and call(url + "/policy")[0] == 200)

    try:
        wait_for(lambda: serving(0), 120, "serve answering its probe", on_timeout=logs, ignore=(OSError,))
        first = sup.procs["serve"]
        os.kill(first.pid, signal.SIGSTOP)  # alive, but answers nothing
        wait_for(lambda: serving(1), 120, "the stopped serve restarted", on_timeout=logs, ignore=(OSError,))
        assert first.returncode == -signal.SIGKILL
        assert sup.procs["serve"].pid != first.pid
        (r,) = sup.reasons
        assert r["role"] == "serve" and r["restart"] == 1
        assert r["reason"].startswith("liveness probe failed 3 times in a row") and "timed out" in r["reason"], r

        second = sup.procs["serve"]
        for _ in range(5):  # each /act is over the 1 us bound: /healthz turns 503 after 5
            assert act(url, [[0.0, 0.0, 0.0]])[0] == 200
        wait_for(lambda: serving(2), 120, "the slow serve restarted", on_timeout=logs, ignore=(OSError,))
        assert second.returncode == -signal.SIGKILL
        assert sup.reasons[1]["reason"].startswith("liveness probe failed 3 times") and "HTTP 503" in sup.reasons[1]["reason"]
        assert '"act_p99"' in sup.reasons[1]["reason"]
        restarting = [kw for ev, kw in events.lines if ev == "role_restarting"]
        assert [(kw["role"], kw["restart"]) for kw in restarting] == [("serve", 1), ("serve", 2)]
        assert all(kw["reason"].startswith("liveness probe failed") for kw in restarting)
        failed = [kw for ev, kw in events.lines if ev == "liveness_probe_failed"]
        assert {kw["role"] for kw in failed} == {"serve"} and len(failed) == 6

        assert "healthy" not in sup.restarts and sup.procs["healthy"].pid == healthy_pid
        assert sup.procs["healthy"].poll() is None and sup.probes["healthy"].failures == 0
    finally:
        for p in sup.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGCONT)
        sup.stop()


def test_without_probes_or_before_a_first_answer_nothing_is_killed(tmp_path):
    """``liveness=None`` probes nothing; a child that never answered (no server: its port lost)
    is asked at the start-up period and left running."""
    idle = [sys.executable, "-c", "import time; time.sleep(600)"]
    url = f"http://127.0.0.1:{free_port()}/healthz"
    off = Supervisor(dict(os.environ), tmp_path / "off", max_restarts=0, liveness=None)
    on = Supervisor(dict(os.environ), tmp_path / "on", max_restarts=0, liveness=FAST_LIVENESS, startup=FAST_STARTUP)
    for sup in (off, on):
        (tmp_path / ("off" if sup is off else "on")).mkdir()
        sup.spawn("actor-0", idle, health_url=url)
    off_next = off.probes["actor-0"].next_at
    asked: list[float] = []
    try:
        def probed_many() -> bool:
            off.check(done_ok=set())
            on.check(done_ok=set())
            if not asked or asked[-1] != on.probes["actor-0"].next_at:
                asked.append(on.probes["actor-0"].next_at)
            return len(asked) > 2 * FAST_LIVENESS.failure_threshold
        wait_for(probed_many, 60, "several start-up probes")
        for sup in (off, on):
            assert sup.procs["actor-0"].poll() is None and not sup.restarts and not sup.reasons
        assert on.probes["actor-0"].answered is False
        assert off.probes["actor-0"].next_at == off_next  # never probed
    finally:
        off.stop(grace_s=0)
        on.stop(grace_s=0)


def test_a_fenced_learner_is_not_restarted(tmp_path):
    """A learner that exits ``EXIT_FENCED`` (a newer one of its run and rank took over) stays down,
    though restarts are left: restarting it would fence the newer learner in turn."""
    import pytest

    from rlstream.supervisor import ChildExited
    from streams.bus.base import EXIT_FENCED

    sup = Supervisor(dict(os.environ), tmp_path, max_restarts=5)
    sup.spawn("learner", [sys.executable, "-c", f"raise SystemExit({EXIT_FENCED})"])
    try:
        sup.procs["learner"].wait(timeout=30)
        with pytest.raises(ChildExited, match="fenced"):
            sup.check(set())
        assert sup.restarts == {} and not sup.pending
    finally:
        sup.stop()
