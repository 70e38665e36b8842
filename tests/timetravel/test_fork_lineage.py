"""``rlstream fork`` from a version of the recorded run, and ``rlstream lineage`` of versions."""

from __future__ import annotations

import json

from .recorded import UPDATES
from learner.provenance import digest
from logtools.timetravel.fork import fork
from logtools.timetravel.lineage import lineage
from logtools.timetravel.record import load
from logtools.timetravel.verify import format_report, recorded_weights, verify
from .test_verify_colocated import cli

V = 2


def weights(run, version: int) -> str:
    return digest(recorded_weights(run.versions[version][1]))


def test_fork_with_identical_settings_reproduces_the_next_versions(colocated_run, tmp_path):
    run_dir, _ = colocated_run
    parent = load(run_dir)
    out = tmp_path / "fork"
    summary = fork(parent, V, out, run_id="child", parent_snapshots=run_dir / "snapshots")
    assert summary["updates"] == UPDATES - V and summary["final_policy_version"] == UPDATES
    child = load(out)
    assert child.run_id == "child" and sorted(child.versions) == list(range(V, UPDATES + 1))
    for v in range(V, UPDATES + 1):
        assert weights(child, v) == weights(parent, v), v
        assert child.versions[v][1].state_sha256 == parent.versions[v][1].state_sha256, v
    assert child.provenance(V + 1)["fork_of"] == {"run_id": "parent", "version": V, "source": str(run_dir)}
    # the fork verifies from its own log and the snapshot of V it was given
    report = verify(child, out / "snapshots")
    assert report.ok and report.checked == list(range(V, UPDATES + 1)), format_report(report)
    # lineage crosses the fork: V+1.. in the child, 1..V in the parent
    lin = lineage(child, UPDATES)
    assert lin["origin_version"] == V and lin["gradient_steps"] == list(range(V + 1, UPDATES + 1))
    assert lin["fork_of"]["run_id"] == "parent" and lin["parent"]["version"] == V
    assert lin["parent"]["num_gradient_steps"] == V and lin["parent"]["origin_version"] == 0


def test_fork_command_with_a_changed_hyperparameter_starts_at_v_then_departs(colocated_run, tmp_path):
    run_dir, _ = colocated_run
    out = tmp_path / "lr"
    p = cli("fork", str(run_dir), "--from-version", str(V), "--set", "learning_rate=0.01", "--out", str(out))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    summary = json.loads(p.stdout)["fork"]
    assert summary["overrides"] == {"learning_rate": 0.01} and summary["updates"] == UPDATES - V
    parent, child = load(run_dir), load(out)
    assert weights(child, V) == weights(parent, V)
    assert weights(child, V + 1) != weights(parent, V + 1)
    assert child.provenance(V + 1)["config"]["learning_rate"] == 0.01
    assert verify(child, out / "snapshots").ok
    p = cli("fork", str(run_dir), "--from-version", "99", "--out", str(tmp_path / "none"))
    assert p.returncode == 2 and "version 99 is not a version of run" in p.stderr


def test_lineage_counts_match_the_run_summary(colocated_run):
    run_dir, summary = colocated_run
    final = summary["final_policy_version"]
    lin = lineage(load(run_dir), final)
    assert lin["num_gradient_steps"] == summary["updates"]
    assert lin["num_batches"] == summary["events"]["rl.samples.prepared"] == summary["streams"]["emitted_batches"]
    assert lin["transitions"] == summary["steps"] == summary["streams"]["emitted_samples"]
    assert len(lin["dropped"]) == summary["events"]["rl.deadletter"] + sum(summary["streams"]["drops"].values())
    assert lin["behaviour_versions"] == {v: 1 for v in range(UPDATES)}  # on-policy: one fragment per version
    assert list(lin["actors"]) == ["actor-0"] and lin["actors"]["actor-0"]["actor_seed"] == 5 * 7919
    earlier = lineage(load(run_dir), 2)
    assert earlier["num_gradient_steps"] == 2 and earlier["transitions"] == 2 * summary["steps"] // UPDATES
    p = cli("lineage", str(run_dir), "--version", str(final), "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["num_batches"] == lin["num_batches"]
    p = cli("lineage", str(run_dir), "--version", "2")
    assert p.returncode == 0 and "2 gradient steps from version 0, 2 batches" in p.stdout, p.stdout + p.stderr


def test_lineage_lists_what_was_dead_lettered_before_the_version_with_its_reason(colocated_run, tmp_path):
    from schemas.codec import Codec
    from schemas.events import DeadLetter
    from streams.bus import make_bus
    from streams.topics import DEADLETTER, SAMPLES_RAW

    from .recorded import copy_run

    run_dir = copy_run(colocated_run[0], tmp_path / "run")
    run = load(run_dir)
    v1, v2 = run.versions[1][1], run.versions[2][1]
    raw = run.raw[run.steps[0][1].batch_ids[0]]
    codec = Codec()
    # a stale copy of a raw batch, dead-lettered by the processors between versions 1 and 2
    dl = DeadLetter(topic=SAMPLES_RAW, partition=raw.partition, offset=raw.offset, value=raw.value,
                    reason="stale_versions", error_class="PolicyStalenessError", stage="streams",
                    occurred_at_ms=(v1.created_at_ms + v2.created_at_ms) // 2, detail="3 versions behind")
    bus = make_bus("memory", path=str(run_dir / "log"))
    bus.produce(DEADLETTER, codec.encode(dl), key=raw.key, headers=codec.headers_for(dl))
    bus.flush()
    bus.close()
    run = load(run_dir)
    assert lineage(run, 1)["dropped"] == []
    lin = lineage(run, 2)
    assert lin["dropped_by_reason"] == {"stale_versions": 1}
    (d,) = lin["dropped"]
    assert d["batch_id"] == run.steps[0][1].batch_ids[0] and d["stage"] == "streams" and d["detail"] == "3 versions behind"


def test_lineage_into_a_closed_pipe_ends_quietly(colocated_run):
    """``rlstream lineage RUN | head``: when the reader has gone, the command ends as a Unix tool
    killed by SIGPIPE would (status 141), with no traceback on stderr."""
    import os
    import subprocess
    import sys

    from .test_verify_colocated import ROOT

    run_dir, summary = colocated_run
    r, w = os.pipe()
    os.close(r)  # the reader left before the first line
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        p = subprocess.run([sys.executable, "-m", "rlstream.cli", "lineage", str(run_dir), "--version",
                            str(summary["final_policy_version"])], cwd=str(ROOT), env=env, stdout=w,
                           stderr=subprocess.PIPE, text=True, timeout=600)
    finally:
        os.close(w)
    assert p.returncode == 141 and p.stderr == "", p.stderr
