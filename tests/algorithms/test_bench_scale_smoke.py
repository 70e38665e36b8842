"""Smoke run of bench/scale.py: one decoupled point (1 actor, 2 stream workers, 4 partitions) and
the co-located baseline, on a real broker (the bench's private one)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.bench, pytest.mark.kafka]


def test_scale_bench_prints_runs_with_the_colocated_baseline():
    out = subprocess.run([sys.executable, "bench/scale.py", "--steps", "1024", "--train-batch-size", "256",
                          "--actors", "1", "--workers", "2"], cwd=ROOT, check=True, timeout=1200,
                         capture_output=True, text=True).stdout
    doc = json.loads(out)
    assert doc["colocated"]["sps_steady"] > 0
    (run,) = doc["runs"]
    assert (run["actors"], run["stream_workers"], run["learner_ranks"]) == (1, 2, 1)
    assert run["exit_codes"] == {"learner": 0, "streams": 0, "streams-1": 0, "actor-0": 0}
    assert run["sps_steady"] > 0 and run["actor_sps"] > 0 and run["learner_step_s"] > 0
    assert run["vs_colocated"] == pytest.approx(run["sps_steady"] / doc["colocated"]["sps_steady"], rel=1e-2)
