"""Smoke runs of the main job's entry point: train, resume, rollback, replay on a co-located run's log."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from learner.snapshots.url import open_store
from schemas.codec import Codec
from streams.bus.memory import MemoryBus
from streams.topics import LEARNER_STEPS, POLICY_VERSIONS, PREFERENCES, SAMPLES_RAW
from tests.support import summary_from_text


def rlstream(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "rlstream.cli", *args], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"rlstream {' '.join(args)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def summary_of(p: subprocess.CompletedProcess) -> dict:
    s = summary_from_text(p.stdout)
    assert s is not None, p.stdout[-3000:]
    return s


def progress_lines(stderr: str) -> list[dict]:
    """The JSON ``progress`` log lines of a ``--log-json`` run."""
    out = []
    for line in stderr.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            if rec.get("event") == "progress":
                out.append(rec)
    return out


def versions(log: Path) -> list:
    codec = Codec()
    bus = MemoryBus(path=log)
    out = [codec.decode(r.value) for r in bus.read_all(POLICY_VERSIONS)]
    bus.close()
    return out


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """One training run for the module, never changed: each test takes a copy (``run``)."""
    cwd = tmp_path_factory.mktemp("cli")
    p = rlstream("train", "--env", "Pendulum-v1", "--total-steps", "4096", "--num-envs", "2",
                 "--snapshot-every", "1", "--metrics-port", "-1", "--plot", "--run-id", "first", "--log-json",
                 "--json", cwd=cwd)
    return cwd, p


@pytest.fixture
def run(first_run, tmp_path):
    """A copy of ``first_run``'s directory of this test's own (``runs/latest`` stays a relative
    link), so a test that resumes or replays into it changes no other test's run."""
    cwd, p = first_run
    shutil.copytree(cwd / "runs", tmp_path / "runs", symlinks=True)
    return tmp_path, p


def test_train_writes_summary_curve_plot_snapshots_and_the_event_log(run):
    cwd, p = run
    s = summary_of(p)
    assert s["steps"] == 4096 and s["updates"] == 2 and s["final_policy_version"] == 2
    assert s["events"][SAMPLES_RAW] == 2 and s["events"][LEARNER_STEPS] == 2
    run_dir = cwd / "runs" / "first"
    assert (cwd / "runs" / "latest").resolve() == run_dir.resolve()
    for name in ("summary.json", "curve.json", "returns.png"):
        assert (run_dir / name).stat().st_size > 0
    assert (run_dir / "returns.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert open_store(run_dir / "snapshots").versions() == [1, 2]
    assert [v.version for v in versions(run_dir / "log")] == [0, 1, 2]
    progress = progress_lines(p.stderr)
    assert progress, p.stderr[-3000:]
    last = progress[-1]
    assert (last["steps"], last["pct"], last["updates"], last["policy_version"]) == (4096, 100.0, 2, 2), last
    assert last["role"] == "colocated" and last["run_id"] == "first"
    assert [r["steps"] for r in progress] == sorted(r["steps"] for r in progress)


def test_a_second_run_into_the_same_dir_needs_resume(run):
    cwd, _ = run
    p = rlstream("train", "--env", "Pendulum-v1", "--total-steps", "2048", "--run-dir", "runs/first",
                 "--metrics-port", "-1", cwd=cwd, check=False)
    assert p.returncode != 0 and "--resume" in p.stderr


def test_resume_continues_versions_and_rollback_republishes_a_snapshot(run):
    cwd, _ = run
    p = rlstream("train", "--env", "Pendulum-v1", "--total-steps", "6144", "--num-envs", "2", "--resume",
                 "--snapshot-every", "1", "--metrics-port", "-1", "--json", cwd=cwd)
    s = summary_of(p)
    log = cwd / "runs" / "latest" / "log"
    vs = versions(log)
    # version 3 restores snapshot 2 (parent 2); one more update trains 4 from 3
    assert [(v.version, v.parent_version) for v in vs[2:]] == [(2, 1), (3, 2), (4, 3)]
    assert s["updates"] == 3
    r = rlstream("rollback", "--to", "1", "--bus", "memory", "--run-dir", "runs/latest", cwd=cwd)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["new_version"] == 5 and out["from_snapshot"] == 1
    assert [(v.version, v.parent_version) for v in versions(log)][-1] == (5, 1)
    bad = rlstream("rollback", "--to", "99", "--bus", "memory", "--run-dir", "runs/latest", cwd=cwd, check=False)
    assert bad.returncode != 0 and "snapshots there" in (bad.stdout + bad.stderr)


def test_replay_of_a_colocated_run_builds_preference_pairs(run):
    cwd, _ = run
    p = rlstream("replay", "--log-dir", "runs/first/log", "--topic", SAMPLES_RAW, "--segment", "16",
                 "--out", "dpo", cwd=cwd)
    s = summary_of(p)
    codec, bus = Codec(), MemoryBus(path=cwd / "runs" / "first" / "log")
    pairs = [codec.decode(r.value) for r in bus.read_all(PREFERENCES)]
    n_raw = len(list(bus.read_all(SAMPLES_RAW)))
    bus.close()
    assert n_raw >= 2 and s["batches"] == s["records"] == n_raw and s["dead_lettered"] == 0
    assert s["pairs_built"] > 0 and s["pairs_published"] == s["pairs_built"] and s["pairs_existing"] == 0
    assert len(pairs) == s["pairs_built"] and len({q.pair_id for q in pairs}) == len(pairs)
    assert all(q.return_w > q.return_l and q.obs_w.shape[0] == 16 for q in pairs)
    again = summary_of(rlstream("replay", "--log-dir", "runs/first/log", "--topic", SAMPLES_RAW, "--segment", "16",
                                "--out", "dpo", cwd=cwd))
    assert (again["pairs_built"], again["pairs_published"], again["pairs_existing"]) == (len(pairs), 0, len(pairs))
