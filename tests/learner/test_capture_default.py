"""The learner's algorithm gets the captured update by ``TrainConfig.compile_update``: on, off, or
auto (on for a run long enough to pay for the compile: ``agents.capture.pays_to_capture``)."""

from __future__ import annotations

from config.train import TrainConfig
from rlstream.wiring import build_algo, capture_update


def test_auto_captures_cleanrl_length_ppo_and_not_a_short_run():
    long_run, short_run = TrainConfig(total_steps=1_000_000), TrainConfig(total_steps=20_480)
    assert build_algo(long_run, 3, 2).capture is not None  # 488 updates x 320 optimizer steps
    assert build_algo(short_run, 3, 2).capture is None
    assert capture_update(TrainConfig(total_steps=1_000_000, device="cpu,cpu"), build_algo(short_run, 3, 2)) is False


def test_the_flag_overrides_the_rule():
    assert build_algo(TrainConfig(total_steps=1_000_000, compile_update=False), 3, 2).capture is None
    forced = build_algo(TrainConfig(total_steps=2048, compile_update=True), 3, 2)
    assert forced.capture is not None and forced.capture.compiles == 0  # compiles on its first step only
