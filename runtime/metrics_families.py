"""The Prometheus families rlstream declares (``_Shared``: one set per registry, shared by every
role's ``Metrics`` view), their buckets, the ``reason`` values of the drops, every family's name
(``METRIC_NAMES``), and the window state behind two scrape-time gauges (samples per second,
freshness)."""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from runtime.metrics_gpu import GpuCollector

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
    "rlstream_learner_fenced",
    "rlstream_snapshot_failures_total",
    "rlstream_produce_errors_total",
    "rlstream_actor_backoffs_total",
    "rlstream_actor_backoff_seconds_total",
    "rlstream_unacknowledged_batches",
    "rlstream_gpu_available",
    *_GPU_NAMES,
)


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
        self.learner_fenced = Gauge(
            "learner_fenced",
            "1 once a newer learner of this run and rank has fenced this one: it writes nothing more, and "
            "with --learner.on-fenced wait it stays up, not ready, until SIGTERM; 0 while it may write.",
            R, namespace=NAMESPACE, registry=r,
        )
        self.snapshot_failures = Counter(
            "snapshot_failures",
            "Learner snapshot saves that failed (store down, disk full, timeout), by the error's class; "
            "training went on and the save is retried.",
            R + ["error"], namespace=NAMESPACE, registry=r,
        )
        self.produce_errors = Counter(
            "produce_errors",
            "Produce requests the broker answered with an error, by its code (NOT_ENOUGH_REPLICAS below "
            "min.insync.replicas, REQUEST_TIMED_OUT, NOT_LEADER_FOR_PARTITION, ...); the producer retries "
            "them until they are delivered or time out.",
            R + ["code"], namespace=NAMESPACE, registry=r,
        )
        self.actor_backoffs = Counter(
            "actor_backoffs",
            "Rounds whose flush outlasted 1 s: the actor waited for the broker to acknowledge its batches "
            "(a broker down, below min.insync.replicas) and took no step meanwhile.",
            R, namespace=NAMESPACE, registry=r,
        )
        self.actor_backoff_seconds = Counter(
            "actor_backoff_seconds",
            "Seconds of those waits (rlstream_actor_backoffs_total).",
            R, namespace=NAMESPACE, registry=r,
        )
        self.unacknowledged = Gauge(
            "unacknowledged_batches",
            "Batches the actor published that the broker has not acknowledged yet (at most one round's: "
            "the actor waits for them before its next step).",
            R, namespace=NAMESPACE, registry=r,
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
