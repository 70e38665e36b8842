"""Every Prometheus metric rlstream exports, in one place.

A ``Metrics`` object owns its ``CollectorRegistry`` (never the global one), so
tests and several in-process roles do not collide. Every series carries a
``role`` label. A process creates one ``Metrics`` and hands it to the roles it
runs (``rlstream.wiring``): ``role="colocated"`` for a co-located run, the
process's role (``actor``, ``learner``, ``streams``) for each decoupled one::

    metrics = Metrics(role="learner")            # one registry per process
    server = MetricsServer(metrics.registry, health, port=9100).start()

    metrics.observe_policy_latency(0.004)        # learner publish -> actor use
    metrics.count_learner_steps()
    metrics.set_batch_size(128)                  # the learner's minibatch

(``for_role`` gives a view of the same registry under another role label.)

Components never touch prometheus objects; they call the helper methods
below (or receive a callable such as ``circuit_breaker_hook()``). The families themselves are
declared in ``runtime.metrics_families`` (with the bucket, reason and name lists), the GPU
gauges, read at scrape time, in ``runtime.metrics_gpu``.

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
rlstream_learner_fenced                    gauge
rlstream_snapshot_failures_total           counter    error
rlstream_produce_errors_total              counter    code
rlstream_actor_backoffs_total              counter
rlstream_actor_backoff_seconds_total       counter
rlstream_unacknowledged_batches            gauge
rlstream_gpu_available                     gauge      reason   (always: 1 ok; 0 no_gpu, no_nvml, off)
rlstream_gpu_utilization_ratio             gauge      device   (GPU + pynvml only)
rlstream_gpu_memory_allocated_bytes        gauge      device   (GPU only)
rlstream_gpu_memory_reserved_bytes         gauge      device   (GPU only)
rlstream_gpu_memory_total_bytes            gauge      device   (GPU only)
=========================================  =========  ======================

``rlstream_batch_size`` is the learner's minibatch (transitions); the decoupled actor's
fragment length (steps per env) is ``rlstream_fragment_length``. The three ``replay`` gauges
describe the learner node's sample cache (``--replay.enabled``).

Policy lag in time is exported in seconds (Prometheus base unit), although
the helper takes milliseconds, the unit the events carry (``created_at_ms``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from runtime.metrics_families import BREAKER_CLOSED, BREAKER_HALF_OPEN, BREAKER_OPEN, _Shared
from runtime.metrics_gpu import GpuCollector, GpuProbe, _default_gpu_probe


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

    def set_learner_fenced(self, fenced: bool) -> None:
        """1 once a newer learner of this one's run and rank has fenced it (``WriterFencedError``)."""
        self._s.learner_fenced.labels(role=self.role).set(1 if fenced else 0)

    def count_snapshot_failure(self, error: str) -> None:
        """A snapshot save failed with ``error`` (the error's class name)."""
        self._s.snapshot_failures.labels(role=self.role, error=error).inc()

    def count_produce_error(self, code: str) -> None:
        """The broker answered a produce request with error ``code`` (its name: NOT_ENOUGH_REPLICAS)."""
        self._s.produce_errors.labels(role=self.role, code=code).inc()

    def observe_backoff(self, seconds: float) -> None:
        """The actor waited ``seconds`` for its batches to be acknowledged before its next step."""
        self._s.actor_backoffs.labels(role=self.role).inc()
        self._s.actor_backoff_seconds.labels(role=self.role).inc(max(0.0, seconds))

    def watch_unacknowledged(self, count: Callable[[], float]) -> None:
        """``rlstream_unacknowledged_batches`` reads ``count()`` at scrape time."""
        self._s.unacknowledged.labels(role=self.role).set_function(count)

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
