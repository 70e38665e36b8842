"""``rlstream verify`` on a decoupled AGRO run on the real broker: learner, Faust stream worker
and actor as processes; the replay trains on what the learner recorded, whatever the actors'
timing, and reproduces every version bit for bit."""

from __future__ import annotations

import json
import uuid

import pytest

from config import BusConfig
from logtools.timetravel.lineage import lineage
from logtools.timetravel.record import load
from logtools.timetravel.verify import format_report, verify

from .recorded import ENV_ID
from .test_verify_colocated import cli

pytestmark = pytest.mark.kafka

# Fragments cut early by a new version make updates uneven: each trains at least BATCH and less
# than 2 * BATCH steps, and the last buffer (< BATCH) is never trained, so STEPS = 4 * BATCH
# guarantees at least 2 updates (3 versions to verify) whatever the actor's timing.
BATCH = 256
MIN_UPDATES = 2
STEPS = 4 * BATCH


def test_verify_reproduces_a_decoupled_agro_run_from_the_broker(rl_topics, tmp_path):
    run_id, policy_id = f"agro-{uuid.uuid4().hex[:8]}", f"tt-{uuid.uuid4().hex[:8]}"
    namespace = f"ns-{run_id}"  # verify reads the run's own namespace
    p = cli("train", "--mode", "decoupled", "--algo", "agro", "--env", ENV_ID, "--total-steps", str(STEPS),
            "--train-batch-size", str(BATCH), "--set", "update_epochs=1", "--set", "num_minibatches=4",
            "--bootstrap", rl_topics, "--run-dir", str(tmp_path / "run"), "--run-id", run_id,
            "--namespace", namespace, "--policy-id", policy_id, "--metrics-port", "-1", "--log-every", "60")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    updates = summary["processes"]["learner"]["updates"]
    assert updates >= MIN_UPDATES

    run = load(None, BusConfig(kind="kafka", bootstrap=rl_topics, namespace=namespace), run_id=run_id, policy_id=policy_id)
    assert len(run.steps) == updates and run.provenance(run.first_version)["determinism"]["threads"] == 1
    report = verify(run)
    assert report.ok, format_report(report)
    assert report.checked == list(range(run.first_version, run.first_version + updates + 1))
    lin = lineage(run, run.last_version)
    assert lin["num_gradient_steps"] == updates
    assert lin["transitions"] == summary["processes"]["learner"]["samples_trained"]

    p = cli("verify", "--bus", "kafka", "--bootstrap", rl_topics, "--run-id", run_id, "--policy-id", policy_id,
            "--namespace", namespace, "--json")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert json.loads(p.stdout)["versions_reproduced"] == updates + 1
