"""The learning check's comparison (bench/learning_check.py), on finished-run summaries written
here: no training. The check itself is a bench command (docs/benchmarks.md), not a test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "learning_check.py"

REFERENCE = {
    "reference": {"algo": "ppo", "env": "HalfCheetah-v5", "steps": 150_000, "source": "test",
                  "returns": {"1": 900.0, "2": 1000.0, "3": 1100.0, "4": 950.0, "5": 1050.0}},
    # mean 1000, std 79.06; 3 seeds: half-width 2 * 79.06 * sqrt(1/3 + 1/5) = 115.5
    "band": {"low": 884.5, "high": 1115.5, "z": 2.0, "n_seeds": 3},
}


def write_runs(tmp_path: Path, returns: list[float], steps: int = 151_552, env: str = "HalfCheetah-v5",
               **summary) -> list[Path]:
    dirs = []
    for i, r in enumerate(returns, 1):
        d = tmp_path / f"seed{i}"
        d.mkdir()
        (d / "summary.json").write_text(json.dumps({"algo": "ppo", "env": env, "steps": steps, "return_mean20": r,
                                                    **summary}))
        dirs.append(d)
    return dirs


def check(tmp_path: Path, returns: list[float], *args: str, reference: dict = REFERENCE, **kw) -> tuple[int, dict | str]:
    ref = tmp_path / "reference.json"
    ref.write_text(json.dumps(reference))
    p = subprocess.run([sys.executable, str(SCRIPT), "--steps", "150000", "--reference", str(ref), *args,
                        "--runs", *map(str, write_runs(tmp_path, returns, **kw))],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    return p.returncode, (json.loads(p.stdout) if p.stdout.strip() else p.stderr)


def test_a_mean_inside_the_band_passes(tmp_path):
    rc, doc = check(tmp_path, [880.0, 1000.0, 900.0])  # mean 926.7: low but inside
    assert rc == 0 and doc["pass"] is True and doc["verdict"] == "within the reference band"
    assert doc["mean"] == pytest.approx(926.7) and doc["diff_vs_reference"] == pytest.approx(-73.3)
    assert doc["band"]["low"] == 884.5 and "recomputed" not in doc["band"]


def test_a_mean_below_the_band_fails_with_exit_1(tmp_path):
    rc, doc = check(tmp_path, [800.0, 950.0, 880.0])  # mean 876.7 < 884.5
    assert rc == 1 and doc["pass"] is False and "worse" in doc["verdict"]


def test_a_mean_above_the_band_passes_and_says_so(tmp_path):
    rc, doc = check(tmp_path, [1200.0, 1150.0, 1100.0])
    assert rc == 0 and doc["pass"] is True and "above" in doc["verdict"]


def test_another_seed_count_gets_a_band_recomputed_from_the_stored_returns(tmp_path):
    # 5 seeds: half-width 2 * 79.06 * sqrt(2/5) = 100.0, so 890 fails here though it passes the 3-seed band
    rc, doc = check(tmp_path, [890.0] * 5)
    assert doc["band"]["recomputed"] is True and doc["band"]["n_seeds"] == 5
    assert doc["band"]["low"] == pytest.approx(900.0, abs=0.1)
    assert rc == 1 and doc["pass"] is False


def test_runs_of_another_budget_or_env_are_refused(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    rc, err = check(tmp_path / "a", [1000.0] * 3, steps=301_056)
    assert rc != 0 and "not a budget of --steps 150000" in err
    rc, err = check(tmp_path / "b", [1000.0] * 3, env="Hopper-v5")
    assert rc != 0 and "Hopper-v5" in err


def test_each_preset_is_judged_against_its_own_reference(tmp_path):
    for d in "abcd":
        (tmp_path / d).mkdir()
    zoo = {"preset": "zoo", "env_kwargs": {}}  # what HalfCheetah's default (auto) records in its summary
    # runs of the task's default preset are not the reference's (--preset none) runs
    rc, err = check(tmp_path / "a", [1000.0] * 3, **zoo)
    assert rc != 0 and "--preset none applies" in err
    # judged as --preset auto, they need a reference recorded for auto
    rc, err = check(tmp_path / "b", [1000.0] * 3, "--preset", "auto", **zoo)
    assert rc != 0 and "the reference is for preset='none'" in err
    auto = {**REFERENCE, "reference": {**REFERENCE["reference"], "preset": "auto"}}
    rc, doc = check(tmp_path / "c", [1000.0] * 3, "--preset", "auto", reference=auto, **zoo)
    assert rc == 0 and doc["pass"] is True and doc["preset"] == "auto"
    # a run whose observation differs from what the preset applies is refused (Ant: contact forces)
    rc, err = check(tmp_path / "d", [1000.0] * 3, "--preset", "auto", reference=auto,
                    preset="zoo", env_kwargs={"include_cfrc_ext_in_observation": True})
    assert rc != 0 and "include_cfrc_ext_in_observation" in err


def test_a_preset_has_its_own_reference_file():
    sys.path.insert(0, str(ROOT))
    from bench.learning_check import reference_path, what_runs

    assert reference_path("ppo", "Ant-v5").name == "learning_check_ppo_ant_v5.json"
    assert reference_path("ppo", "Ant-v5", "auto").name == "learning_check_ppo_ant_v5_auto.json"
    assert what_runs("ppo", "Ant-v5", "auto")["env_kwargs"] == {"include_cfrc_ext_in_observation": False}
    assert what_runs("ppo", "Ant-v5", "none") == {"preset": None, "env_kwargs": {}}

