"""``rlstream verify`` on a co-located run whose learner changed its minibatch size between
updates (``--dynamic-batch``): the size each step used is in its GradientStep, so every version
is still reproduced bit for bit. A run with the sample cache on says why it cannot be."""

from __future__ import annotations

import itertools

import torch

from config import BusConfig, TrainConfig
from learner.minibatch import MinibatchController
from logtools.timetravel.record import load
from logtools.timetravel.verify import MISSING, format_report, verify
from rlstream.colocated import run_colocated

from .recorded import BATCH, ENV_ID, OVERRIDES, UPDATES


def test_verify_reproduces_a_run_whose_minibatch_size_changed(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    sizes = itertools.cycle([32, 128, 64])  # the controller's choices, made deterministic here
    monkeypatch.setattr(MinibatchController, "update", lambda self, *a, **k: next(sizes))
    run_dir = tmp_path / "dyn"
    cfg = TrainConfig(env_id=ENV_ID, total_steps=UPDATES * BATCH, train_batch_size=BATCH, seed=5, run_dir=run_dir,
                      run_id="dyn", log_every_s=1e9, algo_overrides=dict(OVERRIDES), dynamic_batch=True,
                      bus=BusConfig(log_dir=str(run_dir / "log")))
    run_colocated(cfg)
    run = load(run_dir)
    used = [s.losses["minibatch_size"] for _, s in run.steps]
    assert used == [64, 64, 32, 128]  # 256 / 4 until the controller has two updates to compare
    report = verify(run, run_dir / "snapshots")
    assert report.ok, format_report(report)
    assert len(report.checked) == UPDATES + 1


def test_verify_says_a_step_with_replayed_samples_cannot_be_rebuilt(tmp_path):
    torch.set_num_threads(1)
    run_dir = tmp_path / "replay"
    cfg = TrainConfig(algo="agro", env_id=ENV_ID, total_steps=3 * BATCH, train_batch_size=BATCH, fragment_steps=64,
                      seed=5, run_dir=run_dir, run_id="replay", log_every_s=1e9,
                      algo_overrides={"update_epochs": 1, "num_minibatches": 2}, replay=True,
                      replay_capacity=256, bus=BusConfig(log_dir=str(run_dir / "log")))
    run_colocated(cfg)
    run = load(run_dir)
    replayed = [s.to_version for _, s in run.steps if s.losses.get("replay_samples", 0) > 0]
    assert replayed
    report = verify(run, run_dir / "snapshots")
    d = report.divergence
    assert d is not None and (d.version, d.reason) == (replayed[0], MISSING) and "replayed" in d.detail
    assert report.checked == list(range(replayed[0]))
