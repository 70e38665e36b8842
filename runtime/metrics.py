"""Every Prometheus metric rlstream exports, in one place.

A ``Metrics`` object owns its ``CollectorRegistry`` (never the global one), so
tests and several in-process roles do not collide. Every series carries a
``role`` label. A process creates one root ``Metrics`` and hands each role a
view of it::

    metrics = Metrics(role="colocated")          # one registry per process
    actor_m = metrics.for_role("actor")          # same registry, role="actor"
    learner_m = metrics.for_role("learner")
    server = MetricsServer(metrics.registry, health, port=9100).start()

    actor_m.observe_policy_latency(0.004)        # learner publish -> actor use
    learner_m.count_learner_steps()
    learner_m.set_batch_size(128)                # the learner's minibatch

Components never touch prometheus objects; they call the helper methods
below (or receive a callable such as ``circuit_breaker_hook()``).

Exported families (the Grafana dashboard and the manifests tests use these
names; ``METRIC_NAMES`` lists them):

=========================================  =========  ======================
name                                       type       labels (besides role)
=========================================  =========  ======================
rlstream_policy_latency_seconds            histogram
rlstream_policy_lag_versions               gauge
rlstream_sample_policy_lag_versions        histogram
rlstream_policy_lag_seconds                gauge
rlstream_sample_policy_lag_seconds         histogram
rlstream_sample_freshness_ratio            gauge
rlstream_samples_fresh_total               counter
rlstream_samples_freshness_checked_total   counter
rlstream_samples_total                     counter    stage
rlstream_sps                               gauge      stage
rlstream_drops_total                       counter    reason
rlstream_dead_letters_total                counter    topic, reason
rlstream_skipped_total                     counter    topic, reason
rlstream_consumer_lag                      gauge      group, topic
rlstream_batch_size                        gauge
rlstream_fragment_length                   gauge
rlstream_replay_cache_samples              gauge
rlstream_replay_ratio                      gauge
rlstream_replay_samples_per_insert         gauge
rlstream_step_duration_seconds             histogram  phase
rlstream_learner_steps_total               counter
rlstream_policy_version                    gauge
rlstream_circuit_breaker_state             gauge
rlstream_circuit_breaker_trips_total       counter
rlstream_snapshot_failures_total           counter    error
rlstream_gpu_available                     gauge      reason   (always: 1 ok; 0 no_gpu, no_nvml, off)
rlstream_gpu_utilization_ratio             gauge      device   (GPU + pynvml only)
rlstream_gpu_memory_allocated_bytes        gauge      device   (GPU only)
rlstream_gpu_memory_reserved_bytes         gauge      device   (GPU only)
rlstream_gpu_memory_total_bytes            gauge      device   (GPU only)
=========================================  =========  ======================

``rlstream_batch_size`` is the learner's minibatch (transitions); the decoupled actor's
fragment length (steps per env) is ``rlstream_fragment_length``. The three ``replay`` gauges
describe the learner node's sample cache (``--replay``).

Policy lag in time is exported in seconds (Prometheus base unit), although
the helper takes milliseconds, the unit the events carry (``created_at_ms``).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

NAMESPACE = "rlstream"

#: Policy latency buckets: fine-grained from 0.5 ms to 5 s (roughly 1-1.5-2-3-5-7.5
#: per decade), so p50/p99 are readable whether actors are in-process or over Kafka.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075,
    0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0,
)
#: Policy lag in versions: small integers matter most (K is typically 1-8).
LAG_VERSION_BUCKETS: tuple[float, ...] = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64, 128)
#: Policy lag in seconds: from 1 ms to 2 minutes.
LAG_SECONDS_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)
#: Step / stage durations: 1 ms to 60 s.
STEP_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)

#: Values of ``rlstream_circuit_breaker_state`` (same as learner.circuit_breaker.State).
BREAKER_CLOSED = 0
BREAKER_OPEN = 1
BREAKER_HALF_OPEN = 2

#: The ``reason`` values ``count_drop`` is given (every value is a series): the processors'
#: rejections (``streams.processors``), the codec's errors (``schemas.errors``), the learner's
#: and the actor's. ``tests/ops/test_metrics.py`` checks each is emitted somewhere.
DROP_REASONS: tuple[str, ...] = (
    "stale_versions",  # older than K policy versions
    "stale_ms",  # older than T ms
    "duplicate",  # batch_id seen before (counted, not dead-lettered)
    "late",  # a seq below the actor's next, not a duplicate
    "seq_conflict",  # a seq already taken by another batch
    "importance_unavailable",  # no log-prob function for the current policy
    "processor_error",  # the pipeline raised on this batch
    "corrupt", "unknown_schema", "wrong_type", "invalid", "schema_definition", "codec_error",  # decode
    "incompatible",  # the learner cannot train on this batch (another env's shapes)
    "env_nonfinite",  # an actor's env returned NaN/inf
)

_GPU_NAMES = (
    "rlstream_gpu_utilization_ratio",
    "rlstream_gpu_memory_allocated_bytes",
    "rlstream_gpu_memory_reserved_bytes",
    "rlstream_gpu_memory_total_bytes",
)

#: Every family name (as it appears in the exposition text, counters with
#: ``_total``). GPU names only appear where a GPU exists.
METRIC_NAMES: tuple[str, ...] = (
    "rlstream_policy_latency_seconds",
    "rlstream_policy_lag_versions",
    "rlstream_sample_policy_lag_versions",
    "rlstream_policy_lag_seconds",
    "rlstream_sample_policy_lag_seconds",
    "rlstream_sample_freshness_ratio",
    "rlstream_samples_fresh_total",
    "rlstream_samples_freshness_checked_total",
    "rlstream_samples_total",
    "rlstream_sps",
    "rlstream_drops_total",
    "rlstream_dead_letters_total",
    "rlstream_skipped_total",
    "rlstream_consumer_lag",
    "rlstream_batch_size",
    "rlstream_fragment_length",
    "rlstream_replay_cache_samples",
    "rlstream_replay_ratio",
    "rlstream_replay_samples_per_insert",
    "rlstream_step_duration_seconds",
    "rlstream_learner_steps_total",
    "rlstream_policy_version",
    "rlstream_circuit_breaker_state",
    "rlstream_circuit_breaker_trips_total",
    "rlstream_snapshot_failures_total",
    "rlstream_gpu_available",
    *_GPU_NAMES,
)

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


class _RateMeter:
    """Events per second over a sliding time window (decays to 0 when idle)."""

    def __init__(self, window_s: float, clock: Callable[[], float], started: float) -> None:
        self._window_s = window_s
        self._clock = clock
        self._events: deque[tuple[float, float]] = deque()
        self._sum = 0.0
        self._started = started  # young processes divide by their age, not the full window
        self._lock = threading.Lock()

    def add(self, n: float) -> None:
        with self._lock:
            now = self._clock()
            self._events.append((now, n))
            self._sum += n
            self._prune(now)

    def rate(self) -> float:
        with self._lock:
            now = self._clock()
            self._prune(now)
            elapsed = min(self._window_s, now - self._started)
            if elapsed <= 0.0:
                return 0.0
            return self._sum / elapsed

    def _prune(self, now: float) -> None:
        horizon = now - self._window_s
        while self._events and self._events[0][0] < horizon:
            self._sum -= self._events.popleft()[1]


class _FreshnessWindow:
    """Fraction of fresh samples among the last ``window`` samples checked."""

    def __init__(self, window: int) -> None:
        self._window = window
        self._obs: deque[tuple[int, int]] = deque()
        self._fresh = 0
        self._total = 0
        self._lock = threading.Lock()

    def add(self, fresh: int, total: int) -> None:
        with self._lock:
            self._obs.append((fresh, total))
            self._fresh += fresh
            self._total += total
            # Keep at least the newest observation, even if it alone exceeds the window.
            while len(self._obs) > 1 and self._total - self._obs[0][1] >= self._window:
                f, t = self._obs.popleft()
                self._fresh -= f
                self._total -= t

    def ratio(self) -> float:
        with self._lock:
            if self._total == 0:
                return math.nan  # nothing checked yet: unknown, not 0 or 1
            return self._fresh / self._total


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


class _Shared:
    """Collectors and window state shared by every role view of one registry."""

    def __init__(
        self,
        registry: CollectorRegistry,
        clock: Callable[[], float],
        sps_window_s: float,
        freshness_window: int,
    ) -> None:
        self.registry = registry
        self.clock = clock
        self.created_at = clock()
        self.sps_window_s = sps_window_s
        self.freshness_window = freshness_window
        self.lock = threading.Lock()
        self.rate_meters: dict[tuple[str, str], _RateMeter] = {}
        self.freshness: dict[str, _FreshnessWindow] = {}
        self.breaker_states: dict[str, list[int]] = {}  # role -> the state of each of its breakers
        self.gpu: GpuCollector | None = None
        r = registry
        R = ["role"]

        self.policy_latency = Histogram(
            "policy_latency_seconds",
            "Time from the learner publishing a policy version to a running actor using it "
            "(an actor's first adoption, its start-up, is not counted).",
            R, namespace=NAMESPACE, registry=r, buckets=LATENCY_BUCKETS,
        )
        self.policy_lag_versions = Gauge(
            "policy_lag_versions",
            "Latest policy lag: current version minus the version that produced the samples.",
            R, namespace=NAMESPACE, registry=r,
        )
        self.sample_policy_lag_versions = Histogram(
            "sample_policy_lag_versions",
            "Distribution of policy lag in versions, one observation per batch.",
            R, namespace=NAMESPACE, registry=r, buckets=LAG_VERSION_BUCKETS,
        )
        self.policy_lag_seconds = Gauge(
            "policy_lag_seconds",
            "Latest policy lag in time: age of the behaviour policy when its samples are used.",
            R, namespace=NAMESPACE, registry=r,
        )
        self.sample_policy_lag_seconds = Histogram(
            "sample_policy_lag_seconds",
            "Distribution of policy lag in seconds, one observation per batch.",
            R, namespace=NAMESPACE, registry=r, buckets=LAG_SECONDS_BUCKETS,
        )
        self.freshness_ratio = Gauge(
            "sample_freshness_ratio",
            "Fraction of recently checked samples within the staleness window (NaN before any).",
            R, namespace=NAMESPACE, registry=r,
        )
        self.samples_fresh = Counter(
            "samples_fresh",
            "Samples found within the staleness window.",
            R, namespace=NAMESPACE, registry=r,
        )
        self.samples_checked = Counter(
            "samples_freshness_checked",
            "Samples checked against the staleness window.",
            R, namespace=NAMESPACE, registry=r,
        )
        self.samples = Counter(
            "samples",
            "Samples (environment steps) that passed through a pipeline stage.",
            R + ["stage"], namespace=NAMESPACE, registry=r,
        )
        self.sps = Gauge(
            "sps",
            "Samples per second through a pipeline stage (sliding window).",
            R + ["stage"], namespace=NAMESPACE, registry=r,
        )
        self.drops = Counter(
            "drops",
            "Samples dropped, by reason (stale, duplicate, reorder timeout, ...).",
            R + ["reason"], namespace=NAMESPACE, registry=r,
        )
        self.dead_letters = Counter(
            "dead_letters",
            "Records sent to the dead-letter topic, by original topic and reason.",
            R + ["topic", "reason"], namespace=NAMESPACE, registry=r,
        )
        self.skipped = Counter(
            "skipped",
            "Bad records skipped by a reader that does not own their topic's dead letters, by topic and reason.",
            R + ["topic", "reason"], namespace=NAMESPACE, registry=r,
        )
        self.consumer_lag = Gauge(
            "consumer_lag",
            "Consumer group lag in messages (log end offset minus committed offset, all partitions).",
            R + ["group", "topic"], namespace=NAMESPACE, registry=r,
        )
        self.batch_size = Gauge(
            "batch_size",
            "The learner's minibatch size in transitions (dynamic, 32..256, with --dynamic-batch).",
            R, namespace=NAMESPACE, registry=r,
        )
        self.fragment_length = Gauge(
            "fragment_length",
            "Steps per env of the decoupled actor's fragments (dynamic, 32..256, by the processors' backlog).",
            R, namespace=NAMESPACE, registry=r,
        )
        self.replay_cache = Gauge(
            "replay_cache_samples",
            "Transitions held in the learner node's sample cache (--replay).",
            R, namespace=NAMESPACE, registry=r,
        )
        self.replay_ratio = Gauge(
            "replay_ratio",
            "Replayed transitions over all transitions trained (--replay).",
            R, namespace=NAMESPACE, registry=r,
        )
        self.replay_spi = Gauge(
            "replay_samples_per_insert",
            "Transitions trained per transition inserted into the sample cache, fresh ones included (--replay).",
            R, namespace=NAMESPACE, registry=r,
        )
        self.step_duration = Histogram(
            "step_duration_seconds",
            "Duration of one loop step, by phase (e.g. total, forward, backward, publish).",
            R + ["phase"], namespace=NAMESPACE, registry=r, buckets=STEP_BUCKETS,
        )
        self.learner_steps = Counter(
            "learner_steps",
            "Gradient steps taken by the learner.",
            R, namespace=NAMESPACE, registry=r,
        )
        self.policy_version = Gauge(
            "policy_version",
            "Policy version currently held (learner: last published; actor/serve: in use).",
            R, namespace=NAMESPACE, registry=r,
        )
        self.breaker_state = Gauge(
            "circuit_breaker_state",
            "Learner circuit breakers (backlog, policy lag), the most restrictive: 0 closed, 1 open (paused), 2 half-open (probing).",
            R, namespace=NAMESPACE, registry=r,
        )
        self.breaker_trips = Counter(
            "circuit_breaker_trips",
            "Times a learner circuit breaker (backlog or policy lag) opened.",
            R, namespace=NAMESPACE, registry=r,
        )
        self.snapshot_failures = Counter(
            "snapshot_failures",
            "Learner snapshot saves that failed (store down, disk full, timeout), by the error's class; "
            "training went on and the save is retried.",
            R + ["error"], namespace=NAMESPACE, registry=r,
        )
        self.gpu_available = Gauge(
            "gpu_available",
            "1 when GPU utilisation is exported; 0 says why not (reason no_gpu, no_nvml or off).",
            R + ["reason"], namespace=NAMESPACE, registry=r,
        )

    def init_role(self, role: str) -> None:
        """Create the role's zero-valued counters/histograms and scrape-time gauges."""
        with self.lock:
            if role in self.freshness:
                return
            window = _FreshnessWindow(self.freshness_window)
            self.freshness[role] = window
        for c in (self.samples_fresh, self.samples_checked, self.learner_steps, self.breaker_trips):
            c.labels(role=role)
        for h in (self.policy_latency, self.sample_policy_lag_versions, self.sample_policy_lag_seconds):
            h.labels(role=role)
        self.freshness_ratio.labels(role=role).set_function(window.ratio)

    def rate_meter(self, role: str, stage: str) -> _RateMeter:
        key = (role, stage)
        with self.lock:
            meter = self.rate_meters.get(key)
            if meter is None:
                meter = _RateMeter(self.sps_window_s, self.clock, self.created_at)
                self.rate_meters[key] = meter
                self.sps.labels(role=role, stage=stage).set_function(meter.rate)
            return meter


def _default_gpu_probe() -> GpuProbe | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda  # type: ignore[return-value]


class Metrics:
    """All rlstream metrics for one process, bound to a ``role`` label.

    Args:
        role: value of the ``role`` label for this view (``colocated``, ``actor``,
            ``streams``, ``learner``, ``serve``).
        registry: registry to register into; a fresh private one by default.
        gpu: register GPU metrics. ``None`` (default) detects with
            ``torch.cuda.is_available()``; ``False`` never; ``True`` requires a GPU.
        gpu_probe: object with the ``torch.cuda`` functions read (tests pass a fake).
        clock: monotonic clock in seconds (for the sps window).
        sps_window_s: sliding window of the ``rlstream_sps`` gauge.
        freshness_window: number of recent samples behind ``rlstream_sample_freshness_ratio``.
    """

    def __init__(
        self,
        role: str = "colocated",
        *,
        registry: CollectorRegistry | None = None,
        gpu: bool | None = None,
        gpu_probe: GpuProbe | None = None,
        clock: Callable[[], float] = time.monotonic,
        sps_window_s: float = 10.0,
        freshness_window: int = 1024,
    ) -> None:
        if sps_window_s <= 0 or freshness_window <= 0:
            raise ValueError("sps_window_s and freshness_window must be positive")
        self._s = _Shared(registry or CollectorRegistry(), clock, sps_window_s, freshness_window)
        self.role = role
        self._s.init_role(role)
        self._setup_gpu(role, gpu, gpu_probe)

    def _setup_gpu(self, role: str, gpu: bool | None, probe: GpuProbe | None) -> None:
        if gpu is False:
            self._gpu_reason(role, "off")
            return
        probe = probe or _default_gpu_probe()
        available = probe is not None and bool(probe.is_available())
        if not available:
            if gpu:
                raise RuntimeError("gpu=True but no CUDA device is available")
            self._gpu_reason(role, "no_gpu")  # said explicitly, not a missing series
            return
        assert probe is not None
        collector = GpuCollector(role, probe)
        self._s.registry.register(collector)
        self._s.gpu = collector
        self._gpu_reason(role, "ok" if collector.utilization_supported else "no_nvml")

    def _gpu_reason(self, role: str, reason: str) -> None:
        self._s.gpu_available.labels(role=role, reason=reason).set(1.0 if reason == "ok" else 0.0)

    @classmethod
    def _view(cls, shared: _Shared, role: str) -> Metrics:
        view = cls.__new__(cls)
        view._s = shared
        view.role = role
        shared.init_role(role)
        return view

    def for_role(self, role: str) -> Metrics:
        """A view on the same registry whose series carry ``role=<role>``."""
        return Metrics._view(self._s, role)

    # -- introspection ---------------------------------------------------

    @property
    def registry(self) -> CollectorRegistry:
        return self._s.registry

    @property
    def gpu_enabled(self) -> bool:
        """True when GPU memory metrics are registered."""
        return self._s.gpu is not None

    @property
    def gpu_utilization_enabled(self) -> bool:
        """True when ``rlstream_gpu_utilization_ratio`` is exported (GPU + NVML)."""
        return self._s.gpu is not None and self._s.gpu.utilization_supported

    def render(self) -> bytes:
        """The registry in Prometheus text format (what ``/metrics`` serves)."""
        return generate_latest(self._s.registry)

    # -- policy latency and lag -----------------------------------------

    def observe_policy_latency(self, seconds: float) -> None:
        """Learner published a version -> this actor, already acting with an older one, used it,
        in seconds (``actor.policy_client``: an actor's first adoption is its start-up, not this).

        Negative values (clock skew between hosts) are clamped to 0.
        """
        self._s.policy_latency.labels(role=self.role).observe(max(0.0, seconds))

    def observe_policy_lag(self, versions: float, ms: float | None = None) -> None:
        """Lag of a batch: ``current_version - behaviour_version`` and, if known, its age in ms."""
        self._s.policy_lag_versions.labels(role=self.role).set(versions)
        self._s.sample_policy_lag_versions.labels(role=self.role).observe(max(0.0, versions))
        if ms is not None:
            secs = max(0.0, ms / 1000.0)
            self._s.policy_lag_seconds.labels(role=self.role).set(secs)
            self._s.sample_policy_lag_seconds.labels(role=self.role).observe(secs)

    def observe_freshness(self, fresh: int, total: int) -> None:
        """``fresh`` of ``total`` checked samples were within the staleness window."""
        if total < 0 or not 0 <= fresh <= total:
            raise ValueError(f"need 0 <= fresh <= total, got fresh={fresh} total={total}")
        if total == 0:
            return
        self._s.samples_fresh.labels(role=self.role).inc(fresh)
        self._s.samples_checked.labels(role=self.role).inc(total)
        self._s.freshness[self.role].add(fresh, total)

    # -- throughput, drops, dead letters, lag ---------------------------

    def count_samples(self, n: int, stage: str) -> None:
        """``n`` samples passed ``stage`` (e.g. ``collected``, ``prepared``, ``trained``).

        Feeds both ``rlstream_samples_total`` and the ``rlstream_sps`` window.
        """
        if n < 0:
            raise ValueError("sample count must be >= 0")
        self._s.samples.labels(role=self.role, stage=stage).inc(n)
        self._s.rate_meter(self.role, stage).add(n)

    def count_drop(self, reason: str, n: int = 1) -> None:
        """``n`` samples dropped for ``reason`` (see ``DROP_REASONS``)."""
        self._s.drops.labels(role=self.role, reason=reason).inc(n)

    def count_dead_letter(self, topic: str, reason: str, n: int = 1) -> None:
        """``n`` records from ``topic`` were dead-lettered for ``reason``."""
        self._s.dead_letters.labels(role=self.role, topic=topic, reason=reason).inc(n)

    def count_skipped(self, topic: str, reason: str, n: int = 1) -> None:
        """``n`` bad records from ``topic`` were skipped for ``reason`` (another role dead-letters them)."""
        self._s.skipped.labels(role=self.role, topic=topic, reason=reason).inc(n)

    def set_consumer_lag(self, group: str, topic: str, messages: float) -> None:
        """Consumer lag of ``group`` on ``topic``, summed over partitions, in messages."""
        self._s.consumer_lag.labels(role=self.role, group=group, topic=topic).set(messages)

    # -- learner ---------------------------------------------------------

    def set_batch_size(self, size: int) -> None:
        """The learner's minibatch size (transitions)."""
        self._s.batch_size.labels(role=self.role).set(size)

    def set_fragment_length(self, steps: int) -> None:
        """The decoupled actor's fragment length (steps per env)."""
        self._s.fragment_length.labels(role=self.role).set(steps)

    def set_replay(self, cache_samples: float, ratio: float, spi: float) -> None:
        """The learner's sample cache: transitions held, replay ratio, samples per insert."""
        self._s.replay_cache.labels(role=self.role).set(cache_samples)
        self._s.replay_ratio.labels(role=self.role).set(ratio)
        self._s.replay_spi.labels(role=self.role).set(spi)

    def observe_step_time(self, seconds: float, phase: str = "total") -> None:
        """Duration of one step (or one ``phase`` of it) in seconds."""
        self._s.step_duration.labels(role=self.role, phase=phase).observe(max(0.0, seconds))

    def count_learner_steps(self, n: int = 1) -> None:
        self._s.learner_steps.labels(role=self.role).inc(n)

    def set_policy_version(self, version: int) -> None:
        self._s.policy_version.labels(role=self.role).set(version)

    def set_circuit_breaker_state(self, state: int) -> None:
        """0 closed, 1 open, 2 half-open (``int(learner.circuit_breaker.State)``)."""
        if int(state) not in (BREAKER_CLOSED, BREAKER_OPEN, BREAKER_HALF_OPEN):
            raise ValueError(f"unknown circuit breaker state {state!r}")
        self._s.breaker_state.labels(role=self.role).set(int(state))

    def count_snapshot_failure(self, error: str) -> None:
        """A snapshot save failed with ``error`` (the error's class name)."""
        self._s.snapshot_failures.labels(role=self.role, error=error).inc()

    def count_circuit_breaker_trip(self) -> None:
        self._s.breaker_trips.labels(role=self.role).inc()

    def circuit_breaker_hook(self) -> Callable[[int, int], None]:
        """A ``(old_state, new_state)`` callback for ``CircuitBreaker(on_change=...)``.

        Counts a trip on every transition into OPEN. A role may have several breakers (the
        learner's backlog and policy-lag ones), each with its own hook: the state gauge shows
        the most restrictive of them (open, else half-open, else closed).
        """
        with self._s.lock:
            states = self._s.breaker_states.setdefault(self.role, [])
            index = len(states)
            states.append(BREAKER_CLOSED)

        def hook(old: int, new: int) -> None:
            states[index] = int(new)
            worst = next((s for s in (BREAKER_OPEN, BREAKER_HALF_OPEN) if s in states), BREAKER_CLOSED)
            self.set_circuit_breaker_state(worst)
            if int(new) == BREAKER_OPEN and int(old) != BREAKER_OPEN:
                self.count_circuit_breaker_trip()

        return hook
