"""A child that finishes closes its metrics server and then tears down (a learner after its last
snapshot): the supervisor's liveness probes in that window are refused, and a clean finish must
not log them as ``liveness_probe_failed`` or kill the child. One that closes its server and
stays is still failed, once ``EXIT_GRACE_S`` has passed. Real child processes and real probes."""

from __future__ import annotations

import os
import signal
import sys

from rlstream import supervisor
from rlstream.supervisor import Supervisor
from runtime.ports import LIVENESS_PROBE, Probe
from tests.rlstream.test_supervisor import Events
from tests.support import free_port, wait_for

#: Due at every ``check``: each poll of the test probes the child once.
EVERY_CALL = Probe(path=LIVENESS_PROBE.path, period_s=0.0, timeout_s=1.0,
                   failure_threshold=LIVENESS_PROBE.failure_threshold)

#: Serves /healthz until the file argv[2] exists, closes its server, then takes argv[3] seconds to exit.
FINISHING_CHILD = """
import http.server, pathlib, sys, threading, time
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *a):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H)
threading.Thread(target=server.serve_forever, daemon=True).start()
done = pathlib.Path(sys.argv[2])
while not done.exists():
    time.sleep(0.02)
server.shutdown()
server.server_close()
time.sleep(float(sys.argv[3]))
"""


def supervised(tmp_path, monkeypatch, teardown_s: float):
    """A supervisor with one ``learner`` child running ``FINISHING_CHILD``, every probe's detail
    recorded, the child answering its probes; returns (supervisor, events, details, done file)."""
    details: list[str] = []
    real = supervisor.http_probe

    def recorded(url: str, timeout_s: float):
        ok, detail = real(url, timeout_s)
        details.append(detail)
        return ok, detail

    monkeypatch.setattr(supervisor, "http_probe", recorded)
    events = Events()
    sup = Supervisor(dict(os.environ), tmp_path, max_restarts=0, log=events, liveness=EVERY_CALL, startup=EVERY_CALL)
    port, done = free_port(), tmp_path / "done"
    sup.spawn("learner", [sys.executable, "-c", FINISHING_CHILD, str(port), str(done), str(teardown_s)],
              health_url=f"http://127.0.0.1:{port}{LIVENESS_PROBE.path}")

    def answered() -> bool:
        sup.check(done_ok={"learner"})
        return sup.probes["learner"].answered

    wait_for(answered, 60, "the child answering its probe", every=0.02,
             on_timeout=lambda: sup.log_path("learner").read_text())
    return sup, events, details, done


def test_a_child_that_closes_its_server_and_exits_is_no_failed_probe(tmp_path, monkeypatch):
    sup, events, details, done = supervised(tmp_path, monkeypatch, teardown_s=1.5)
    try:
        done.touch()

        def exited() -> bool:
            sup.check(done_ok={"learner"})  # probes it all through its teardown
            return sup.procs["learner"].poll() is not None

        wait_for(exited, 60, "the child's clean exit", every=0.02)
        sup.check(done_ok={"learner"})
        assert any("refused" in d.lower() for d in details), details  # its teardown was probed
        assert sup.procs["learner"].returncode == 0
        assert [ev for ev, _ in events.lines] == [], (events.lines, sorted(set(details)))
        assert not sup.restarts and not sup.reasons and "learner" not in sup.killed
    finally:
        sup.stop(grace_s=0)


def test_a_child_whose_server_stays_closed_fails_after_the_grace(tmp_path, monkeypatch):
    sup, events, details, done = supervised(tmp_path, monkeypatch, teardown_s=600)
    sup.EXIT_GRACE_S = 0.5
    try:
        done.touch()
        child = sup.procs["learner"]

        def killed() -> bool:
            sup.probe()
            return child.poll() is not None

        wait_for(killed, 60, "the child killed after the grace", every=0.02)
        assert child.returncode == -signal.SIGKILL
        assert sup.killed["learner"].startswith("liveness probe failed 3 times in a row")
        assert supervisor.REFUSED in sup.killed["learner"]
        failed = [kw for ev, kw in events.lines if ev == "liveness_probe_failed"]
        assert [kw["failures"] for kw in failed] == [1, 2, 3]
    finally:
        sup.stop(grace_s=0)
