"""Tiny smoke runs of the speed benches (docs/benchmarks.md); the speed targets live in their
JSON, never in a test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.bench]


def bench(*args: str, env: dict | None = None) -> dict:
    p = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=1200,
                       env={**os.environ, **(env or {})})
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)


def test_rollout_bench_reports_the_actor_beside_the_raw_env():
    doc = bench("bench/rollout.py", "--env", "InvertedPendulum-v5", "--steps", "600", "--num-envs", "1", "3")
    assert [r["num_envs"] for r in doc["rows"]] == [1, 3]
    for r in doc["rows"]:
        assert r["raw_env_sps"] > 0 and r["actor_sps"] > 0
        assert r["actor_over_raw"] == pytest.approx(r["actor_sps"] / r["raw_env_sps"], rel=0.01)


def test_update_bench_profiles_one_ppo_update_and_times_agro():
    doc = bench("bench/update.py", "--updates", "1", "--steps", "256", "--profile", "5")
    assert doc["batch"] == 256 and doc["update_cpu_s_median"] > 0 and len(doc["profile_top"]) == 5
    doc = bench("bench/update.py", "--algo", "agro", "--updates", "1", "--steps", "256")
    assert doc["bench"] == "agro_update" and doc["batch"] == 256 and doc["update_cpu_s_median"] > 0


def test_gpu_metrics_bench_without_a_gpu_scrapes_under_load_and_reports_the_families_absent():
    doc = bench("bench/gpu_metrics.py", "--device", "cpu", "--seconds", "1", "--idle", "0.3", "--num-envs", "1",
                env={"CUDA_VISIBLE_DEVICES": ""})
    assert doc["gpu_enabled"] is False and doc["gpu_utilization_enabled"] is False and doc["gpu_series"] == []
    assert doc["load"]["updates"] >= 1 and doc["under_load"]["scrapes"] >= 1 and doc["idle_before"]["scrapes"] >= 1
    assert doc["without_pynvml"] == {"gpu_enabled": False, "gpu_utilization_enabled": False, "gpu_series": []}


def test_peers_bench_runs_sb3_and_rlstream_and_says_why_cleanrl_is_missing():
    pytest.importorskip("stable_baselines3")
    doc = bench("bench/peers.py", "--env", "InvertedPendulum-v5", "--steps", "2048", "--seeds", "1")
    for peer in ("sb3", "rlstream"):
        s = doc["summary"][peer]
        assert s["sps"] > 0 and s["cpu_sps"] > 0 and s["return_last10"] > 0  # InvertedPendulum: >= 1 per step
        assert doc["runs"][peer][0]["steps"] >= 2048
    assert doc["ratios"]["rlstream_over_sb3_sps"] == pytest.approx(
        doc["summary"]["rlstream"]["sps"] / doc["summary"]["sb3"]["sps"], rel=0.01)
    cleanrl = doc["summary"]["cleanrl"]
    assert ("unavailable" in cleanrl) != ("sps" in cleanrl)


@pytest.mark.kafka
def test_weightsync_bench_every_subscriber_adopts_every_version(kafka_bootstrap):
    doc = bench("bench/weightsync.py", "--actors", "4", "--procs", "2", "--params", "20000", "--versions", "2",
                "--host-cache", "off", env={"KAFKA_BROKERS": kafka_bootstrap})  # one row, with REDIS_URL set or not
    (row,) = doc["rows"]
    assert row["adoptions"] == 8 and row["missing"] == 0 and row["subscriber_errors"] == [] and not row["claim_check"]
    assert row["broker_bytes_per_version"] > 4 * row["params"]  # inline float32 weights
    assert 0 < row["latency_ms"]["p50"] <= row["latency_ms"]["p99"] <= row["latency_ms"]["max"]
