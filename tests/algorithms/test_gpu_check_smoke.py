"""Smoke runs of bench/gpu_check.py's dry run (the GPU steps on CPU at tiny sizes) and of
bench/update.py's eager-against-captured comparison; the speed targets live in their JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.bench]


def test_update_bench_compares_eager_and_captured_in_one_run():
    p = subprocess.run([sys.executable, "bench/update.py", "--compare", "--sizes", "256", "--algos", "ppo",
                        "--updates", "1"], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-2000:]
    doc = json.loads(p.stdout)
    (row,) = doc["rows"]
    assert (row["algo"], row["samples"], row["compiles"], row["eager_fallback_steps"]) == ("ppo", 256, 1, 0)
    assert row["eager_s_median"] > 0 and row["captured_s_median"] > 0 and row["compile_s"] > 0
    assert row["speedup"] == pytest.approx(row["eager_s_median"] / row["captured_s_median"], rel=0.01)
    assert "loaded" in doc["host"]


def test_gpu_check_dry_run_runs_every_step_on_cpu(tmp_path):
    out = tmp_path / "dry.json"
    p = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry-run", "--out", str(out),
                        "--only", "update,train,learner_ranks,gpu_metrics"],
                       cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["dry_run"] and doc["device"] == "cpu"
    steps = doc["steps"]
    assert all(s["ok"] for s in steps.values()), {k: s.get("error") for k, s in steps.items()}
    assert {r["algo"] for r in steps["update"]["rows"]} == {"ppo", "agro"}
    assert steps["train"]["sps"] > 0 and steps["train"]["learner_time_s"]["update"] > 0
