"""GPU utilisation through NVML (``pynvml``, from the ``nvidia-ml-py`` package: ``pip install
rlstream[gpu]``), sampled while a role runs and summarised at its end. Where NVML or a GPU is
absent the summary says so (``{"status": "no GPU", "reason": ...}``) instead of leaving the
figure out::

    gpu = GpuSampler()            # imports pynvml and counts devices once; never raises
    gpu.sample()                  # on each progress round; at most once per ``every_s``
    summary["gpu"] = gpu.summary()
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import Any

#: The status of a run without a readable GPU (``rlstream validate`` prints it as the value).
NO_GPU = "no GPU"
GPU_OK = "ok"


def _load_nvml() -> Any:
    return importlib.import_module("pynvml")


class GpuSampler:
    """Utilisation (percent, NVML's ``gpu`` rate) of every device, sampled at most once per
    ``every_s``; ``nvml``: the ``pynvml`` module (tests pass a fake), None: import it."""

    def __init__(self, nvml: Any = None, every_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s, self.clock = every_s, clock
        self.status, self.reason = NO_GPU, ""
        self._nvml: Any = None
        self._handles: list[Any] = []
        self._last = -float("inf")
        self.samples: list[float] = []  # mean over devices, one per sample
        try:
            nvml = nvml if nvml is not None else _load_nvml()
        except ImportError:
            self.reason = "NVML unavailable: nvidia-ml-py is not installed (pip install 'rlstream[gpu]')"
            return
        try:
            nvml.nvmlInit()
            count = int(nvml.nvmlDeviceGetCount())
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except Exception as e:  # NVMLError_LibraryNotFound / DriverNotLoaded: no GPU here
            self.reason = f"NVML: {type(e).__name__}: {e}"[:300]
            return
        if not self._handles:
            self.reason = "NVML: no device"
            return
        self._nvml, self.status = nvml, GPU_OK

    @property
    def available(self) -> bool:
        return self.status == GPU_OK

    def read(self) -> list[float]:
        """Each device's utilisation now, in percent (empty without a GPU)."""
        if self._nvml is None:
            return []
        return [float(self._nvml.nvmlDeviceGetUtilizationRates(h).gpu) for h in self._handles]

    def utilization(self) -> float | None:
        """The mean utilisation over devices now, in percent; None without a GPU or when the
        reading fails (the learner's dynamic minibatch size then uses its duty cycle)."""
        try:
            values = self.read()
        except Exception:
            return None
        return sum(values) / len(values) if values else None

    def sample(self, force: bool = False) -> float | None:
        """Record the mean utilisation over devices if ``every_s`` has passed; returns it."""
        now = self.clock()
        if self._nvml is None or (not force and now - self._last < self.every_s):
            return None
        self._last = now
        try:
            values = self.read()
        except Exception:  # a reading that fails is left out, not made up
            return None
        if not values:
            return None
        value = sum(values) / len(values)
        self.samples.append(value)
        return value

    def summary(self) -> dict[str, Any]:
        """``{"status": "no GPU", "reason": ...}``, or the utilisation's mean, max and sample count."""
        if not self.available:
            return {"status": NO_GPU, "reason": self.reason}
        out: dict[str, Any] = {"status": GPU_OK, "devices": len(self._handles), "samples": len(self.samples)}
        if self.samples:
            out["utilization_pct_mean"] = round(sum(self.samples) / len(self.samples), 2)
            out["utilization_pct_max"] = round(max(self.samples), 2)
        return out
