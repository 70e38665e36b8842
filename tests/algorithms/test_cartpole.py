"""PPO solves CartPole-v1 (discrete actions) through the whole co-located pipeline, judged by
``rlstream eval`` of the final version. Slow (minutes on a loaded 2-core machine); the short
discrete smoke runs in tests/rlstream/test_dayone.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_ppo_solves_cartpole(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("RLSTREAM_METRICS_PORT", None)
    run = tmp_path / "run"
    train = [sys.executable, "-m", "rlstream.cli", "train", "--env", "CartPole-v1", "--total-steps", "25000",
             "--num-envs", "8", "--train-batch-size", "1024", "--set", "learning_rate=0.001",
             "--set", "num_minibatches=8", "--torch-threads", "1", "--run-dir", str(run), "--metrics-port", "-1",
             "--log-every", "60", "--no-plot", "--tensorboard", "off"]
    p = subprocess.run(train, cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=3000)
    assert p.returncode == 0, p.stderr[-3000:]
    e = subprocess.run([sys.executable, "-m", "rlstream.cli", "eval", str(run), "--episodes", "10",
                        "--deterministic"], cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=600)
    assert e.returncode == 0, e.stderr[-2000:]
    result = json.loads(e.stdout.splitlines()[0])
    assert result["env"] == "CartPole-v1" and result["mean"] >= 475, result
