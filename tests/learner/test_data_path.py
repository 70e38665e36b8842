"""The data path into the learner: numpy fragments become one batch, moved onto the device once
(pinned and non-blocking on CUDA: that branch is driven here on CPU with the plan forced and a
meta device), and each round's time is split into decode, copy, update and publish."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import learner.batching as batching
from agents.core import TrajectoryBatch
from agents.registry import make_algorithm
from learner.batching import StreamIds, copy_plan, to_device, to_trajectory_batch
from learner.core import PHASES, Fragment, LearnerConfig, LearnerCore
from tests.support.fragments import ACT, OBS, N, fragment

torch.set_num_threads(1)


def test_the_copy_is_pinned_and_non_blocking_only_on_cuda():
    assert copy_plan("cuda") == (True, True) and copy_plan("cuda:1") == (True, True)
    assert copy_plan("cpu") == (False, False)


def test_on_the_host_the_batch_stays_zero_copy():
    batch = to_trajectory_batch([fragment(0)], StreamIds())
    assert to_device(batch, "cpu") is batch
    obs = np.zeros((2, 1, OBS), np.float32)
    b = TrajectoryBatch.from_numpy(obs=obs, actions=np.zeros((2, 1, ACT), np.float32), rewards=np.zeros((2, 1), np.float32),
                                   terminated=np.zeros((2, 1), bool), truncated=np.zeros((2, 1), bool),
                                   behaviour_logp=np.zeros((2, 1), np.float32))
    obs[0, 0, 0] = 7.0
    assert float(to_device(b, "cpu").obs[0, 0, 0]) == 7.0  # the numpy array's own memory


def test_a_device_copy_pins_each_host_tensor_once_then_copies_it_non_blocking(monkeypatch):
    pinned, copies = [], []
    monkeypatch.setattr(batching, "copy_plan", lambda device: (True, True))
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(tuple(self.shape)) or self)
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        copies.append(kwargs.get("non_blocking"))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    batch = to_trajectory_batch([fragment(0), fragment(1)], StreamIds())
    moved = to_device(batch, "meta")
    tensors = [k for k, v in vars(batch).items() if isinstance(v, torch.Tensor)]
    assert len(pinned) == len(tensors) and copies == [True] * len(tensors)
    assert all(getattr(moved, k).device.type == "meta" for k in tensors)
    assert moved.staleness_versions.shape == batch.staleness_versions.shape


def test_each_round_reports_where_its_time_went():
    algo = make_algorithm("ppo", OBS, ACT, {"num_minibatches": 2, "update_epochs": 1}, "cpu")
    core = LearnerCore(LearnerConfig(train_batch_size=2 * 16 * N), algo)
    core.next_version()
    for i in range(2):
        core.add(Fragment(fragment(i), f"d{i}"))
    core.update()
    assert set(core.timing.last) == set(PHASES)
    assert core.timing.last["decode"] > 0 and core.timing.last["update"] > core.timing.last["copy"] >= 0
    assert core.timing.last["publish"] == 0.0  # the shell's part: a core alone publishes nothing
    summary = core.timing.summary(compile_s=1.5)
    assert summary["compile"] == 1.5 and summary["update"] == pytest.approx(core.timing.last["update"], abs=1e-4)


def test_the_learner_shell_adds_publish_and_reports_the_phases_in_its_summary(tmp_path):
    from learner.learner import Learner
    from learner.snapshots.url import open_store
    from schemas.codec import Codec
    from streams.bus.memory import MemoryBus
    from streams.events import EventBus
    from streams.topics import SAMPLES_PREPARED, all_topics

    bus = MemoryBus()
    bus.create_topics(all_topics())
    events = EventBus(bus, Codec())
    algo = make_algorithm("ppo", OBS, ACT, {"num_minibatches": 2, "update_epochs": 1}, "cpu")
    lr = Learner(LearnerConfig(train_batch_size=16 * N, snapshot_every=0), algo, events, snapshots=open_store(tmp_path))
    lr.start()
    for i in range(2):
        events.publish(SAMPLES_PREPARED, fragment(i), key="actor-0")
        assert lr.step(0) is not None
    summary = lr.summary()
    assert summary["updates"] == 2 and summary["capture"] is None  # eager: nothing captured
    assert set(summary["time_s"]) == {*PHASES, "compile"} and summary["time_s"]["compile"] == 0.0
    assert summary["time_s"]["publish"] > 0 and summary["time_s"]["update"] > 0
    assert lr.core.timing.last["publish"] > 0
