"""GPU utilisation through NVML, with a fake ``pynvml`` (no GPU on the test machines): the
summary holds the sampled utilisation, or says "no GPU" and why."""

from __future__ import annotations

import sys
import types

import pytest

from runtime.gpu import GPU_OK, NO_GPU, GpuSampler


class FakeNvml:
    """The part of ``pynvml`` (nvidia-ml-py) the sampler calls."""

    def __init__(self, rates: list[list[int]], init_error: Exception | None = None) -> None:
        self.rates = rates  # per device, the readings in turn
        self.init_error = init_error
        self.reads = 0

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error

    def nvmlDeviceGetCount(self) -> int:
        return len(self.rates)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUtilizationRates(self, handle: int):
        self.reads += 1
        return types.SimpleNamespace(gpu=self.rates[handle].pop(0), memory=0)


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def test_samples_are_the_mean_over_devices_at_most_once_per_interval():
    clock = Clock()
    nvml = FakeNvml([[60, 80, 90], [70, 90, 100]])
    gpu = GpuSampler(nvml, every_s=1.0, clock=clock)
    assert gpu.status == GPU_OK and gpu.available
    assert gpu.sample() == 65.0
    clock.t = 0.5
    assert gpu.sample() is None and nvml.reads == 2  # too soon: NVML not read
    clock.t = 1.0
    assert gpu.sample() == 85.0
    assert gpu.sample(force=True) == 95.0
    assert gpu.summary() == {"status": GPU_OK, "devices": 2, "samples": 3,
                             "utilization_pct_mean": 81.67, "utilization_pct_max": 95.0}


def test_no_nvml_module_says_no_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    gpu = GpuSampler()
    assert gpu.summary()["status"] == NO_GPU and "nvidia-ml-py is not installed" in gpu.summary()["reason"]
    assert gpu.sample(force=True) is None and gpu.read() == []


def test_nvml_without_a_driver_or_a_device_says_no_gpu():
    class NVMLError_DriverNotLoaded(Exception):
        pass

    broken = GpuSampler(FakeNvml([[50]], init_error=NVMLError_DriverNotLoaded("Driver Not Loaded")))
    assert broken.summary() == {"status": NO_GPU, "reason": "NVML: NVMLError_DriverNotLoaded: Driver Not Loaded"}
    empty = GpuSampler(FakeNvml([]))
    assert empty.summary() == {"status": NO_GPU, "reason": "NVML: no device"}


def test_the_real_module_is_found_as_pynvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([[42]]))
    gpu = GpuSampler()
    assert gpu.sample() == 42.0 and gpu.summary()["utilization_pct_mean"] == 42.0


def _real_gpus() -> int:
    """Devices the real NVML sees (0: no nvidia-ml-py, no driver or no device)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:  # ImportError, NVMLError_*: no GPU here
        return 0


def test_where_a_gpu_exists_the_real_nvml_is_read():
    """The fakes above stand in only where there is no GPU; on a GPU machine (the `gpu` extra
    installed) the sampler reads the real NVML."""
    if _real_gpus() == 0:
        pytest.skip("no GPU visible to NVML (or nvidia-ml-py not installed): the fakes above cover the path")
    gpu = GpuSampler()
    assert gpu.status == GPU_OK and gpu.available
    pct = gpu.sample(force=True)
    assert pct is not None and 0.0 <= pct <= 100.0
    assert gpu.summary()["devices"] == _real_gpus()
