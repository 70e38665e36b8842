"""The main job learns: co-located PPO through the whole event pipeline on InvertedPendulum-v5."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlstream.colocated import run_colocated
from config import BusConfig, TrainConfig


@pytest.mark.slow
def test_colocated_ppo_return_rises_clearly_and_every_event_is_on_a_topic(tmp_path):
    torch.set_num_threads(1)
    cfg = TrainConfig(env_id="InvertedPendulum-v5", total_steps=24_576, seed=3, run_dir=tmp_path,
                      log_every_s=1e9, bus=BusConfig(log_dir=str(tmp_path / "log")))
    s = run_colocated(cfg)
    curve = __import__("json").loads((tmp_path / "curve.json").read_text())
    returns = np.asarray(curve["returns"])
    first, last = returns[:20].mean(), returns[-20:].mean()
    # a random policy balances ~5-15 steps; PPO reaches hundreds within this budget
    assert first < 30
    assert last > 150 and last > 8 * first, (first, last)
    assert s["updates"] == 12 and s["final_policy_version"] == 12
    ev = s["events"]
    assert ev["rl.samples.raw"] == ev["rl.samples.prepared"] == ev["rl.learner.steps"] == 12
    assert ev["rl.policy.versions"] == 13 and ev["rl.deadletter"] == 0
    assert s["streams"]["freshness"] == 1.0  # on-policy: every sample within the window
