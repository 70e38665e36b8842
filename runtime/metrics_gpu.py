"""The GPU gauges of ``runtime.metrics``: utilisation (NVML) and memory read from ``torch.cuda``
at scrape time, and why they are absent (``GPU_REASONS``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: ``reason`` of ``rlstream_gpu_available``: utilisation exported, no CUDA device, a device but
#: no NVML (``pip install 'rlstream[gpu]'``), or GPU metrics turned off for the role.
GPU_REASONS: tuple[str, ...] = ("ok", "no_gpu", "no_nvml", "off")


class GpuProbe(Protocol):
    """The part of ``torch.cuda`` the GPU collector reads (a fake in tests)."""

    def is_available(self) -> bool: ...
    def device_count(self) -> int: ...
    def utilization(self, device: int) -> int: ...
    def memory_allocated(self, device: int) -> int: ...
    def memory_reserved(self, device: int) -> int: ...
    def get_device_properties(self, device: int) -> Any: ...


class GpuCollector(Collector):
    """Reads GPU utilisation and memory at scrape time from ``torch.cuda``.

    Utilisation needs NVML (``torch.cuda.utilization`` imports ``pynvml``); if
    it is unavailable, ``rlstream_gpu_utilization_ratio`` is absent rather than
    a made-up value. A device whose reading fails at scrape time is skipped.
    """

    def __init__(self, role: str, probe: GpuProbe) -> None:
        self._role = role
        self._probe = probe
        self._devices = list(range(probe.device_count()))
        self.utilization_supported = self._try_utilization()

    def _try_utilization(self) -> bool:
        if not self._devices:
            return False
        try:
            self._probe.utilization(self._devices[0])
        except Exception:  # ModuleNotFoundError (pynvml), NVML errors, ...
            return False
        return True

    def _families(self) -> dict[str, GaugeMetricFamily]:
        labels = ["role", "device"]
        fams = {}
        if self.utilization_supported:
            fams["util"] = GaugeMetricFamily(
                "rlstream_gpu_utilization_ratio",
                "GPU utilisation over the last sample period (NVML), 0..1.",
                labels=labels,
            )
        fams["alloc"] = GaugeMetricFamily(
            "rlstream_gpu_memory_allocated_bytes",
            "GPU memory held by tensors of this process (torch caching allocator).",
            labels=labels,
        )
        fams["reserved"] = GaugeMetricFamily(
            "rlstream_gpu_memory_reserved_bytes",
            "GPU memory reserved by this process's caching allocator.",
            labels=labels,
        )
        fams["total"] = GaugeMetricFamily(
            "rlstream_gpu_memory_total_bytes",
            "Total memory of the GPU.",
            labels=labels,
        )
        return fams

    def describe(self) -> Iterable[Metric]:
        return list(self._families().values())

    def collect(self) -> Iterator[Metric]:
        fams = self._families()
        for dev in self._devices:
            labels = [self._role, str(dev)]
            readers: list[tuple[str, Callable[[], float]]] = [
                ("alloc", lambda d=dev: float(self._probe.memory_allocated(d))),
                ("reserved", lambda d=dev: float(self._probe.memory_reserved(d))),
                ("total", lambda d=dev: float(self._probe.get_device_properties(d).total_memory)),
            ]
            if "util" in fams:
                readers.append(("util", lambda d=dev: self._probe.utilization(d) / 100.0))
            for key, read in readers:
                try:
                    value = read()
                except Exception:
                    continue  # no value is better than a wrong one
                fams[key].add_metric(labels, value)
        yield from fams.values()


def _default_gpu_probe() -> GpuProbe | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda  # type: ignore[return-value]
