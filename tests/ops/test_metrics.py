from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from runtime.metrics import Metrics
from runtime.metrics_families import BREAKER_HALF_OPEN, BREAKER_OPEN, LATENCY_BUCKETS, METRIC_NAMES


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class FakeCuda:
    """Stands in for torch.cuda: two devices, optional NVML."""

    def __init__(self, nvml: bool = True, available: bool = True) -> None:
        self.nvml = nvml
        self.available = available

    def is_available(self) -> bool:
        return self.available

    def device_count(self) -> int:
        return 2

    def utilization(self, device: int) -> int:
        if not self.nvml:
            raise ModuleNotFoundError("No module named 'pynvml'")
        return 40 + device

    def memory_allocated(self, device: int) -> int:
        return 1000 * (device + 1)

    def memory_reserved(self, device: int) -> int:
        return 2000 * (device + 1)

    def get_device_properties(self, device: int) -> SimpleNamespace:
        return SimpleNamespace(total_memory=80 * 2**30)


def samples(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: Metrics, name: str, **labels: str) -> float:
    return samples(m)[(name, tuple(sorted(labels.items())))]


def family_names(m: Metrics) -> set[str]:
    return {
        line.split()[2]
        for line in m.render().decode().splitlines()
        if line.startswith("# TYPE ") and not line.split()[2].endswith("_created")
    }


def test_every_family_is_registered_with_namespace() -> None:
    m = Metrics(gpu_probe=FakeCuda())
    names = family_names(m)
    assert names == set(METRIC_NAMES)
    assert all(n.startswith("rlstream_") for n in names)


def test_registries_are_private() -> None:
    a, b = Metrics(gpu=False), Metrics(gpu=False)  # same names, no "Duplicated timeseries"
    a.count_learner_steps(3)
    assert value(a, "rlstream_learner_steps_total", role="colocated") == 3
    assert value(b, "rlstream_learner_steps_total", role="colocated") == 0


def test_role_views_share_one_registry() -> None:
    m = Metrics(gpu=False)
    actor, learner = m.for_role("actor"), m.for_role("learner")
    assert actor.registry is m.registry is learner.registry
    actor.count_samples(64, "collected")
    learner.count_samples(32, "trained")
    learner.set_policy_version(7)
    s = samples(m)
    assert s[("rlstream_samples_total", (("role", "actor"), ("stage", "collected")))] == 64
    assert s[("rlstream_samples_total", (("role", "learner"), ("stage", "trained")))] == 32
    assert s[("rlstream_policy_version", (("role", "learner"),))] == 7
    assert ("rlstream_policy_version", (("role", "actor"),)) not in s


def test_policy_latency_buckets() -> None:
    assert LATENCY_BUCKETS[0] == 0.0005 and LATENCY_BUCKETS[-1] == 5.0
    assert list(LATENCY_BUCKETS) == sorted(set(LATENCY_BUCKETS)) and len(LATENCY_BUCKETS) >= 20
    m = Metrics(role="actor", gpu=False)
    m.observe_policy_latency(0.0031)
    m.observe_policy_latency(-0.5)  # clock skew: clamped to 0
    assert value(m, "rlstream_policy_latency_seconds_bucket", role="actor", le="0.0005") == 1
    assert value(m, "rlstream_policy_latency_seconds_bucket", role="actor", le="0.003") == 1
    assert value(m, "rlstream_policy_latency_seconds_bucket", role="actor", le="0.005") == 2
    assert value(m, "rlstream_policy_latency_seconds_count", role="actor") == 2
    assert value(m, "rlstream_policy_latency_seconds_sum", role="actor") == pytest.approx(0.0031)


def test_policy_lag_gauges_and_histograms() -> None:
    m = Metrics(role="streams", gpu=False)
    m.observe_policy_lag(3, ms=250.0)
    m.observe_policy_lag(1)
    assert value(m, "rlstream_policy_lag_versions", role="streams") == 1
    assert value(m, "rlstream_policy_lag_seconds", role="streams") == pytest.approx(0.25)
    assert value(m, "rlstream_sample_policy_lag_versions_count", role="streams") == 2
    assert value(m, "rlstream_sample_policy_lag_versions_bucket", role="streams", le="2.0") == 1
    assert value(m, "rlstream_sample_policy_lag_seconds_count", role="streams") == 1


def test_freshness_ratio_window_and_counters() -> None:
    m = Metrics(role="streams", gpu=False, freshness_window=100)
    assert math.isnan(value(m, "rlstream_sample_freshness_ratio", role="streams"))
    m.observe_freshness(fresh=30, total=40)
    assert value(m, "rlstream_sample_freshness_ratio", role="streams") == pytest.approx(0.75)
    for _ in range(10):  # 100 recent samples, all stale: the old 30/40 slides out
        m.observe_freshness(fresh=0, total=10)
    assert value(m, "rlstream_sample_freshness_ratio", role="streams") == 0.0
    assert value(m, "rlstream_samples_fresh_total", role="streams") == 30
    assert value(m, "rlstream_samples_freshness_checked_total", role="streams") == 140
    with pytest.raises(ValueError):
        m.observe_freshness(fresh=5, total=4)


def test_sps_is_a_sliding_window_rate() -> None:
    clock = FakeClock()
    m = Metrics(role="actor", gpu=False, clock=clock, sps_window_s=10.0)
    for _ in range(4):
        clock.t += 1.0
        m.count_samples(100, "collected")
    assert value(m, "rlstream_sps", role="actor", stage="collected") == pytest.approx(100.0)
    clock.t += 20.0  # idle: the rate decays to 0 instead of freezing
    assert value(m, "rlstream_sps", role="actor", stage="collected") == 0.0
    assert value(m, "rlstream_samples_total", role="actor", stage="collected") == 400


def test_drops_dead_letters_consumer_lag_batch_size_steps() -> None:
    m = Metrics(role="streams", gpu=False)
    m.count_drop("duplicate")
    m.count_drop("stale_versions", 5)
    m.count_dead_letter("rl.samples.raw", "decode_error")
    m.set_consumer_lag("streams", "rl.samples.raw", 1234)
    m.set_batch_size(128)
    m.count_learner_steps()
    m.observe_step_time(0.02, phase="backward")
    assert value(m, "rlstream_drops_total", role="streams", reason="stale_versions") == 5
    assert value(m, "rlstream_drops_total", role="streams", reason="duplicate") == 1
    assert value(m, "rlstream_dead_letters_total", role="streams", topic="rl.samples.raw", reason="decode_error") == 1
    assert value(m, "rlstream_consumer_lag", role="streams", group="streams", topic="rl.samples.raw") == 1234
    assert value(m, "rlstream_batch_size", role="streams") == 128
    m.set_fragment_length(64)
    m.set_replay(512, 0.25, 1.5)
    assert value(m, "rlstream_fragment_length", role="streams") == 64
    assert value(m, "rlstream_batch_size", role="streams") == 128  # its own series
    assert (value(m, "rlstream_replay_cache_samples", role="streams"), value(m, "rlstream_replay_ratio", role="streams"),
            value(m, "rlstream_replay_samples_per_insert", role="streams")) == (512, 0.25, 1.5)
    assert value(m, "rlstream_learner_steps_total", role="streams") == 1
    assert value(m, "rlstream_step_duration_seconds_count", role="streams", phase="backward") == 1


def test_circuit_breaker_hook() -> None:
    m = Metrics(role="learner", gpu=False)
    hook = m.circuit_breaker_hook()
    hook(0, 0)
    assert value(m, "rlstream_circuit_breaker_state", role="learner") == 0
    hook(0, BREAKER_OPEN)
    hook(BREAKER_OPEN, BREAKER_HALF_OPEN)
    hook(BREAKER_HALF_OPEN, BREAKER_OPEN)
    assert value(m, "rlstream_circuit_breaker_state", role="learner") == BREAKER_OPEN
    assert value(m, "rlstream_circuit_breaker_trips_total", role="learner") == 2
    with pytest.raises(ValueError):
        m.set_circuit_breaker_state(7)


def test_two_breakers_of_a_role_show_the_most_restrictive_state() -> None:
    """The learner's backlog and policy-lag breakers share the state gauge: an open one is not
    hidden by the other closing, and each trip is counted."""
    m = Metrics(role="learner", gpu=False)
    backlog, policy = m.circuit_breaker_hook(), m.circuit_breaker_hook()
    policy(0, BREAKER_OPEN)
    backlog(0, 0)
    assert value(m, "rlstream_circuit_breaker_state", role="learner") == BREAKER_OPEN
    backlog(0, BREAKER_OPEN)
    policy(BREAKER_OPEN, BREAKER_HALF_OPEN)
    assert value(m, "rlstream_circuit_breaker_state", role="learner") == BREAKER_OPEN
    backlog(BREAKER_OPEN, BREAKER_HALF_OPEN)
    assert value(m, "rlstream_circuit_breaker_state", role="learner") == BREAKER_HALF_OPEN
    backlog(BREAKER_HALF_OPEN, 0)
    policy(BREAKER_HALF_OPEN, 0)
    assert value(m, "rlstream_circuit_breaker_state", role="learner") == 0
    assert value(m, "rlstream_circuit_breaker_trips_total", role="learner") == 2


def gpu_series(m: Metrics) -> set[str]:
    return {name for name, _ in samples(m) if name.startswith("rlstream_gpu")}


def test_gpu_metrics_say_no_gpu_without_gpu() -> None:
    """No made-up GPU figures where there is no GPU, but the absence is said: one
    ``rlstream_gpu_available`` series at 0 with the reason."""
    m = Metrics(gpu_probe=FakeCuda(available=False))
    assert not m.gpu_enabled
    assert gpu_series(m) == {"rlstream_gpu_available"}
    assert value(m, "rlstream_gpu_available", role="colocated", reason="no_gpu") == 0
    off = Metrics(gpu=False, gpu_probe=FakeCuda())
    assert gpu_series(off) == {"rlstream_gpu_available"}
    assert value(off, "rlstream_gpu_available", role="colocated", reason="off") == 0
    no_nvml = Metrics(gpu_probe=FakeCuda(nvml=False))
    assert value(no_nvml, "rlstream_gpu_available", role="colocated", reason="no_nvml") == 0
    ok = Metrics(gpu_probe=FakeCuda())
    assert value(ok, "rlstream_gpu_available", role="colocated", reason="ok") == 1
    with pytest.raises(RuntimeError):
        Metrics(gpu=True, gpu_probe=FakeCuda(available=False))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only default path")
def test_real_torch_on_cpu_says_no_gpu() -> None:
    m = Metrics()
    assert not m.gpu_enabled and gpu_series(m) == {"rlstream_gpu_available"}
    assert value(m, "rlstream_gpu_available", role="colocated", reason="no_gpu") == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_gpu_metrics() -> None:
    m = Metrics()
    text = m.render().decode()
    assert "rlstream_gpu_memory_total_bytes" in text
    assert ("rlstream_gpu_utilization_ratio" in text) == m.gpu_utilization_enabled


def test_gpu_metrics_read_at_scrape_time() -> None:
    fake = FakeCuda()
    m = Metrics(role="learner", gpu_probe=fake)
    assert m.gpu_enabled and m.gpu_utilization_enabled
    assert value(m, "rlstream_gpu_utilization_ratio", role="learner", device="1") == pytest.approx(0.41)
    assert value(m, "rlstream_gpu_memory_allocated_bytes", role="learner", device="0") == 1000
    assert value(m, "rlstream_gpu_memory_total_bytes", role="learner", device="0") == 80 * 2**30
    fake.memory_allocated = lambda d: 5  # type: ignore[method-assign]
    assert value(m, "rlstream_gpu_memory_allocated_bytes", role="learner", device="0") == 5


def test_gpu_utilization_absent_without_nvml() -> None:
    m = Metrics(gpu_probe=FakeCuda(nvml=False))
    text = m.render().decode()
    assert m.gpu_enabled and not m.gpu_utilization_enabled
    assert "rlstream_gpu_utilization_ratio" not in text  # never a made-up value
    assert "rlstream_gpu_memory_reserved_bytes" in text


def test_every_listed_drop_reason_is_one_the_code_emits() -> None:
    """``DROP_REASONS`` is the set of reasons that exist: each is a constant of the processors,
    the codec's errors or the roles (no stale entries), and every such constant is listed."""
    import ast
    from pathlib import Path

    from runtime.metrics_families import DROP_REASONS

    root = Path(__file__).resolve().parents[2]
    emitted: set[str] = set()
    for path in [*root.glob("streams/processors/*.py"), root / "schemas" / "errors.py", root / "learner" / "core.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                names = [t.id if isinstance(t, ast.Name) else "" for t in node.targets]
                if any(n.startswith("REASON_") or n == "reason" for n in names):
                    emitted.add(node.value.value)
    emitted.add("env_nonfinite")  # rlstream.wiring's actor hook
    assert set(DROP_REASONS) == emitted, (set(DROP_REASONS) ^ emitted)
