"""The learner's algorithm gets the captured update by ``TrainConfig.compile_update``: on, off, or
auto (on for a run long enough to pay for the compile: ``agents.capture.pays_to_capture``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from config.train import TrainConfig
from rlstream.wiring import build_algo, capture_update

ROOT = Path(__file__).resolve().parents[2]


def test_auto_captures_cleanrl_length_ppo_and_not_a_short_run():
    long_run, short_run = TrainConfig(total_steps=1_000_000), TrainConfig(total_steps=20_480)
    assert build_algo(long_run, 3, 2).capture is not None  # 488 updates x 320 optimizer steps
    assert build_algo(short_run, 3, 2).capture is None
    assert capture_update(TrainConfig(total_steps=1_000_000, device="cpu,cpu"), build_algo(short_run, 3, 2).config) is False
    assert build_algo(long_run, 3, 2).config.capture_update  # in the config: provenance records it


def test_the_flag_overrides_the_rule():
    assert build_algo(TrainConfig(total_steps=1_000_000, compile_update=False), 3, 2).capture is None
    forced = build_algo(TrainConfig(total_steps=2048, compile_update=True), 3, 2)
    assert forced.capture is not None and forced.capture.compiles == 0  # compiles on its first step only


@pytest.mark.slow
def test_a_captured_run_verifies_bit_for_bit(tmp_path):
    """The choice is in the algorithm's config, so its provenance makes ``rlstream verify`` replay
    the captured path too."""
    run = tmp_path / "run"
    common = dict(cwd=ROOT, capture_output=True, text=True, timeout=900)
    p = subprocess.run([sys.executable, "-m", "rlstream.cli", "train", "--env-id", "Pendulum-v1", "--total-steps", "4096",
                        "--compile-update", "True", "--run-dir", str(run), "--metrics-port", "-1", "--no-plot"], **common)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads((run / "learner.summary.json").read_text())["capture"]["captured_steps"] == 2 * 320
    p = subprocess.run([sys.executable, "-m", "rlstream.cli", "verify", str(run)], **common)
    assert p.returncode == 0 and "reproduced bit for bit" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
