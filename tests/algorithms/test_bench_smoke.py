"""Tiny smoke runs of the learning benches (the real tables take hours: see docs/algorithms.md)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.bench]


def test_staleness_bench_runs_every_algorithm_with_and_without_correction(tmp_path):
    subprocess.run([sys.executable, "bench/staleness.py", "--env", "InvertedPendulum-v5", "--steps", "4096",
                    "--ks", "0", "1", "--seeds", "0", "--out", str(tmp_path)], cwd=ROOT, check=True, timeout=1200)
    doc = json.loads((tmp_path / "staleness.json").read_text())
    keys = {(r["algo"], r["K"], r["correction"]) for r in doc["runs"]}
    assert keys == {(a, k, c) for a in ("agro", "tba", "ppo") for k in (0, 1) for c in (True, False)}
    for r in doc["runs"]:  # the injected lag is real: K versions once the history is full
        assert r["updates"] == 2 and r["mean_lag"] == pytest.approx(0.0 if r["K"] == 0 else 0.5)
    assert (tmp_path / "staleness.png").stat().st_size > 0


def test_algorithms_bench_with_the_sb3_peer(tmp_path):
    pytest.importorskip("stable_baselines3")
    subprocess.run([sys.executable, "bench/algorithms.py", "--env", "InvertedPendulum-v5", "--steps", "2048",
                    "--seeds", "0", "--algos", "ppo", "--no-dpo", "--sb3", "--eval-episodes", "1", "--out", str(tmp_path)],
                   cwd=ROOT, check=True, timeout=1200)
    rows = {r["name"]: r for r in json.loads((tmp_path / "algorithms.json").read_text())["rows"]}
    assert set(rows) == {"ppo", "sb3-ppo"} and rows["sb3-ppo"]["eval"]["mean"] > 0
    assert rows["ppo"]["mode"] == rows["sb3-ppo"]["mode"] == "colocated"


@pytest.mark.kafka
def test_algorithms_bench_runs_rows_decoupled_and_says_which_mode(tmp_path, kafka_bootstrap):
    cmd = [sys.executable, "bench/algorithms.py", "--env", "InvertedPendulum-v5", "--steps", "2048", "--seeds", "0",
           "--algos", "ppo", "--decoupled", "tba,vtrace", "--no-dpo", "--eval-episodes", "1",
           "--bootstrap", kafka_bootstrap, "--out", str(tmp_path)]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=1200)
    doc = json.loads((tmp_path / "algorithms.json").read_text())
    rows = {(r["name"], r["mode"]): r for r in doc["rows"]}
    assert set(rows) == {("ppo", "colocated"), ("tba", "decoupled"), ("vtrace", "decoupled")}
    runs = {(r["name"], r["mode"]): r for r in doc["runs"]}
    for r in runs.values():
        assert r["steps"] >= 2048 and r["updates"] >= 1 and len(r["load_avg"]["start"]) == 3, r
    vtrace = runs[("vtrace", "decoupled")]  # AGRO with the learner's sample cache at its defaults
    assert vtrace["algo"] == "agro" and vtrace["run"]["replay"]["capacity"] == 1000
    assert vtrace["replay"]["inserted"] >= 2048 and vtrace["ended"] == "learner_done"
    md = (tmp_path / "algorithms.md").read_text()
    assert "| co-located (memory bus) |" in md and md.count("| decoupled (Kafka, Faust worker, 1 actor) |") == 2
    assert (tmp_path / "algorithms.png").stat().st_size > 0
    # a second invocation finds the saved runs and trains nothing again
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=600)
    assert json.loads((tmp_path / "algorithms.json").read_text())["runs"] == doc["runs"]


@pytest.mark.kafka
def test_decoupled_staleness_bench_holds_the_actors_k_versions_behind(tmp_path, kafka_bootstrap):
    import os

    subprocess.run([sys.executable, "bench/staleness.py", "--decoupled", "--env", "HalfCheetah-v5", "--steps", "20480",
                    "--algos", "agro", "--ks", "0", "3", "--seeds", "0", "--no-ablation", "--out", str(tmp_path)],
                   cwd=ROOT, check=True, timeout=1200, env={**os.environ, "KAFKA_BROKERS": kafka_bootstrap})
    doc = json.loads((tmp_path / "staleness.json").read_text())
    assert doc["mode"] == "decoupled"
    lag = {r["K"]: r for r in doc["runs"]}
    for r in lag.values():  # the window is wide: nothing dropped as stale (a duplicate is a record the
        # Faust shell re-read after seeking back over offsets its consumer skipped: dropped by design)
        lost = {k: v for k, v in r["drops"].items() if k != "duplicate"}
        assert r["samples_trained"] >= 20480 and lost == {}, {k: v for k, v in r.items() if k != "curve"}
    # measured at the real stream processor: K behind the newest, plus at most the queue's own lag.
    # The mean only rises: a fragment collected before version K existed lags less than K, and how
    # many there are depends on how far the actors ran ahead of a loaded learner (mean 1.2 at K=3
    # against 0.28 at K=0 with four runs on the 2 cores)
    assert 3 <= lag[3]["max_lag"] <= 5 and lag[3]["mean_lag"] > lag[0]["mean_lag"]


def test_mujoco_table_runs_each_task_with_its_preset_beside_the_published_figures(tmp_path):
    subprocess.run([sys.executable, "bench/mujoco_table.py", "--envs", "Walker2d-v5", "--seeds", "0", "--steps", "1024",
                    "--preset", "zoo", "--jobs", "1", "--eval-episodes", "1", "--out", str(tmp_path)],
                   cwd=ROOT, check=True, timeout=1200)
    doc = json.loads((tmp_path / "table.json").read_text())
    (row,) = doc["rows"]
    assert row["env"] == "Walker2d-v5" and row["preset"] == "zoo" and row["seeds"] == [0]
    assert row["cleanrl"] == [2287.95, 571.78] and row["zoo"] == [3478.80, 821.71]
    (run,) = doc["runs"]
    assert run["steps"] >= 1024 and run["updates"] == 2  # the zoo's 512-step updates, not CleanRL's 2048
    assert (tmp_path / "table.png").stat().st_size > 0
    # a second invocation finds the run's result and does not train again
    subprocess.run([sys.executable, "bench/mujoco_table.py", "--envs", "Walker2d-v5", "--seeds", "0", "--steps", "1024",
                    "--preset", "zoo", "--jobs", "1", "--out", str(tmp_path)], cwd=ROOT, check=True, timeout=600)
    assert json.loads((tmp_path / "table.json").read_text())["runs"] == doc["runs"]
    # another algorithm's row sits beside it, at that algorithm's own run defaults (no preset)
    subprocess.run([sys.executable, "bench/mujoco_table.py", "--algo", "agro", "--envs", "Walker2d-v5", "--seeds", "0",
                    "--steps", "2048", "--jobs", "1", "--eval-episodes", "1", "--out", str(tmp_path)],
                   cwd=ROOT, check=True, timeout=1200)
    both = json.loads((tmp_path / "table.json").read_text())
    assert [(r["algo"], r["preset"]) for r in both["rows"]] == [("agro", None), ("ppo", "zoo")]
    agro = next(r for r in both["runs"] if r["algo"] == "agro")
    assert agro["updates"] == 1 and agro["run"]["train_batch_size"] == 2048  # AGRO's row, not the zoo's
    assert doc["runs"][0] in both["runs"]


def group_members(pgid: int) -> list[str]:
    """Command lines of the running processes in process group ``pgid``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if os.getpgid(int(pid)) == pgid:
                found.append(Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " "))
    return found


def test_mujoco_table_env_arg_reaches_the_env_and_names_the_row(tmp_path):
    base = [sys.executable, "bench/mujoco_table.py", "--envs", "Walker2d-v5", "--seeds", "0", "--steps", "1024",
            "--jobs", "1", "--eval-episodes", "1"]
    p = subprocess.Popen([*base, "--env-arg", "forward_reward_weight=0.0", "--out", str(tmp_path / "a")],
                         cwd=ROOT, start_new_session=True)
    assert p.wait(timeout=1200) == 0
    # it waited for its pool's resource tracker: nothing of its process group outlives it
    assert group_members(p.pid) == []
    doc = json.loads((tmp_path / "a" / "table.json").read_text())
    (run,) = doc["runs"]
    assert run["env_kwargs"] == {"forward_reward_weight": 0.0}
    assert doc["rows"][0]["preset"] == "cleanrl+env:forward_reward_weight=0.0"
    # gymnasium.make gets it: a keyword the env does not take fails the run
    bad = subprocess.run([*base, "--env-arg", "no_such_keyword=1", "--out", str(tmp_path / "b")], cwd=ROOT,
                         capture_output=True, text=True, timeout=1200)
    assert bad.returncode != 0 and "no_such_keyword" in bad.stderr


@pytest.mark.kafka
def test_guide_runs_bench_sets_decoupled_agro_beside_colocated_ppo(tmp_path, kafka_bootstrap):
    subprocess.run([sys.executable, "bench/guide_runs.py", "--env", "Ant-v5", "--steps", "4096", "--seeds", "0",
                    "--eval-episodes", "1", "--bootstrap", kafka_bootstrap, "--out", str(tmp_path)],
                   cwd=ROOT, check=True, timeout=1200)
    doc = json.loads((tmp_path / "guide.json").read_text())
    runs = {r["arm"]: r for r in doc["runs"]}
    assert set(runs) == {"ppo-colocated", "agro-decoupled"}
    for r in runs.values():
        assert r["steps"] >= 4096 and r["final_version"] >= 1 and r["timeline"], r["arm"]
        assert 0 < r["freshness"] <= 1 and r["lag_versions"]["count"] > 0
        how = r["eval_behaviour"]  # what the evaluated episode did: Ant's x distance, a fall
        assert 1 <= how["length"] <= 1000 and how["fell"] in (0.0, 1.0) and how["dx"] is not None
        assert (how["length"] < 1000) == (how["fell"] == 1.0), how
    assert runs["ppo-colocated"]["preset"] == "cleanrl" and doc["target_return"] is not None
    assert "/ fell /" in (tmp_path / "guide.md").read_text()
    assert (tmp_path / "guide.png").stat().st_size > 0
