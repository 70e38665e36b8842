"""``Prepare``: raw SampleBatch -> reorder -> staleness -> importance -> PreparedBatch | Rejection.

The one implementation of the stream logic; two shells drive it (``streams.worker`` in-process
over the bus, ``streams.faust_app`` on Kafka). Pure: no I/O, injectable clock::

    prepare = Prepare.from_config(PrepareConfig.for_algo("ppo"), logp_factory)  # rlstream.wiring.build_prepare:
                                                  # PolicyLogpFn.factory(blob_store)
    prepare.on_policy(pv)                                # every PolicyVersion
    for out in prepare.push(batch, partition, offset):   # PreparedBatch or Rejection, 0..n
        ...
    for out in prepare.tick():                           # periodically: reorder timeouts
        ...

Every pushed batch leaves exactly once, as a ``PreparedBatch`` or a ``Rejection`` (reason
``duplicate``, ``late``, ``seq_conflict``, ``stale_versions``, ``stale_ms``,
``importance_unavailable`` or ``processor_error``). Rejections are dead-lettered by the shells,
except ``duplicate`` (an idempotent drop: the first copy went through; counted only).
All counters live in ``Prepare.stats`` (``ProcessorStats``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from config.prepare import PrepareConfig
from schemas.events import PolicyVersion, PreparedBatch, SampleBatch, now_ms
from streams.processors.importance import ImportanceResult, ImportanceWeights, LogpFactory, LogpFn
from streams.processors.reorder import ReorderBuffer, ReorderResult, ReorderStats
from streams.processors.staleness import StalenessStats, StalenessWindow

REASON_PROCESSOR_ERROR = "processor_error"
REASON_IMPORTANCE_UNAVAILABLE = "importance_unavailable"

#: Rejections that are counted but not dead-lettered.
SILENT_REASONS = frozenset({"duplicate"})


# --- outputs and counters -------------------------------------------------------------------

@dataclass(frozen=True)
class Rejection:
    """A batch (or record) the pipeline did not prepare, and why."""

    reason: str
    error: BaseException | None
    batch: SampleBatch | None
    partition: int = -1
    offset: int = -1
    detail: str = ""

    @property
    def dead_letter(self) -> bool:
        return self.reason not in SILENT_REASONS

    @property
    def error_class(self) -> str:
        return type(self.error).__name__ if self.error is not None else self.reason


Output = PreparedBatch | Rejection


@dataclass
class ProcessorStats:
    """Every counter of the pipeline (batches unless named ``*_samples``)."""

    received_batches: int = 0
    received_samples: int = 0
    emitted_batches: int = 0
    emitted_samples: int = 0
    drops: dict[str, int] = field(default_factory=dict)
    dropped_samples: dict[str, int] = field(default_factory=dict)
    downweighted_batches: int = 0
    is_computed_batches: int = 0
    is_onpolicy_batches: int = 0
    is_capped_samples: int = 0
    is_nonfinite_samples: int = 0
    policy_versions: int = 0
    policy_ignored: int = 0
    policy_errors: int = 0
    last_policy_error: str = ""
    latest_version: int | None = None
    is_version: int | None = None  # version of the policy the IS weights use
    reorder: ReorderStats = field(default_factory=ReorderStats)
    staleness: StalenessStats = field(default_factory=StalenessStats)

    @property
    def freshness(self) -> float:
        return self.staleness.freshness

    @property
    def dropped_batches(self) -> int:
        return sum(self.drops.values())

    def as_dict(self) -> dict[str, Any]:
        r, s = self.reorder, self.staleness
        return {
            "received_batches": self.received_batches, "received_samples": self.received_samples,
            "emitted_batches": self.emitted_batches, "emitted_samples": self.emitted_samples,
            "drops": dict(self.drops), "dropped_samples": dict(self.dropped_samples),
            "downweighted_batches": self.downweighted_batches,
            "is_computed_batches": self.is_computed_batches, "is_onpolicy_batches": self.is_onpolicy_batches,
            "is_capped_samples": self.is_capped_samples, "is_nonfinite_samples": self.is_nonfinite_samples,
            "policy_versions": self.policy_versions, "policy_ignored": self.policy_ignored,
            "policy_errors": self.policy_errors, "latest_version": self.latest_version,
            "is_version": self.is_version, "freshness": self.freshness,
            "fresh_samples": s.fresh_samples, "checked_samples": s.checked_samples,
            "lag_versions": s.lag_versions.as_dict(), "lag_ms": s.lag_ms.as_dict(),
            "reorder": {"buffered": r.buffered, "max_buffered_seen": r.max_buffered_seen,
                        "reordered": r.reordered, "timeouts": r.timeouts, "overflows": r.overflows,
                        "skipped_seqs": r.skipped_seqs, "restarts": r.restarts,
                        "actors_evicted": r.actors_evicted},
        }


class MetricsSink(Protocol):
    """What the pipeline reports to (``runtime.metrics.Metrics`` satisfies it)."""

    def count_samples(self, n: int, stage: str) -> None: ...
    def count_drop(self, reason: str, n: int = 1) -> None: ...
    def observe_policy_lag(self, versions: float, ms: float | None = None) -> None: ...
    def observe_freshness(self, fresh: int, total: int) -> None: ...
    def set_policy_version(self, version: int) -> None: ...


# --- the pipeline ---------------------------------------------------------------------------

class Prepare:
    """reorder -> staleness -> importance. See the module docstring.

    Args:
        reorder, staleness: the stages.
        importance: IS weights (None: weights are 1; the learner corrects off-policyness itself).
        logp_factory: builds the current policy's ``LogpFn`` from a PolicyVersion; called
            lazily, once per version that a batch needs.
        clock: ms clock for ``prepared_at_ms`` and the stages' timing.
        metrics: optional ``MetricsSink``.
        policy_id: only follow PolicyVersions of this policy.
    """

    def __init__(
        self,
        reorder: ReorderBuffer,
        staleness: StalenessWindow,
        importance: ImportanceWeights | None = None,
        logp_factory: LogpFactory | None = None,
        *,
        clock: Callable[[], int] = now_ms,
        metrics: MetricsSink | None = None,
        policy_id: str | None = None,
    ) -> None:
        self.reorder = reorder
        self.staleness = staleness
        self.importance = importance
        self.logp_factory = logp_factory
        self.clock = clock
        self.metrics = metrics
        self.policy_id = policy_id
        self.stats = ProcessorStats(reorder=reorder.stats, staleness=staleness.stats)
        self._latest_pv: PolicyVersion | None = None
        self._recent_pvs: dict[int, PolicyVersion] = {}  # the newest few versions, to fall back on
        self._fn: tuple[int, LogpFn] | None = None  # (version, logp fn) last built successfully
        self._failed: set[int] = set()  # versions whose policy could not be built
        self._policy_failures: list[tuple[int, BaseException]] = []  # for the shell to dead-letter

    @classmethod
    def from_config(cls, cfg: PrepareConfig, logp_factory: LogpFactory | None = None, *,
                    clock: Callable[[], int] = now_ms, metrics: MetricsSink | None = None,
                    actor_state: MutableMapping[str, dict] | None = None) -> "Prepare":
        """``actor_state``: where the reorder buffer keeps each actor's durable state (the shell's
        mapping; default a dict)."""
        reorder = ReorderBuffer(cfg.reorder_window, cfg.reorder_timeout_ms, cfg.dedup_capacity,
                                cfg.dedup_ttl_ms, cfg.max_actors, clock=clock, state=actor_state)
        staleness = StalenessWindow(cfg.max_versions, cfg.max_ms, cfg.staleness_mode, cfg.decay,
                                    cfg.min_weight, cfg.age_from, clock=clock)
        importance = ImportanceWeights(cfg.rho_bar, cfg.c_bar, cfg.behaviour_cap) if cfg.importance else None
        return cls(reorder, staleness, importance, logp_factory if cfg.importance else None,
                   clock=clock, metrics=metrics, policy_id=cfg.policy_id)

    # -- policy stream ----------------------------------------------------------------------
    def on_policy(self, pv: PolicyVersion) -> bool:
        """Follow a PolicyVersion; True if it is the newest seen. Weights are decoded lazily."""
        if self.policy_id is not None and pv.policy_id != self.policy_id:
            self.stats.policy_ignored += 1
            return False
        self.stats.policy_versions += 1
        newest = self.staleness.on_policy(pv)
        if newest:
            self._latest_pv = pv
            self._recent_pvs[pv.version] = pv
            while len(self._recent_pvs) > 8:
                del self._recent_pvs[min(self._recent_pvs)]
            self.stats.latest_version = pv.version
            self._metric("set_policy_version", pv.version)
        return newest

    def take_policy_failures(self) -> list[tuple[int, BaseException]]:
        """Versions whose policy could not be built since the last call (the shell dead-letters
        their records; the pipeline goes on with the last good policy)."""
        out, self._policy_failures = self._policy_failures, []
        return out

    def _current_fn(self) -> tuple[int, LogpFn] | None:
        """(version, logp fn) of the newest policy that could be built."""
        if self.logp_factory is None:
            return self._fn
        # newest first; a version that does not build falls back to the next newest one
        for version in sorted(self._recent_pvs, reverse=True):
            if self._fn is not None and self._fn[0] >= version:
                break
            if version in self._failed:
                continue
            pv = self._recent_pvs[version]
            try:
                self._fn = (pv.version, self.logp_factory(pv))
                self.stats.is_version = pv.version
                break
            except Exception as e:  # a bad PolicyVersion must not stop the stream
                self._failed.add(pv.version)
                self._policy_failures.append((pv.version, e))
                self.stats.policy_errors += 1
                self.stats.last_policy_error = f"version {pv.version}: {type(e).__name__}: {e}"[:500]
        if len(self._failed) > 64:
            self._failed = {v for v in self._failed if v in self._recent_pvs}
        return self._fn

    # -- samples ----------------------------------------------------------------------------
    def push(self, batch: SampleBatch, partition: int = -1, offset: int = -1) -> list[Output]:
        self.stats.received_batches += 1
        self.stats.received_samples += batch.size
        self._metric("count_samples", batch.size, "received")
        return self._finish(self.reorder.push(batch, (partition, offset)))

    def tick(self, now: int | None = None) -> list[Output]:
        """Release batches whose reorder gap timed out."""
        return self._finish(self.reorder.expire(now))

    def drain(self) -> list[Output]:
        """Release everything the reorder buffer holds (co-located shutdown)."""
        return self._finish(self.reorder.drain())

    def held(self) -> list[tuple[int, int]]:
        """(partition, offset) of every batch still buffered."""
        return [t for _, t in self.reorder.held()]

    def revoke(self, partitions: Iterable[int]) -> int:
        """Forget state of actors on ``partitions`` (a rebalance moved them); their buffered
        batches are dropped without output -- uncommitted, they are redelivered to the new owner."""
        ps = set(partitions)
        return len(self.reorder.forget_where(lambda t: t is not None and t[0] in ps))

    def reject_record(self, reason: str, error: BaseException | None, partition: int = -1, offset: int = -1,
                      detail: str = "") -> Rejection:
        """Count a record the shell could not hand to ``push`` (it dead-letters it)."""
        self._count_drop(reason, 0)
        return Rejection(reason, error, None, partition, offset, detail)

    # -- internals --------------------------------------------------------------------------
    def _metric(self, name: str, *args: Any) -> None:
        if self.metrics is not None:
            try:
                getattr(self.metrics, name)(*args)
            except Exception:  # metrics must never break the stream
                pass

    def _count_drop(self, reason: str, samples: int) -> None:
        s = self.stats
        s.drops[reason] = s.drops.get(reason, 0) + 1
        s.dropped_samples[reason] = s.dropped_samples.get(reason, 0) + samples
        if samples:
            self._metric("count_drop", reason, samples)

    def _reject(self, reason: str, error: BaseException | None, batch: SampleBatch, tag: Any,
                detail: str = "") -> Rejection:
        self._count_drop(reason, batch.size)
        p, o = tag if tag is not None else (-1, -1)
        return Rejection(reason, error, batch, p, o, detail)

    def _finish(self, res: ReorderResult) -> list[Output]:
        out: list[Output] = [self._reject(r.reason, None, r.batch, r.tag, r.detail) for r in res.rejected]
        if res.released:
            now = self.clock()
            for batch, tag in res.released:
                try:
                    out.append(self._prepare(batch, tag, now))
                except Exception as e:  # every released batch leaves, even past a bug
                    out.append(self._reject(REASON_PROCESSOR_ERROR, e, batch, tag,
                                            f"{type(e).__name__}: {e}"[:2000]))
        return out

    def _prepare(self, batch: SampleBatch, tag: Any, now: int) -> Output:
        try:
            d = self.staleness.assess(batch, now)
            n = batch.size
            self._metric("observe_policy_lag", d.versions, d.ms)
            self._metric("observe_freshness", n if d.fresh else 0, n)
            if d.error is not None:
                return self._reject(d.error.reason, d.error, batch, tag)
            current = d.current_version
            if self.importance is None or self.logp_factory is None or batch.policy_version >= current:
                w = ImportanceWeights.ones(batch.rewards.shape)
            else:
                fn = self._current_fn()
                if fn is None:
                    return self._reject(REASON_IMPORTANCE_UNAVAILABLE, None, batch, tag,
                                        f"no usable policy to weight against; {self.stats.last_policy_error}")
                current = fn[0]
                w = self.importance.compute(batch, fn[1], current)
            self._count_is(w)
            p, o = tag if tag is not None else (-1, -1)
            pb = PreparedBatch(
                sample=batch, current_version=max(current, batch.policy_version),
                staleness_versions=d.versions, staleness_ms=d.ms, is_rho=w.rho, is_c=w.c,
                prepared_at_ms=int(now), sample_weight=float(d.weight), source_partition=int(p),
                source_offset=int(o),
            )
        except Exception as e:  # one bad batch must not take the others down
            return self._reject(REASON_PROCESSOR_ERROR, e, batch, tag, f"{type(e).__name__}: {e}"[:2000])
        s = self.stats
        s.emitted_batches += 1
        s.emitted_samples += n
        if d.action == "downweight":
            s.downweighted_batches += 1
        self._metric("count_samples", n, "prepared")
        return pb

    def _count_is(self, w: ImportanceResult) -> None:
        s = self.stats
        if w.computed:
            s.is_computed_batches += 1
            s.is_capped_samples += w.capped
            s.is_nonfinite_samples += w.nonfinite
            if w.capped:
                self._metric("count_drop", "is_capped", w.capped)
            if w.nonfinite:
                self._metric("count_drop", "is_nonfinite", w.nonfinite)
        else:
            s.is_onpolicy_batches += 1
