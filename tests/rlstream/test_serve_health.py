"""``rlstream serve``'s latency health check: /healthz (the manifests' livenessProbe) fails while
the p99 of /act over a recent window is over ``--max-act-p99-ms``; too few requests count as healthy."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import yaml

from config import BusConfig
from logtools.serve import serve
from rlstream.wiring import build_bus, build_events
from runtime.http import LatencyWindow
from tests.rlstream.conftest import make_policy, publish_version
from tests.rlstream.test_serve import act, call
from tests.support import free_port, wait_for
from tests.timetravel.test_verify_colocated import ROOT

SERVE_YAML = Path(ROOT) / "compose" / "k8s" / "serve.yaml"


def liveness_path() -> str:
    """The path the serve Deployment's livenessProbe reads (what makes Kubernetes restart the pod)."""
    (dep,) = [d for d in yaml.safe_load_all(SERVE_YAML.read_text()) if d and d["kind"] == "Deployment"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c["livenessProbe"]["httpGet"]["path"]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_latency_window_p99_bound_min_count_and_expiry() -> None:
    clock = Clock()
    w = LatencyWindow(0.1, window_s=60.0, min_count=5, clock=clock)
    for _ in range(4):
        w.observe(1.0)  # slow, but only 4 requests: too few to judge
    assert w.check()[0] is True
    w.observe(1.0)
    ok, detail = w.check()
    assert ok is False and detail["requests"] == 5 and detail["p99_ms"] == 1000.0
    clock.t += 61.0  # the slow ones leave the window
    for _ in range(200):
        w.observe(0.01)
    w.observe(0.5)  # one slow request in 201 is under the 99th percentile
    ok, detail = w.check()
    assert ok is True and detail["requests"] == 201 and detail["p99_ms"] == 10.0
    for _ in range(3):
        w.observe(0.5)  # 4 in 204: now the p99 is slow
    assert w.check() == (False, {"requests": 204, "p99_ms": 500.0, "max_p99_ms": 100.0, "window_s": 60.0,
                                 "min_requests": 5})


def test_the_manifests_liveness_probe_is_the_path_the_latency_check_drives() -> None:
    """Kubernetes restarts the pod on livenessProbe failures: that probe must read /healthz, where
    the act_p99 check lives (the tests below call the path read from the manifest)."""
    assert liveness_path() == "/healthz"


def test_a_fast_server_is_healthy_under_the_default_bound(events) -> None:
    publish_version(events, 0)
    stop, started, ready = threading.Event(), {}, threading.Event()

    def on_started(s):
        started["s"] = s
        ready.set()

    t = threading.Thread(target=lambda: serve(events, port=0, stop=stop, host="127.0.0.1", on_started=on_started),
                         daemon=True)
    t.start()
    try:
        assert ready.wait(60)
        s = started["s"]
        assert s.wait_ready(30)
        for _ in range(30):
            assert act(s.url, [[0.0, 0.0, 0.0]])[0] == 200
        status, body = call(s.url + liveness_path())
        assert status == 200, body
        assert body["checks"]["act_p99"]["ok"] is True
        assert body["checks"]["act_p99"]["detail"]["requests"] == 30
        assert body["checks"]["act_p99"]["detail"]["max_p99_ms"] == 100.0
    finally:
        stop.set()
        t.join(60)


def test_the_serve_command_fails_liveness_when_act_is_slower_than_the_bound(tmp_path) -> None:
    """A real ``rlstream serve`` on a real small policy whose bound (1 us) every /act exceeds: healthy
    until ``--act-min-requests`` have answered, then 503 on the liveness path; still ready."""
    log = tmp_path / "log"
    bus = build_bus(BusConfig(kind="memory", log_dir=str(log)))
    publish_version(build_events(bus, None), 0, make_policy(0))
    bus.close()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "rlstream.cli", "serve", "--log-dir", str(log),
                             "--port", str(port), "--metrics-port", "-1", "--max-act-p99-ms", "0.001",
                             "--act-min-requests", "5"], cwd=str(ROOT), env=env,
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    def logs() -> str:
        return (tmp_path / "serve.log").read_text()[-2000:]

    try:
        def policy():
            if proc.poll() is not None:
                raise AssertionError(logs())
            return call(url + "/policy")[1]
        wait_for(lambda: isinstance(p := policy(), dict) and p.get("version") == 0, 120, "serve's policy",
                 on_timeout=logs, ignore=(OSError,))
        for i in range(5):
            status, body = call(url + liveness_path())
            assert status == 200, (i, body)  # fewer than 5 requests: too few to judge
            assert act(url, [[0.0, 0.0, 0.0]])[0] == 200
        status, body = call(url + liveness_path())
        assert status == 503, body
        assert body["checks"]["act_p99"]["ok"] is False
        assert body["checks"]["act_p99"]["detail"]["requests"] == 5
        assert body["checks"]["act_p99"]["detail"]["p99_ms"] > 0.001
        assert call(url + "/readyz")[0] == 200  # slow is a restart, not just out of rotation
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(30)
        out.close()


def test_a_bound_that_is_not_positive_is_a_clear_error(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "rlstream.cli", "serve", "--log-dir", str(tmp_path / "log"),
                        "--port", "0", "--metrics-port", "-1", "--max-act-p99-ms", "0"], cwd=str(ROOT),
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2 and "--max-act-p99-ms: must be positive" in r.stderr, r.stderr[-2000:]
