"""Run namespaces, runaway actors and decoupled progress on the real broker.

* two ``rlstream train --mode decoupled`` runs at once on one broker, each in its own namespace
  and under the same policy id: each learner trains only on batches its own actors published
  (``GradientStep.batch_ids``), nothing crosses, and both print parseable progress lines;
* a paused learner (SIGSTOP) holds an actor back at ``--max-steps-ahead`` and the stall shows in
  its ``/readyz``, its progress state and the run monitor; an actor with ``--actor-steps``
  publishes exactly its budget and exits 0;
* a child killed during ``train --mode decoupled`` fails the run with an error naming its log;
* actors whose budget is less than the learner needs end the run (drained), not hang it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

import pytest

from config import BusConfig, TrainConfig
from rlstream.monitor import RunMonitor
from runtime.rundir import RunDir
from runtime.progress import read_state
from schemas.codec import Codec
from schemas.events import GradientStep, SampleBatch
from streams.bus.kafka import KafkaBus
from streams.bus.namespaced import NamespacedBus
from streams.topics import LEARNER_GROUP, LEARNER_STEPS, POLICY_VERSIONS, SAMPLES_PREPARED, SAMPLES_RAW, Namespace

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parents[2]
ENV_ID = "InvertedPendulum-v5"
PROGRESS_FIELDS = {"steps": int, "pct": float, "sps": int, "episodes": int, "updates": int, "policy_version": int,
                   "stalled": list}
OPTIONAL_INT_FIELDS = ("policy_lag", "consumer_lag_raw", "consumer_lag_prepared")
OPTIONAL_FLOAT_FIELDS = ("return_mean20", "learner_idle_s")


def child_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for k in ("RLSTREAM_METRICS_PORT", "RLSTREAM_NAMESPACE"):
        env.pop(k, None)
    return env


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlstream.cli", *args]


def wait_for(cond, timeout: float, what: str, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def namespace(kafka_bootstrap):
    """``namespace() -> name``: a namespace unique to this test; its topics are deleted after."""
    made: list[str] = []

    def make() -> str:
        made.append(f"t{uuid.uuid4().hex[:10]}")
        return made[-1]

    yield make
    with KafkaBus(kafka_bootstrap, client_id="rlstream-test-cleanup") as admin:
        admin.delete_topics([t.name for ns in made for t in Namespace(ns).topics()])


def scoped_bus(bootstrap: str, ns: str) -> NamespacedBus:
    return NamespacedBus(KafkaBus(bootstrap, client_id="rlstream-test"), Namespace(ns))


def train_decoupled(bootstrap: str, run_dir: Path, ns: str, out: Path) -> subprocess.Popen:
    cmd = cli("train", "--mode", "decoupled", "--algo", "ppo", "--env", ENV_ID, "--total-steps", "2048",
              "--train-batch-size", "1024", "--bootstrap", bootstrap, "--run-dir", str(run_dir),
              "--metrics-port", "-1", "--log-every", "2", "--log-json", "--namespace", ns)
    return subprocess.Popen(cmd, cwd=str(ROOT), env=child_env(), stdout=out.open("w"), stderr=subprocess.STDOUT)


def progress_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("{") and '"progress"' in line:
            rec = json.loads(line)
            if rec.get("event") == "progress" and rec.get("role") == "decoupled":
                out.append(rec)
    return out


def test_two_decoupled_runs_share_a_broker_and_nothing_crosses(kafka_bootstrap, namespace, tmp_path):
    runs = {}
    for name in ("a", "b"):  # same policy id, same actor ids: only the namespace keeps them apart
        ns, out = namespace(), tmp_path / f"{name}.out"
        runs[name] = (ns, out, train_decoupled(kafka_bootstrap, tmp_path / name, ns, out))
    for name, (ns, out, p) in runs.items():
        rc = p.wait(timeout=600)
        assert rc == 0, out.read_text()[-4000:]
    codec = Codec()
    raw_ids, trained = {}, {}
    for name, (ns, out, p) in runs.items():
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["namespace"] == ns and set(summary["exit_codes"].values()) == {0}
        assert summary["ended"] == "learner_done"
        assert summary["processes"]["learner"]["updates"] == 2
        with scoped_bus(kafka_bootstrap, ns) as bus:
            raw = [codec.decode(r.value, SampleBatch) for r in bus.read_all(SAMPLES_RAW)]
            steps = [codec.decode(r.value, GradientStep) for r in bus.read_all(LEARNER_STEPS)]
            assert bus.group_lag(LEARNER_GROUP, SAMPLES_PREPARED) == 0  # its own group, at the end
        assert sum(b.size for b in raw) == 2048  # the actor kept to its budget
        raw_ids[name] = {b.batch_id for b in raw}
        trained[name] = [bid for s in steps for bid in s.batch_ids]
        lines = progress_lines(out.read_text())
        assert len(lines) >= 2, out.read_text()[-3000:]
        for line in lines:
            for k, t in PROGRESS_FIELDS.items():
                assert isinstance(line[k], t), (k, line)
            for k in OPTIONAL_INT_FIELDS:
                assert line[k] is None or isinstance(line[k], int), (k, line)
            for k in OPTIONAL_FLOAT_FIELDS:
                assert line[k] is None or isinstance(line[k], float), (k, line)
        assert lines[-1]["steps"] == 2048 and lines[-1]["updates"] == 2 and lines[-1]["pct"] == 100.0
        assert any(line["return_mean20"] is not None for line in lines)
    for name, other in (("a", "b"), ("b", "a")):
        assert len(trained[name]) == 2 and set(trained[name]) <= raw_ids[name], (trained[name], raw_ids[name])
        assert not set(trained[name]) & raw_ids[other]
        assert not raw_ids[name] & raw_ids[other]


def test_a_stalled_learner_holds_actors_back_and_budgets_hold(kafka_bootstrap, namespace, tmp_path):
    ns, run_dir = namespace(), tmp_path / "run"

    def role(name: str, *extra: str) -> list[str]:
        return cli(name, "--algo", "ppo", "--env", ENV_ID, "--num-envs", "1", "--fragment-steps", "64",
                   "--train-batch-size", "1024", "--total-steps", "100000", "--bootstrap", kafka_bootstrap,
                   "--namespace", ns, "--run-dir", str(run_dir), "--log-every", "1", "--log-json", *extra)

    procs: list[subprocess.Popen] = []

    def start(cmd: list[str], log: str) -> subprocess.Popen:
        procs.append(subprocess.Popen(cmd, cwd=str(ROOT), env=child_env(), stdout=(tmp_path / log).open("w"),
                                      stderr=subprocess.STDOUT))
        return procs[-1]

    bus = scoped_bus(kafka_bootstrap, ns)
    learner = start(role("learner", "--metrics-port", "-1"), "learner.out")
    try:
        wait_for(lambda: sum(bus.end_offsets(POLICY_VERSIONS).values()) >= 1, 180, "the learner's version 0")
        os.kill(learner.pid, signal.SIGSTOP)  # a paused learner: no update, no new version
        port = free_port()
        start(role("actor", "--index", "0", "--max-steps-ahead", "300", "--max-backlog", "2",
                   "--metrics-port", str(port)), "a0.out")
        budgeted = start(role("actor", "--index", "1", "--actor-steps", "200", "--metrics-port", "-1"), "a1.out")
        assert budgeted.wait(timeout=300) == 0, (tmp_path / "a1.out").read_text()[-3000:]

        def readyz():
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2)
                return None
            except urllib.error.HTTPError as e:
                return json.loads(e.read()) if e.code == 503 else None
            except OSError:
                return None

        body = wait_for(readyz, 300, "the stalled actor's /readyz to fail")
        check = body["checks"]["learner_progress"]
        assert check["ok"] is False and check["detail"]["stalled"] is True and check["detail"]["steps_ahead"] == 320
        state = wait_for(lambda: (s := read_state(state_path_of(run_dir, "actor-0"))) and s.get("stalled_s", 0) >= 2
                         and s, 120, "two seconds of stall in the actor's progress")
        assert state["stalled"] is True and state["steps"] == 320
        per_actor = Counter()
        codec = Codec()
        for r in bus.read_all(SAMPLES_RAW):
            b = codec.decode(r.value, SampleBatch)
            per_actor[b.actor_id] += b.size
        # 5 fragments of 64 steps passed the bound of 300; none after, however long the stall, as
        # no processor consumes them (a backlog above 2)
        assert per_actor == {"actor-0": 320, "actor-1": 200}
        cfg = TrainConfig(run_dir=run_dir, total_steps=100000, num_actors=2,
                          bus=BusConfig(kind="kafka", bootstrap=kafka_bootstrap, namespace=ns))
        fields = RunMonitor(cfg, bus, ["actor-0", "actor-1"]).fields()
        assert fields["stalled"] == ["actor-0"] and fields["steps"] == 520 and fields["updates"] == 0
    finally:
        if learner.poll() is None:
            os.kill(learner.pid, signal.SIGCONT)
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        bus.close()


def state_path_of(run_dir: Path, name: str) -> Path:
    return RunDir(run_dir).state_file(name)


def test_a_dead_child_past_its_restarts_fails_the_run_naming_its_log(kafka_bootstrap, namespace, tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "train.out"
    ns = namespace()
    cmd = cli("train", "--mode", "decoupled", "--algo", "ppo", "--env", ENV_ID, "--total-steps", "1000000",
              "--bootstrap", kafka_bootstrap, "--run-dir", str(run_dir), "--metrics-port", "-1",
              "--log-every", "1", "--namespace", ns, "--max-restarts", "0")
    p = subprocess.Popen(cmd, cwd=str(ROOT), env=child_env(), stdout=out.open("w"), stderr=subprocess.STDOUT)
    try:
        state = wait_for(lambda: read_state(state_path_of(run_dir, "actor-0")), 300, "the actor's first progress")
        os.kill(state["pid"], signal.SIGKILL)
        assert p.wait(timeout=120) == 1
    finally:
        if p.poll() is None:
            p.kill()
    text = out.read_text()
    assert (f"error: actor-0 exited with code -9 after 0 restart(s) (--deploy.max-restarts 0); "
            f"see its log {run_dir / 'actor-0.log'}") in text, text[-3000:]


def test_the_run_ends_once_actors_spent_their_budget_and_the_learner_is_idle(kafka_bootstrap, namespace, tmp_path):
    """Actors with less budget than the learner needs: the run does not hang, it drains."""
    run_dir, out = tmp_path / "run", tmp_path / "train.out"
    cmd = cli("train", "--mode", "decoupled", "--algo", "ppo", "--env", ENV_ID, "--total-steps", "2048",
              "--train-batch-size", "1024", "--actor-steps", "1024", "--bootstrap", kafka_bootstrap,
              "--run-dir", str(run_dir), "--metrics-port", "-1", "--log-every", "2", "--namespace", namespace())
    p = subprocess.run(cmd, cwd=str(ROOT), env=child_env(), stdout=out.open("w"), stderr=subprocess.STDOUT,
                       timeout=600)
    assert p.returncode == 0, out.read_text()[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ended"] == "drained" and set(summary["exit_codes"].values()) == {0}
    assert summary["processes"]["actor-0"]["steps"] == 1024 and summary["processes"]["learner"]["updates"] == 1
    assert "learner_drained" in out.read_text()
