"""The supervisor counts liveness failures *in a row*, as the kubelet does: a probe that passes
resets the count, so a child that fails now and then is never killed, and one that fails
``failure_threshold`` times running is. The probe's answers are scripted (a real child process,
no server): tests/rlstream/test_supervisor.py drives a real ``rlstream serve``."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from rlstream import supervisor
from rlstream.supervisor import Supervisor
from runtime.ports import LIVENESS_PROBE, Probe

#: Due at every ``probe()`` call: the answers, not the clock, are what is tested.
EVERY_CALL = Probe(path=LIVENESS_PROBE.path, period_s=0.0, timeout_s=1.0,
                   failure_threshold=LIVENESS_PROBE.failure_threshold)


def test_failures_count_in_a_row_and_a_passing_probe_resets_them(tmp_path, monkeypatch: pytest.MonkeyPatch):
    answers = [True,  # start-up: answered
               False, False, True, False, False, True, False, False, True,  # never 3 running
               False, False, False]  # 3 in a row: killed
    asked = []

    def scripted(url: str, timeout_s: float):
        asked.append(url)
        ok = answers[len(asked) - 1]
        return ok, "HTTP 200" if ok else "HTTP 503: slow"

    monkeypatch.setattr(supervisor, "http_probe", scripted)
    sup = Supervisor(dict(os.environ), tmp_path, max_restarts=1, liveness=EVERY_CALL, startup=EVERY_CALL)
    sup.spawn("serve", [sys.executable, "-c", "import time; time.sleep(600)"], health_url="http://127.0.0.1:9/healthz")
    child = sup.procs["serve"]
    try:
        for i in range(10):
            sup.probe()
            assert child.poll() is None and "serve" not in sup.killed, (i, sup.probes["serve"])
        assert sup.probes["serve"].answered and sup.probes["serve"].failures == 0
        for _ in range(3):
            sup.probe()
        assert len(asked) == len(answers)
        assert child.poll() == -signal.SIGKILL
        assert sup.killed["serve"].startswith("liveness probe failed 3 times in a row")
    finally:
        sup.stop(grace_s=0)
