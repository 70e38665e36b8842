"""The suite's own plugins, each run in a pytest of its own: ``tests.support.reaper`` (every
process a test starts ends with it, pass or fail, and a test that leaves one running fails),
``tests.support.services`` (the ``kafka``/``redis`` marks follow the fixtures; under ``CI=true`` a
skip for a missing service fails) and ``tests.support.seeds`` (one printed seed replays the
order and the hypothesis examples)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from testbed.wait import wait_for
from tests.support.reaper import marked

ROOT = Path(__file__).resolve().parents[1]


def pytest_in(where: Path, source: str, *args: str, env: dict[str, str] | None = None,
              timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``source`` (a test module) in a pytest of its own with the suite's plugins, in order."""
    (where / "test_inner.py").write_text(textwrap.dedent(source))
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                **(env or {})}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly",
                           "-p", "tests.support.reaper", "-p", "tests.support.services", "-q", "-rA",
                           "test_inner.py", *args], cwd=where, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def leak_reports(stdout: str) -> dict[str, str]:
    """test name -> the reaper's report of what that test left running, from a pytest's output."""
    out, test = {}, None
    for line in stdout.splitlines():
        head = re.match(r"_+ ERROR at teardown of (\S+) _+$", line)
        if head:
            test = head.group(1)
        elif test and line.startswith("the test left "):
            out[test], test = line, None
    return out


def running(pid: int, start: int) -> bool:
    """Whether the process ``pid`` that started at ``start`` (clock ticks since boot) still runs
    (another start time: the pid was reused; a zombie has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return int(fields[19]) == start and fields[0] != "Z"


# The failing test of a decoupled run: it starts ``rlstream train --mode decoupled`` (its own
# session; the learner, the Faust worker and the actor each in a session of their own), records
# them, and raises. ``test_after`` runs next and looks for any of them.
DECOUPLED = """
import json, os, subprocess, sys, time
from pathlib import Path

OUT = Path(os.environ["INNER_OUT"])


def stat(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return {"state": fields[0], "ppid": int(fields[1]), "pgrp": int(fields[2]), "sid": int(fields[3]),
            "start": int(fields[19])}


def children(pid):
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                st = stat(int(name))
            except (OSError, IndexError, ValueError):
                continue
            if st["ppid"] == pid:
                out[int(name)] = st
    return out


def test_a_decoupled_run_then_a_failure(tmp_path):
    run = subprocess.Popen(
        [sys.executable, "-m", "rlstream.cli", "train", "--mode", "decoupled", "--algo", "ppo", "--env",
         "Pendulum-v1", "--total-steps", "100000000", "--bootstrap", os.environ["INNER_BOOTSTRAP"],
         "--run-dir", str(tmp_path / "run"), "--metrics-port", "-1", "--log-every", "60"],
        stdout=(tmp_path / "train.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 240
    kids = {}
    while len(kids) < 3 and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
        kids = children(run.pid)
    assert len(kids) >= 3, (tmp_path / "train.log").read_text()[-3000:]
    (OUT / "run.json").write_text(json.dumps({
        "mark": os.environ["RLSTREAM_TEST_PROCS"], "parent": [run.pid, stat(run.pid)],
        "children": {str(pid): st for pid, st in kids.items()}}))
    raise AssertionError("a deliberate failure, the run still going")


def test_after():
    rec = json.loads((OUT / "run.json").read_text())
    alive = []
    for pid, st in [rec["parent"], *rec["children"].items()]:
        try:
            now = stat(int(pid))
        except OSError:
            continue  # gone
        if now["start"] == st["start"] and now["state"] != "Z":  # the same process, not ended
            alive.append(int(pid))
    (OUT / "after.json").write_text(json.dumps({"alive": alive}))
"""


def test_no_process_of_a_failed_decoupled_run_is_left(rl_kafka, tmp_path):
    """A test that starts a decoupled run and fails leaves none of its processes: not the parent,
    nor the children the supervisor put in sessions of their own; gone by the next test."""
    p = pytest_in(tmp_path, DECOUPLED, env={"INNER_BOOTSTRAP": rl_kafka, "INNER_OUT": str(tmp_path),
                                            "OMP_NUM_THREADS": "1"})
    assert "1 failed, 1 passed, 1 error" in p.stdout and "a deliberate failure" in p.stdout, p.stdout[-4000:]
    leak = leak_reports(p.stdout)
    assert set(leak) == {"test_a_decoupled_run_then_a_failure"} and "rlstream" in leak[
        "test_a_decoupled_run_then_a_failure"], p.stdout[-4000:]
    rec = json.loads((tmp_path / "run.json").read_text())
    parent_pid, parent = rec["parent"]
    kids = {int(pid): st for pid, st in rec["children"].items()}
    # the run really was a supervisor with children in sessions of their own
    assert len(kids) >= 3 and all(st["sid"] == pid != parent["sid"] for pid, st in kids.items()), rec
    assert json.loads((tmp_path / "after.json").read_text()) == {"alive": []}
    for pid, st in [(parent_pid, parent), *kids.items()]:
        assert not running(pid, st["start"]), f"process {pid} of the failed run is still running"
    assert marked(rec["mark"].rsplit("/", 1)[0]) == {}  # nothing at all of the inner session


GROUP = """
import os, subprocess, time

def test_starts_a_group_whose_member_cleared_its_environment():
    # sh (marked) leads a new session; its child sleep has an empty environment
    subprocess.Popen(["setsid", "sh", "-c", "env -i sleep 1000 & echo $! > sleep.pid; wait"])
    for _ in range(600):  # until the child is sleep, no longer the forked (marked) sh
        try:
            with open(f"/proc/{int(open('sleep.pid').read())}/cmdline", "rb") as f:
                if f.read().startswith(b"sleep"):
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise AssertionError("sleep did not start")

def test_after():
    pid = int(open("sleep.pid").read())
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        assert b"sleep" not in f.read()
"""


def test_a_process_without_the_mark_dies_with_the_group_it_is_in(tmp_path):
    p = pytest_in(tmp_path, GROUP)
    assert p.stdout.splitlines()[-1].startswith("2 passed, 1 error"), p.stdout[-3000:]
    leak = leak_reports(p.stdout).get("test_starts_a_group_whose_member_cleared_its_environment", "")
    assert re.match(r"the test left 2 process\(es\) .*sh -c .*sleep 1000$", leak), p.stdout[-3000:]


SESSION = """
import os, shutil, subprocess, pytest

SLEEP = shutil.which("sleep")

@pytest.fixture(scope="session")
def server():
    proc = subprocess.Popen([SLEEP, "1000"])
    yield proc
    proc.kill()

@pytest.fixture(scope="session")
def server_own_env():  # no mark: its own environment
    proc = subprocess.Popen([SLEEP, "1001"], env={}, start_new_session=True)
    yield proc
    proc.kill()

@pytest.fixture
def helper():
    return subprocess.Popen([SLEEP, "1002"])

def test_first(helper, request):
    request.getfixturevalue("server")  # set up inside the test
    request.getfixturevalue("server_own_env")
    open("helper.pid", "w").write(str(helper.pid))

def test_second(server, server_own_env):
    assert server.poll() is None and server_own_env.poll() is None  # the session's, not test_first's
    helper = int(open("helper.pid").read())
    assert not os.path.exists(f"/proc/{helper}") or open(f"/proc/{helper}/stat").read().split()[2] == "Z"
"""


def test_a_session_fixtures_process_outlives_the_test_that_started_it(tmp_path):
    """A session fixture's processes are its own, whatever their environment; the function
    fixture's process that nobody ends is test_first's leak."""
    p = pytest_in(tmp_path, SESSION)
    assert p.stdout.splitlines()[-1].startswith("2 passed, 1 error"), p.stdout[-3000:]
    leak = leak_reports(p.stdout)
    assert set(leak) == {"test_first"} and "left 1 process(es)" in leak["test_first"], p.stdout[-3000:]
    assert leak["test_first"].endswith("sleep 1002"), p.stdout[-3000:]


LEAKS = """
import os, shutil, signal, subprocess, time

SLEEP = shutil.which("sleep")

def wait_for_file(name):
    deadline = time.monotonic() + 30
    while not (os.path.exists(name) and open(name).read().strip()):
        assert time.monotonic() < deadline, name
        time.sleep(0.02)

def test_leaks_a_child():
    p = subprocess.Popen([SLEEP, "2001"])
    open("child.pid", "w").write(str(p.pid))

def test_leaks_a_session_with_an_environment_of_its_own():
    # no mark in its environment, a session of its own, and a grandchild in it
    p = subprocess.Popen(["sh", "-c", f"{SLEEP} 2002 & echo $! > grandchild.pid; wait"], env={},
                         start_new_session=True)
    open("own_env.pid", "w").write(str(p.pid))
    wait_for_file("grandchild.pid")

def test_ends_what_it_starts():
    p = subprocess.Popen([SLEEP, "2003"], env={}, start_new_session=True)
    os.killpg(p.pid, signal.SIGTERM)
    p.wait()

def test_kills_without_waiting():
    subprocess.Popen([SLEEP, "2004"]).kill()  # already dying when the test ends: no leak

def test_after():
    for name in ("child.pid", "own_env.pid", "grandchild.pid"):
        pid = int(open(name).read())
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z", name
"""


def test_a_test_that_leaves_a_process_running_fails_naming_it(tmp_path):
    """A leak fails the test that leaked (an error at its teardown that names each process),
    with or without the reaper's mark in the process's environment, and the process is gone
    before the next test; a test that ends its processes, or has killed them, passes."""
    p = pytest_in(tmp_path, LEAKS)
    lines = p.stdout.splitlines()
    assert lines[-1].startswith("5 passed, 2 errors"), p.stdout[-3000:]
    errors = leak_reports(p.stdout)
    assert set(errors) == {"test_leaks_a_child", "test_leaks_a_session_with_an_environment_of_its_own"}, p.stdout[-3000:]
    child = int((tmp_path / "child.pid").read_text())
    assert f"left 1 process(es) running when it ended (killed now): {child} " in errors["test_leaks_a_child"]
    assert errors["test_leaks_a_child"].endswith("sleep 2001")
    own, grandchild = (int((tmp_path / n).read_text()) for n in ("own_env.pid", "grandchild.pid"))
    session = errors["test_leaks_a_session_with_an_environment_of_its_own"]
    assert "left 2 process(es)" in session and f"{own} sh -c" in session and f"{grandchild} " in session, session


HYPOTHESIS = """
import os
from hypothesis import given, strategies as st

@given(st.integers(0, 10**9))
def test_records(x):
    with open(os.environ["EXAMPLES"], "a") as f:
        f.write(f"{x}\\n")

@given(st.integers(0, 1000))
def test_fails_above_700(x):
    assert x < 700
"""


def test_hypothesis_prints_the_seed_of_a_failure_and_the_seed_replays_the_examples(tmp_path):
    """Under CI, as .ci/run runs it: a failed hypothesis test names the run's seed and the
    example's blob; the same seed draws the same examples, another seed others."""
    def run(seed: int, name: str) -> tuple[subprocess.CompletedProcess, list[str]]:
        examples = tmp_path / name
        p = pytest_in(tmp_path, HYPOTHESIS, "-p", "tests.support.seeds", f"--random-order-seed={seed}",
                      env={"CI": "true", "EXAMPLES": str(examples)})
        return p, examples.read_text().split()

    p, first = run(1234, "a")
    assert "1 failed, 1 passed" in p.stdout.splitlines()[-1], p.stdout[-3000:]
    assert "hypothesis seed 1234: rerun with --hypothesis-seed=1234" in p.stdout, p.stdout[-3000:]
    assert "@reproduce_failure(" in p.stdout and "x=700" in p.stdout, p.stdout[-3000:]
    _, again = run(1234, "b")
    _, other = run(4321, "c")
    assert len(first) > 50 and first == again, (first[:5], again[:5])
    assert set(first) != set(other), first[:5]


MARKS = """
import pytest

@pytest.fixture(scope="session")
def kafka_bootstrap():
    return "127.0.0.1:1"

@pytest.fixture(scope="session")
def redis_server_url():
    return "redis://127.0.0.1:1/0"

@pytest.fixture
def through_another(kafka_bootstrap):
    return kafka_bootstrap

def test_plain():
    pass

def test_kafka(kafka_bootstrap):
    pass

def test_kafka_through_a_fixture(through_another):
    pass

def test_redis(redis_server_url):
    pass

def test_both(kafka_bootstrap, redis_server_url):
    pass
"""


@pytest.mark.parametrize(("select", "expect"), [
    ("not kafka and not redis", {"test_plain"}),
    ("kafka", {"test_kafka", "test_kafka_through_a_fixture", "test_both"}),
    ("redis", {"test_redis", "test_both"}),
])
def test_the_kafka_and_redis_marks_follow_the_fixtures(tmp_path, select, expect):
    p = pytest_in(tmp_path, MARKS, "-m", select, "--strict-markers", "-o",
                  "markers=kafka\nredis", "--collect-only")
    got = {line.split("::")[1] for line in p.stdout.splitlines() if "::" in line}
    assert got == expect, p.stdout[-3000:]


SKIPS = """
import pytest

@pytest.fixture
def broker():
    pytest.skip("no Kafka broker for the kafka tests: LocalKafka did not start")

def test_no_broker(broker):
    pass

def test_no_redis():
    pytest.skip("REDIS_URL unset and no redis-server on PATH")

def test_no_java():
    pytest.skip("javac not found (install a JDK 17)")

def test_no_gpu():
    pytest.skip("needs a CUDA device")
"""


@pytest.mark.parametrize("ci", ["true", ""])
def test_in_ci_a_skip_for_a_missing_service_fails(tmp_path, ci):
    p = pytest_in(tmp_path, SKIPS, env={"CI": ci})
    lines = p.stdout.splitlines()
    if ci:
        for outcome, test in (("ERROR", "test_no_broker"), ("FAILED", "test_no_redis"), ("FAILED", "test_no_java")):
            assert any(ln.startswith(f"{outcome} test_inner.py::{test} - CI=true") for ln in lines), p.stdout[-3000:]
        assert any(ln.startswith("SKIPPED") and "needs a CUDA device" in ln for ln in lines), p.stdout[-3000:]
        assert lines[-1].startswith("2 failed, 1 skipped, 1 error"), p.stdout[-3000:]
    else:
        assert lines[-1].startswith("4 skipped"), p.stdout[-3000:]


CRASH = """
import os, subprocess

def test_starts_a_process_and_takes_its_pytest_down():
    proc = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    open("sleep.pid", "w").write(str(proc.pid))
    os._exit(3)  # no teardown, no reaper of its own
"""


def test_a_pytest_run_by_a_test_leaves_its_processes_to_that_tests_reaper(tmp_path, reaper):
    p = pytest_in(tmp_path, CRASH)
    assert p.returncode == 3, p.stdout[-3000:]
    pid = int((tmp_path / "sleep.pid").read_text())
    assert pid in reaper.alive()  # the inner session's mark extends this test's
    os.killpg(pid, signal.SIGKILL)  # this test's to end (left running, it would fail this test)


NO_NAMESPACES = """
from testbed import netns

netns.unavailable = lambda: "a machine without namespaces (this test's stand-in)"
"""


@pytest.mark.parametrize("ci", ["true", ""])
def test_the_netns_harness_tests_fail_in_ci_where_namespaces_are_unavailable(tmp_path, ci):
    """tests/hosts/test_netns.py on a machine where namespaces cannot be made: under CI=true
    (.ci/run installs iproute2 and nftables, and runs as root) every one fails; elsewhere they skip."""
    (tmp_path / "no_namespaces.py").write_text(NO_NAMESPACES)
    env = {**os.environ, "CI": ci, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no_namespaces", "-q", "-rA",
                        "--random-order-bucket=none", "tests/hosts/test_netns.py"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = p.stdout.splitlines()
    if ci:
        assert lines[-1].startswith("4 failed") or lines[-1].startswith("1 failed, 3 errors"), p.stdout[-3000:]
        assert sum("CI=true" in ln and "namespaces unavailable" in ln for ln in lines) >= 4, p.stdout[-3000:]
    else:
        assert lines[-1].startswith("4 skipped"), p.stdout[-3000:]


@pytest.mark.kafka
def test_a_groups_reassignments_are_read_from_the_broker_and_bound_what_is_handed_again(kafka_bootstrap):
    """``tests.support.kafka.GroupGenerations``, the oracle the duplicate-counting tests bound
    their redeliveries with: a member that reads every record and leaves without committing, then
    a second: the second assignment is the one reassignment, and it hands each record again once."""
    import uuid

    from confluent_kafka import Consumer, Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    from tests.support.kafka import GroupGenerations, handed_again_at_most

    topic, group = f"t-generations-{uuid.uuid4().hex[:8]}", f"g-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    try:
        producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
        for i in range(3):
            producer.produce(topic, str(i).encode())
        assert producer.flush(30) == 0
        generations = GroupGenerations(kafka_bootstrap, group)
        handed: list[bytes] = []

        def member_reads_all() -> None:
            c = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group, "auto.offset.reset": "earliest",
                          "enable.auto.commit": False})
            c.subscribe([topic])
            got: list[bytes] = []

            def all_read() -> bool:
                m = c.poll(0.5)
                if m is not None and not m.error():
                    got.append(m.value())
                return len(got) == 3
            try:
                wait_for(all_read, 120, "a member to read the 3 records", every=0)
            finally:
                c.close()  # leaves the group, nothing committed
            handed.extend(got)

        member_reads_all()
        assert generations.reassignments() == 0
        member_reads_all()
        assert generations.reassignments() == 1
        again = len(handed) - 3
        assert again == 3 == handed_again_at_most(generations.reassignments(), 0, 3)
    finally:
        admin.delete_topics([topic])


TERMINATED = """
import os, shutil, subprocess, time, pytest

@pytest.fixture(scope="session")
def server():
    proc = subprocess.Popen([shutil.which("sleep"), "3001"], start_new_session=True)
    open("server.pid", "w").write(str(proc.pid))
    yield proc
    proc.kill()

def test_runs_until_terminated(server):
    open("started", "w").write("yes")
    time.sleep(600)  # the outer test's SIGTERM ends this run
"""


def test_a_terminated_run_still_ends_its_sessions_processes(tmp_path):
    """A CI stage's budget ends pytest with SIGTERM (``timeout --signal=TERM``): the run is
    interrupted as by Ctrl-C and still reaps what its session fixtures started (a broker)."""
    (tmp_path / "test_inner.py").write_text(TERMINATED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "tests.support.reaper", "-q",
                          "test_inner.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    try:
        wait_for(lambda: (tmp_path / "started").exists(), 120, "the inner test to start")
        server = int((tmp_path / "server.pid").read_text())
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert "KeyboardInterrupt" in out, out[-3000:]
    gone = wait_for(lambda: not os.path.exists(f"/proc/{server}") or open(f"/proc/{server}/stat").read().split()[2]
                    == "Z" or None, 10, "the session's server to be gone")
    assert gone
