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


def test_peers_bench_counts_the_cpu_of_overlaps_rollout_child():
    doc = bench("bench/peers.py", "--env", "InvertedPendulum-v5", "--steps", "4096", "--seeds", "1",
                "--peers", "rlstream", "rlstream-overlap")
    strict, overlap = doc["runs"]["rlstream"][0], doc["runs"]["rlstream-overlap"][0]
    # the rollout child's CPU (its imports, the envs) is in the overlap peer's CPU figure
    assert overlap["children_cpu_s"] > strict["children_cpu_s"] and overlap["cpu_s"] > overlap["children_cpu_s"]
    assert overlap["overlap"]["rounds"] >= 1 and overlap["policy_lag"]["max"] == 1
    assert doc["ratios"]["overlap_over_strict_sps"] > 0


@pytest.mark.kafka
def test_weightsync_bench_every_subscriber_adopts_every_version(kafka_bootstrap):
    doc = bench("bench/weightsync.py", "--actors", "4", "--procs", "2", "--params", "20000", "--versions", "2",
                "--host-cache", "off", env={"KAFKA_BROKERS": kafka_bootstrap})  # one row, with REDIS_URL set or not
    (row,) = doc["rows"]
    assert row["adoptions"] == 8 and row["missing"] == 0 and row["subscriber_errors"] == [] and not row["claim_check"]
    assert row["broker_bytes_per_version"] > 4 * row["params"]  # inline float32 weights
    assert 0 < row["latency_ms"]["p50"] <= row["latency_ms"]["p99"] <= row["latency_ms"]["max"]


def test_latency_breakdown_finds_no_snapshot_between_a_publish_and_its_adoption():
    doc = bench("bench/latency_breakdown.py", "--env", "Pendulum-v1", "--batch", "128", "--updates", "4")
    for run in ("default_snapshots", "peer_every_update", "peer_no_snapshots"):
        r = doc[run]
        assert r["adoptions"] == 3 and r["latency_ms"]["count"] == 3  # versions 1..3 (4: the run ended)
        # ordering, not timing: the learner writes a due snapshot at its next step, after the
        # actor has adopted the version (an inline snapshot would lie inside the window)
        assert "learner_snapshot" not in r["phase_total_ms"], r


def test_snapshot_rollback_bench_times_the_s3_store_beside_the_file_store():
    pytest.importorskip("moto.server", reason="moto[server] (the S3 server) is not installed")
    doc = bench("bench/snapshot_rollback.py", "--params", "20000", "--repeats", "1")
    assert doc["peer"] == "file" and doc["s3_server"].startswith("moto")
    for name in ("s3", "file"):
        row = doc["stores"][name]
        assert row["params"] >= 20000 and row["weights_bytes"] > 4 * 20000
        (run,) = row["runs"]
        # both from the same start; no order between them: the follower thread can load the
        # version while rollback() is still returning (measured: loaded 0.1006 s, returned 0.1007 s)
        assert run["new_version"] == 7 and run["publish_s"] > 0 and run["loaded_s"] > 0
        assert [r["new_version"] for r in row["cli_runs"]] == [8] and row["cli_s"] > 0
    assert row["url"] != doc["stores"]["s3"]["url"] and doc["stores"]["s3"]["url"].startswith("s3://")
    assert doc["ratios"]["loaded_s_s3_over_file"] == pytest.approx(
        doc["stores"]["s3"]["loaded_s"] / doc["stores"]["file"]["loaded_s"], rel=0.05, abs=0.01)

@pytest.mark.kafka
def test_weightsync_hosts_bench_fills_each_host_cache_once():
    """Across 2 simulated hosts (testbed/netns.py: root, ip, nft), each host's blob cache is
    filled once per version (two store reads), on one host once."""
    from testbed import netns

    why = netns.unavailable()
    if why is not None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"network namespaces unavailable: {why}")
        pytest.skip(f"network namespaces unavailable: {why}")
    doc = bench("bench/weightsync_hosts.py", "--actors", "4", "--hosts", "2", "--procs-per-host", "1",
                "--params", "300000", "--versions", "2", "--claim-check-above", "100000")
    hosts, one = doc["rows"]
    assert (hosts["layout"], one["layout"]) == ("hosts", "one-host")
    for row in (hosts, one):
        assert row["adoptions"] == 8 and row["missing"] == 0 and row["subscriber_errors"] == [], row
        assert row["claim_check"] and row["broker_bytes_per_version"] < 1000
    assert hosts["blob_store_reads_per_version"] == 2.0 and one["blob_store_reads_per_version"] == 1.0
    if hosts["delay_method"] is not None:
        assert hosts["delayed_packets"] > 0
