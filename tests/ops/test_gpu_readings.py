"""The GPU sampler's figures beside the main tests (tests/ops/test_gpu.py; a fake ``pynvml``, the
test machines have no GPU): the summary's maximum is the largest sample whatever their order,
``utilization()`` (the dynamic minibatch's signal) is the mean over devices, and a reading that
fails is left out, never recorded as a figure."""

from __future__ import annotations

import types

from runtime.gpu import GPU_OK, GpuSampler
from tests.ops.test_gpu import Clock, FakeNvml


def test_the_summary_max_is_the_largest_sample_not_the_last():
    clock = Clock()
    gpu = GpuSampler(FakeNvml([[90, 40, 70]]), every_s=1.0, clock=clock)
    for t in (0.0, 1.0, 2.0):
        clock.t = t
        gpu.sample()
    assert gpu.summary() == {"status": GPU_OK, "devices": 1, "samples": 3,
                             "utilization_pct_mean": 66.67, "utilization_pct_max": 90.0}


def test_utilization_now_is_the_mean_over_devices():
    gpu = GpuSampler(FakeNvml([[20], [60], [100]]))
    assert gpu.utilization() == 60.0
    assert gpu.samples == []  # a reading now, not a recorded sample


class FailingReads(FakeNvml):
    """A device whose utilisation reading fails (NVML raises, e.g. GPU is lost)."""

    def nvmlDeviceGetUtilizationRates(self, handle: int):
        self.reads += 1
        if self.reads == 1:
            raise RuntimeError("NVMLError_GpuIsLost")
        return types.SimpleNamespace(gpu=self.rates[handle].pop(0), memory=0)


def test_a_failed_reading_is_left_out_not_made_up():
    clock = Clock()
    gpu = GpuSampler(FailingReads([[80]]), every_s=1.0, clock=clock)
    assert gpu.sample() is None and gpu.samples == []
    assert gpu.summary() == {"status": GPU_OK, "devices": 1, "samples": 0}  # no mean of nothing
    clock.t = 1.0
    assert gpu.sample() == 80.0 and gpu.summary()["utilization_pct_mean"] == 80.0
    assert GpuSampler(FailingReads([[10]])).utilization() is None
