"""The decoupled run's supervisor ends its children: one that finished its work exits on its
own (exit 0), the others get SIGTERM. Real child processes."""

from __future__ import annotations

import os
import signal
import sys

from rlstream.decoupled import Supervisor


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
