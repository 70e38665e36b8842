"""``rlstream verify`` on a recorded co-located PPO run: every version reproduced bit for bit;
a tampered or missing batch is found and the first divergent version named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from .recorded import UPDATES, copy_run, tamper_prepared
from logtools.timetravel.record import load
from logtools.timetravel.verify import ALTERED, MISSING, format_report, verify
from streams.bus.filelog import encode_frame, read_partition
from streams.topics import SAMPLES_PREPARED

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "rlstream.cli", *args], cwd=str(ROOT), env=env,
                          capture_output=True, text=True, timeout=600)


def step_of(run_dir: Path, batch_id: str) -> int:
    """The version the recorded step that trained ``batch_id`` produced."""
    return next(s.to_version for _, s in load(run_dir).steps if batch_id in s.batch_ids)


def test_verify_reproduces_every_version_of_a_colocated_run(colocated_run):
    run_dir, summary = colocated_run
    run = load(run_dir)
    assert run.run_id == "parent" and len(run.steps) == UPDATES
    report = verify(run, run_dir / "snapshots")
    assert report.ok, format_report(report)
    assert report.checked == list(range(summary["final_policy_version"] + 1))
    # what verify relied on is in the events themselves
    pv = run.versions[0][1]
    prov = run.provenance(0)
    assert pv.state_sha256 and prov["config"]["seed"] == 5 and prov["determinism"]["threads"] == 1
    assert all(len(s.batch_digests) == len(s.batch_ids) for _, s in run.steps)


def test_verify_names_the_first_divergent_version_of_a_tampered_batch(colocated_run, tmp_path):
    run_dir, _ = colocated_run
    bad = copy_run(run_dir, tmp_path / "bad")
    batch_id = tamper_prepared(bad, 2)
    version = step_of(bad, batch_id)
    report = verify(load(bad), bad / "snapshots")
    assert not report.ok
    d = report.divergence
    assert (d.version, d.reason) == (version, ALTERED), format_report(report)
    assert batch_id in d.detail and d.max_abs_diff is not None and d.max_abs_diff > 0
    assert report.checked == list(range(version))
    # the command says the same and exits 1; the intact run exits 0
    p = cli("verify", str(bad), "--json")
    assert p.returncode == 1, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["first_divergent"]["version"] == version and out["first_divergent"]["reason"] == ALTERED
    p = cli("verify", str(run_dir))
    assert p.returncode == 0 and f"{UPDATES + 1} versions reproduced bit for bit" in p.stdout, p.stdout + p.stderr


def test_verify_reports_a_missing_batch(colocated_run, tmp_path):
    run_dir, _ = colocated_run
    bad = copy_run(run_dir, tmp_path / "gap")
    path = bad / "log" / SAMPLES_PREPARED / "0.log"
    records = list(read_partition(path, SAMPLES_PREPARED, 0))
    gone = records.pop(1)
    records = [replace(r, offset=i) for i, r in enumerate(records)]  # the log renumbered, as if never written
    path.write_bytes(b"".join(encode_frame(r) for r in records))
    run = load(bad)
    report = verify(run, bad / "snapshots")
    lost = next(s for _, s in run.steps if any(b not in run.prepared for b in s.batch_ids))
    assert report.divergence is not None and report.divergence.reason == MISSING
    assert report.divergence.version == lost.to_version and report.checked == list(range(lost.to_version))
    assert gone.offset == 1 and "not in the log" in report.divergence.detail


def test_verify_a_resumed_run_from_the_snapshot_it_restored(colocated_run, tmp_path):
    from rlstream.colocated import run_colocated
    from config import BusConfig, TrainConfig

    from .recorded import BATCH, ENV_ID, OVERRIDES

    run_dir = copy_run(colocated_run[0], tmp_path / "resumed")
    cfg = TrainConfig(env_id=ENV_ID, total_steps=(UPDATES + 1) * BATCH, train_batch_size=BATCH, seed=5,
                      run_dir=run_dir, run_id="resumed", log_every_s=1e9, algo_overrides=dict(OVERRIDES),
                      resume=True, bus=BusConfig(log_dir=str(run_dir / "log")))
    summary = run_colocated(cfg)
    assert summary["final_policy_version"] == UPDATES + 2  # a republished snapshot, then one update
    run = load(run_dir)
    assert run.run_id == "resumed" and run.versions[UPDATES + 1][1].parent_version == UPDATES
    report = verify(run, run_dir / "snapshots")
    assert report.ok and report.checked == [UPDATES + 1, UPDATES + 2], format_report(report)


def test_verify_names_changed_algorithm_code_as_the_cause(colocated_run, monkeypatch):
    """A replay under other algorithm code (here GAE summed step by step, as before the scan)
    diverges, and the report names the code digest, not only 'identical inputs'."""
    import torch

    import agents.returns as returns
    import learner.provenance as provenance
    from logtools.timetravel.verify import KERNEL

    def sequential(a, b):
        out, x = torch.empty_like(a), torch.zeros_like(a[0])
        for t in range(a.shape[0] - 1, -1, -1):
            x = a[t] + b[t] * x
            out[t] = x
        return out

    run_dir, _ = colocated_run
    recorded = load(run_dir).provenance(0)["determinism"]["algorithm_code"]
    assert recorded == provenance.algorithm_code()
    monkeypatch.setattr(returns, "discounted_scan", sequential)
    monkeypatch.setattr(provenance, "algorithm_code", lambda: "0123456789abcdef")
    report = verify(load(run_dir), run_dir / "snapshots")
    assert not report.ok
    d = report.divergence
    assert d.reason == KERNEL and f"algorithm_code: recorded {recorded!r}, now '0123456789abcdef'" in d.detail


def test_a_recording_without_a_code_digest_is_named_as_such():
    """Runs recorded before the ``agents`` digest (PolicyVersion v2 without ``algorithm_code``)
    diverge under today's scan code; the cause must say the code could not be compared, not
    only 'identical inputs'."""
    from learner.provenance import determinism
    from logtools.timetravel.verify import environment_differences

    now = determinism("cpu")
    assert environment_differences(now) == []
    old = {k: v for k, v in now.items() if k != "algorithm_code"}
    (line,) = environment_differences(old)
    assert line.startswith("algorithm_code: not recorded") and now["algorithm_code"] in line
