"""The learner's process shell: consumes PreparedBatch events, feeds the pure learner
(``learner.core.LearnerCore``: fragments in, a GradientStep and weights out), commits, publishes
GradientStep and PolicyVersion events, snapshots, resumes and rolls back, and pauses on its
circuit breaker.

    learner = Learner(config, algo, events, snapshots=store)
    learner.start()                 # resume from the newest snapshot, or publish version 0
    while not stop.is_set():
        learner.step(timeout=0.1)   # poll; once train_batch_size transitions are in, one update on all of them

Snapshots follow ``learner.snapshots.schedule.SnapshotSchedule``: every ``snapshot_every`` updates, and
a time-based one (daily by default, ``snapshot_interval_s``, on the injected ``clock``) that the
store keeps by its own retention (``keep_timed``). A save that fails (store down or hung, disk full)
never stops training: it is counted (``snapshot_failures``, ``on_snapshot_failure``: the metric),
logged at most once per ``SNAPSHOT_RETRY_S`` and retried that much later. ``start(resume=True)``
resumes from the newest intact snapshot, naming any newer one it skips (``ResumeError`` if none
is intact, or if retention deleted input the snapshot resumes at).

Versions are immutable and monotonic: a resumed or rolled-back learner publishes a NEW version
(number = 1 + the newest published or restored, whichever is newer) whose parent is the snapshot
it restored.

Exactly-once training across restarts: every snapshot stores the input offsets its state has
consumed and the ids of the batches it trained on; a resumed learner seeks to those offsets,
so batches after the snapshot are re-delivered and trained once, and a batch_id seen twice
(an actor's retry) is skipped and counted. What is committed and snapshotted comes from the
consumer's offset ledger (``streams.offsets.OffsetLedger``): every record polled, and a record
buffered for the next update held, so no commit passes it.

Nothing it consumes can stop it: an undecodable or invalid record, a duplicate, and a batch
whose observation/action sizes the model does not have (reason ``incompatible``) are
dead-lettered; a lag signal that cannot be read (broker down) leaves the breaker as it is.

Two circuit breakers may hold training back: ``breaker`` over an outside ``lag_signal`` (the
stream processors' backlog), which stops polling too, and ``policy_breaker`` over the policy
lag the learner sees itself (``policy_lag``: its version minus the newest behaviour version (a step's, in a mixed fragment) of
the last records it read). While the policy-lag breaker is open the learner keeps reading (so
it sees the lag fall as actors adopt the version it holds still) but does not update, until
``hold_cap`` transitions wait: a full buffer trains anyway (``policy_lag_overrides``), so a
learner can never wait for data it will not read.

Data-parallel ranks (``learner.distributed.DataParallel``) and a learner alone
(``learner.ranks.SingleRank``) are one interface (``learner.ranks.Ranks``), passed as ``parallel``.

Two optional parts (both off by default): ``replay``, the node's sample cache
(``learner.replay``, off-policy algorithms), and ``batch_control``, the dynamic minibatch size
(``learner.minibatch.MinibatchController``), fed after each update with the update's seconds,
the seconds since the previous update ended, and ``gpu_util()`` (percent; None: no GPU).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from agents.core import Algorithm
from learner.batching import StreamIds
from learner.core import Fragment, LearnerConfig, LearnerCore  # noqa: F401  (LearnerConfig: the learner's public name)
from learner.provenance import record_digest, stamp
from learner.snapshots.format import ResumeError, SnapshotCorruptError, SnapshotError, SnapshotNotFoundError
from learner.snapshots.schedule import SnapshotSchedule, newest_timed_ms
from learner.ranks import Ranks
from schemas.errors import CodecError
from schemas.events import PreparedBatch, now_ms
from streams.bus.base import BusError, WriterFencedError
from streams.events import EventBus
from streams.policies import (
    BlobStore,
    PolicyFollower,
    StartRule,
    arch_of,
    load_policy,
    make_policy_version,
    newest_version,
    publish_policy_version,
)
from streams.topics import LEARNER_STEPS, POLICY_VERSIONS, SAMPLES_PREPARED

log = logging.getLogger(__name__)
#: A failed snapshot save is tried again at the first update this many seconds after it (or at the
#: next scheduled one, if sooner); its failures are logged at most once per this interval.
SNAPSHOT_RETRY_S = 30.0


class Learner:
    """See the module docstring. ``parallel``: the ranks (``learner.ranks.Ranks``); None: alone."""

    def __init__(self, config: LearnerConfig, algo: Algorithm, events: EventBus, snapshots: Any = None,
                 breaker: Any = None, lag_signal: Callable[[], float] | None = None,
                 on_update: Callable[["Learner", dict[str, float], float], None] | None = None,
                 blob_store: BlobStore | None = None, stream_ids: StreamIds | None = None,
                 parallel: Ranks | None = None, policy_breaker: Any = None, hold_cap: int | None = None,
                 clock: Callable[[], float] = time.time,
                 replay: Any = None, batch_control: Any = None,
                 gpu_util: Callable[[], float | None] | None = None,
                 on_snapshot_failure: Callable[[str], None] | None = None) -> None:
        self.core = LearnerCore(config, algo, parallel, stream_ids, replay=replay)
        self.batch_control = batch_control
        self.gpu_util = gpu_util
        self._last_update_end: float | None = None
        if batch_control is not None:
            algo.minibatch_size = batch_control.size
        self.config = config
        self.algo = algo
        self.ranks = self.core.ranks
        self.events = events
        self.snapshots = snapshots
        self.breaker = breaker
        self.lag_signal = lag_signal
        self.policy_breaker = policy_breaker
        self.hold_cap = hold_cap if hold_cap is not None else 4 * config.train_batch_size
        self.on_update = on_update
        self.blob_store = blob_store
        self._offsets: dict[tuple[str, int], int] = {}  # committed last (and snapshotted)
        self._snapshot_due = False  # an update due for a snapshot has not been snapshotted yet
        self._snapshot_timed = False  # ... and it is a time-based one
        self.consumer = None
        self._versions = None
        self.clock = clock  # wall seconds: the time-based snapshot schedule's
        self.on_snapshot_failure = on_snapshot_failure  # (error class name) -> a metric
        self.snapshot_failures = 0  # saves that failed (store down, disk full, timeout)
        self._snapshot_retry_at: float | None = None  # a failed save is due again from then
        self._snapshot_failure_logged = -SNAPSHOT_RETRY_S  # monotonic time of the last failure line
        self._snapshot_failures_unlogged = 0
        self.schedule: SnapshotSchedule | None = None
        self.fenced = False  # a newer learner of this identity took over (``WriterFencedError``)
        self._dead_letters_flushed = 0  # dead letters written and flushed (``_flush_dead_letters``)

    stats = property(lambda self: self.core.stats)
    version = property(lambda self: self.core.version, lambda self, v: setattr(self.core, "version", v))
    model_version = property(lambda self: self.core.model_version,
                             lambda self, v: setattr(self.core, "model_version", v))

    # -- lifecycle ----------------------------------------------------------------------------
    def latest_published(self) -> int:
        """Newest version of this policy on the topic (-1 if none), whatever else shares it."""
        newest = newest_version(self.events, self.config.policy_id)
        return -1 if newest is None else newest.version

    def start(self, resume: bool = True, from_version: int | None = None, publish: bool = True) -> None:
        """Restore state (newest snapshot, or ``from_version``) and publish the current policy
        (``publish=False``: it is already the newest version on the topic, as in a fork)."""
        published = self.ranks.broadcast(self.latest_published())
        restored = None
        if self.snapshots is not None and (resume or from_version is not None):
            restored = self._restore(from_version)
            if restored is None and resume:  # no snapshot: the model is the initial one, and so is its data
                restored = {(SAMPLES_PREPARED, p): 0 for p in self.events.bus.end_offsets(SAMPLES_PREPARED)}
        start: Any = "earliest"
        if restored is not None:
            start = restored
        self.consumer = self.events.consumer(self.config.group, [SAMPLES_PREPARED], stage="learner",
                                             expect=PreparedBatch, start=start)
        self.ranks.settle(self.consumer, SAMPLES_PREPARED,
                          lambda: len(self.events.bus.end_offsets(SAMPLES_PREPARED)), restored)
        if published < self.model_version:  # diagnostic: CI once read 4 here on a topic holding 0..32
            log.warning("the newest published version of %s reads %d, older than the restored snapshot's %d "
                        "(policy topic ends %s); numbering on from %d", self.config.policy_id, published,
                        self.model_version, self.events.bus.end_offsets(POLICY_VERSIONS), self.model_version)
        # a version number once allocated is never reused: a snapshot's version may be newer than
        # the topic's newest (taken while its publish could not reach the broker, then lost)
        self.version = max(published, self.model_version)
        if self.snapshots is not None:
            newest = newest_timed_ms(self.snapshots) if self.config.snapshot_interval_s else None
            self.schedule = SnapshotSchedule(self.config.snapshot_every, self.config.snapshot_interval_s, self.clock,
                                             None if newest is None else newest / 1000)
        if publish:
            try:
                self._publish(parent=self.model_version if self.model_version >= 0 else None)
            except WriterFencedError:
                self.fenced = True
                raise
        # from the newest version of this policy (its own, just published): every later one,
        # in log order, older ones too (a bad one is dead-lettered whether adopted or not)
        self._versions = PolicyFollower(self.events, self.config.policy_id, StartRule.newest(),
                                        blobs=self.blob_store, stage="learner", monotonic=False)

    def _restore(self, version: int | None) -> dict | None:
        """Restore ``version``, or (None) the newest intact snapshot: a corrupt, truncated or
        state-less newer one is skipped with a warning naming it; none intact is ``ResumeError``.

        A snapshot whose input offsets retention has already deleted (below the log start of
        rl.samples.prepared) is refused with ``ResumeError``: resuming would skip those batches
        untrained, so it is a decision for the operator, not made silently."""
        if version is not None:
            _, meta = self.snapshots.load(version)
            state = self.snapshots.load_state(version)
            if state is None:
                raise ResumeError(f"snapshot {version} has no learner state; cannot resume from it")
        else:
            found = self._newest_intact()
            if found is None:
                return None
            version, meta, state = found
        offsets = {(t, int(p)): int(o) for t, p, o in meta.get("offsets", [])}
        self._check_offsets_held(version, offsets)
        self.core.restore(version, state, meta)
        return offsets or None

    def _newest_intact(self) -> tuple[int, dict, Any] | None:
        """``(version, meta, state)`` of the newest snapshot that verifies; None if there is none."""
        versions = self.snapshots.versions()
        if not versions:
            return None
        bad: list[str] = []
        for v in reversed(versions):
            try:
                _, meta = self.snapshots.load(v)
                state = self.snapshots.load_state(v)
                if state is None:
                    raise SnapshotCorruptError(f"v{v}: no learner state")
            except (SnapshotCorruptError, SnapshotNotFoundError) as e:
                bad.append(f"v{v} ({e})" if not isinstance(e, SnapshotNotFoundError) else f"v{v} (gone)")
                continue
            if bad:
                log.warning("resume: skipped unusable snapshot(s) %s in %s; resuming from v%d, the newest intact one",
                            ", ".join(bad), self.snapshots.url, v)
            return v, meta, state
        raise ResumeError(f"no intact snapshot to resume from in {self.snapshots.url}: {', '.join(bad)}; "
                          "remove them, or start without --resume")

    def _check_offsets_held(self, version: int, offsets: dict[tuple[str, int], int]) -> None:
        bus = self.events.bus
        for (topic, p), off in sorted(offsets.items()):
            try:
                start = bus.log_start(topic, p)
            except (BusError, IndexError):
                continue  # unknown here: the consumer starts where the log does
            if off < start:
                raise ResumeError(
                    f"snapshot v{version} resumes {topic}[{p}] at offset {off}, but retention has deleted the log "
                    f"up to {start}: batches {off}..{start - 1} would be skipped untrained; resume from a "
                    "snapshot newer than the deletion (--from-version), or start a new run")

    # -- the loop -----------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.config.max_updates is not None and self.stats.updates >= self.config.max_updates

    def _follow_foreign_versions(self) -> None:
        """A version of our policy published by someone else (``rlstream rollback``) that is newer
        than ours becomes the learner's model: versions stay monotonic with one writer at a time.

        The learner owns rl.policy.versions' dead letters (``streams.topics.DEAD_LETTER_OWNERS``):
        it dead-letters every record it cannot decode and every foreign version of its policy
        whose weights do not load, adopted or not; the other readers skip them and count them."""
        for u in self._versions.poll(0.0):
            pv = u.event
            if pv.learner_id == self.config.learner_id:
                continue
            try:
                policy = load_policy(pv, self.blob_store)
            except CodecError as e:
                self._versions.dead_letter(u, e)
                continue
            if pv.version <= self.version:
                continue
            state = None
            if self.snapshots is not None and pv.parent_version is not None and \
                    pv.parent_version in self.snapshots.versions():
                state = self.snapshots.load_state(pv.parent_version)  # weights, optimiser and normalisers
            dropped = self.core.adopt(pv.version, state, None if state is not None else policy.state_dict())
            self._drop(dropped)  # collected under the abandoned line of versions

    def _paused(self, timeout: float) -> bool:
        """The circuit breaker holds polling back (the backlog downstream is too long)."""
        if self.breaker is None or self.lag_signal is None:
            return False
        try:
            self.breaker.update(self.lag_signal())
        except BusError:  # broker unreachable: the lag is unknown, the breaker stays as it is
            self.stats.lag_signal_errors += 1
        if self.breaker.allow():
            return False
        self.stats.paused_polls += 1
        time.sleep(min(timeout, 0.05))
        return True

    def step(self, timeout: float = 0.1) -> dict[str, float] | None:
        """Poll, and train once enough is buffered (the update's metrics, else None). Raises
        ``WriterFencedError`` once a newer learner of this identity took over; ``fenced`` is
        set then, and from then on this learner writes nothing, not even a snapshot."""
        try:
            return self._step(timeout)
        except WriterFencedError:
            self.fenced = True
            raise

    def _step(self, timeout: float) -> dict[str, float] | None:
        if self._snapshot_due:
            self.snapshot()
        if self._versions is not None and self.ranks.follows_foreign_versions:
            self._follow_foreign_versions()
        paused = self._paused(timeout)
        held = False
        if self.policy_breaker is not None and not paused:  # paused: nothing read, the lag is as it was
            self.policy_breaker.update(self.stats.policy_lag)
            held = not self.policy_breaker.allow()
        newest = None  # newest behaviour version read in this poll
        for rec, pb in [] if paused else self.consumer.poll(timeout, max_records=64):
            newest = pb.sample.newest_version if newest is None else max(newest, pb.sample.newest_version)
            self._take(rec, pb)
        if newest is not None:
            self.stats.policy_lag = max(0, self.version - newest)
        hold = held and self.core.buffered < self.hold_cap
        if hold and self.core.buffered >= max(1, self.core.need()):
            self.stats.policy_lag_holds += 1  # (this rank's buffer alone) was ready
        ready = self.core.ready(paused or hold)  # with ranks: every rank decides together, each with its share
        if ready and held:
            self.stats.policy_lag_overrides += 1
        if ready:
            return self._train()
        self._flush_dead_letters()
        self._commit_handled()
        return None

    def _flush_dead_letters(self) -> None:
        """Flush the dead letters written since the last flush before the offsets past them are
        committed; on Kafka they are a transaction, which must not stay open while the learner
        waits (past ``transaction.timeout.ms`` the broker aborts it and fences the writer)."""
        n = self._dead_letters_written()
        if n != self._dead_letters_flushed:
            self.events.flush()
            self._dead_letters_flushed = n

    def _dead_letters_written(self) -> int:
        return sum(self.events.dead_letters.counts.values())

    def _take(self, rec: Any, pb: PreparedBatch) -> None:
        """Buffer one polled record for the next update (held in the consumer's ledger), or skip
        or dead-letter it."""
        tp = (rec.topic, rec.partition)
        if self.core.trained(pb.sample.batch_id) and rec.offset < self._offsets.get(tp, 0):
            self.stats.redelivered_skipped += 1  # this very record, trained before the rewind
            return
        refused = self.core.refuse(pb)
        if refused is not None:  # a duplicate; another env's batch: training on it would raise (a poison pill)
            reason, error, detail = refused
            if reason == "duplicate":
                self.stats.duplicates_skipped += 1
            self.consumer.dead_letter(rec, reason, error, detail)
            return
        self.consumer.ledger.hold(tp, rec.offset)
        self.core.add(Fragment(pb, record_digest(rec.value), rec))

    def _commit_handled(self) -> None:
        """Commit past records handled without an update (dead-lettered), so that the group's
        offset reaches the log end when the last records were bad ones."""
        safe = self.consumer.ledger.offsets()
        if safe != self._offsets:
            self._offsets = safe
            self.consumer.commit(offsets=safe)

    def _drop(self, fragments: list[Fragment]) -> None:
        """Buffered fragments collected under an abandoned line of versions (a rollback): they
        are dead-lettered (reason ``rolled_back``), not trained, not lost."""
        for f in fragments:
            self._release(f)
            self.consumer.dead_letter(f.source, "rolled_back", "RolledBack",
                                      f"batch {f.batch.sample.batch_id} predates the rollback to version {self.version}")

    def _release(self, f: Fragment) -> None:
        self.consumer.ledger.release((f.source.topic, f.source.partition), f.source.offset)

    @property
    def buffered(self) -> int:
        """Transitions waiting for the next update (fewer than ``train_batch_size``)."""
        return self.core.buffered

    def _train(self) -> dict[str, float]:
        """One update of the core on every buffered fragment, then publish and commit; a snapshot
        it is due for is taken at the next step."""
        started = now_ms()
        t0 = time.perf_counter()
        upd = self.core.update(started)
        self._control_batch(t0, time.perf_counter() - t0)
        for f in upd.fragments:
            self._release(f)
        self._offsets = self.consumer.ledger.offsets()
        t_pub = time.perf_counter()
        # the version and its step: one flush (on Kafka one transaction, both or neither); fenced
        # (a newer learner of this identity runs): ``step`` marks it, and nothing more of ours is written
        self._publish_version(upd.to_version, parent=upd.from_version, metrics=upd.metrics, flush=False)
        if self.ranks.publisher:
            self.events.publish(LEARNER_STEPS, upd.step(now_ms()), key=self.config.learner_id)
        self.events.flush()  # (with the dead letters written since the last one)
        self._dead_letters_flushed = self._dead_letters_written()
        self.core.timing.add("publish", time.perf_counter() - t_pub)
        self.consumer.commit(offsets=self._offsets)
        if self.schedule is not None:
            by_count, by_time = self.schedule.due(self.stats.updates)
            if self.config.snapshot_interval_s:  # rank 0's clock decides: snapshot() is a collective
                by_time = bool(self.ranks.broadcast(by_time))
            retry = self._snapshot_retry_at is not None and self.clock() >= self._snapshot_retry_at
            if self.ranks.world > 1:  # rank 0 saves and knows; snapshot() is a collective
                retry = bool(self.ranks.broadcast(retry))
            if by_count or by_time or retry:
                # taken at the start of the next step (or by the caller's final snapshot): the state
                # and offsets do not change before then, and the new version's readers (a co-located
                # actor steps next) do not wait for the write (bench/latency_breakdown.py)
                self._snapshot_due = True
                self._snapshot_timed = by_time
        if self.on_update is not None:
            self.on_update(self, upd.metrics, time.perf_counter() - t0)
        return upd.metrics

    def _control_batch(self, start: float, update_s: float) -> None:
        """The next update's minibatch size from this one's load (``batch_control``): its
        seconds over the seconds since the previous update ended (the cycle that holds it)."""
        end = start + update_s
        last, self._last_update_end = self._last_update_end, end
        if self.batch_control is None or last is None:
            return
        util = self.gpu_util() if self.gpu_util is not None else None
        self.algo.minibatch_size = self.batch_control.update(update_s, end - last, util)

    def _publish(self, parent: int | None, metrics: dict[str, float] | None = None) -> int:
        """Allocate the next version and publish the weights as it (ranks > 0 only count it)."""
        version = self.core.next_version()
        self._publish_version(version, parent, metrics)
        return version

    def _publish_version(self, version: int, parent: int | None, metrics: dict[str, float] | None = None,
                         flush: bool = True) -> None:
        if not self.ranks.publisher:  # one writer per group: rank 0 (or the only learner)
            return
        pv = make_policy_version(
            self.core.policy, policy_id=self.config.policy_id, version=version, parent_version=parent,
            learner_id=self.config.learner_id, algo=self.config.algo,
            metrics={k: float(v) for k, v in (metrics or {}).items()}, blob_store=self.blob_store,
            claim_check_above=self.config.claim_check_above,
        )
        pv = stamp(pv, self.algo, self.config.run_id, self.config.fork_of, self.config.train_batch_size)
        publish_policy_version(self.events, pv, flush=flush)

    def snapshot(self, timed: bool | None = None) -> None:
        """Save the state; with ranks, a collective: rank 0 saves every rank's offsets and ids.
        ``timed``: a time-based snapshot (kept by the store's ``keep_timed``); None: whatever
        the schedule made due (an update-based one if nothing was)."""
        if self.fenced:  # the store is the newer learner's now: ours would overwrite its snapshots
            self._snapshot_due = self._snapshot_timed = False
            return
        if timed is None:
            timed = self._snapshot_due and self._snapshot_timed
        self._snapshot_due = self._snapshot_timed = False
        share = self.core.snapshot_share(self._offsets)
        if share is None:
            if self.schedule is not None:
                self.schedule.taken(timed)
            return
        offsets, seen = share
        meta = {
            "updates": self.stats.updates,
            "samples_trained": self.stats.samples_trained,
            "algo": self.config.algo,
            "arch": arch_of(self.algo.policy),
            "env_id": self.config.env_id,
            "policy_id": self.config.policy_id,
            "offsets": [[t, p, o] for (t, p), o in sorted(offsets.items())],
            "trained_batch_ids": seen,
            "created_at_ms": now_ms(),
        }
        try:
            self.snapshots.save(self.model_version, self.algo.policy.state_dict(), meta, state=self.algo.state_dict(),
                                timed=timed)
        except SnapshotError as e:
            self._snapshot_failed(e)
            return
        self._snapshot_retry_at = None
        if self.schedule is not None:
            self.schedule.taken(timed)

    def _snapshot_failed(self, e: SnapshotError) -> None:
        """A save failed: training goes on; counted, logged at most once per ``SNAPSHOT_RETRY_S``
        (with the failures not logged since), and due again ``SNAPSHOT_RETRY_S`` from now."""
        self.snapshot_failures += 1
        if self.on_snapshot_failure is not None:
            self.on_snapshot_failure(type(e.__cause__ or e).__name__)
        self._snapshot_retry_at = self.clock() + SNAPSHOT_RETRY_S
        now = time.monotonic()
        if now - self._snapshot_failure_logged < SNAPSHOT_RETRY_S:
            self._snapshot_failures_unlogged += 1
            return
        more = self._snapshot_failures_unlogged
        self._snapshot_failure_logged, self._snapshot_failures_unlogged = now, 0
        log.warning("snapshot failed: %s; training goes on, the save is retried in %.0fs%s", e, SNAPSHOT_RETRY_S,
                    f" ({more} more failure(s) not logged)" if more else "")

    def summary(self) -> dict[str, Any]:
        """What this learner did (the role protocol's summary)."""
        return {"role": "learner", "updates": self.stats.updates, "final_version": self.version,
                "policy_id": self.config.policy_id, "samples_trained": self.stats.samples_trained,
                "duplicates_skipped": self.stats.duplicates_skipped, "last_metrics": self.stats.last_metrics,
                "policy_lag": self.stats.policy_lag, "policy_lag_breaker": self._policy_breaker_summary(),
                "replay": self._replay_summary(),
                "minibatch_size": getattr(self.algo, "minibatch_size", None),
                "minibatch_changes": self.batch_control.changes if self.batch_control is not None else None,
                **self._time_summary()}

    def _time_summary(self) -> dict[str, Any]:
        """Where the rounds' time went (``LearnerCore.timing``) and the captured update's counters."""
        capture = getattr(self.algo, "capture", None)
        return {"time_s": self.core.timing.summary(capture.compile_s if capture is not None else 0.0),
                "capture": capture.as_dict() if capture is not None else None}

    def _replay_summary(self) -> dict[str, Any] | None:
        r = self.core.replay
        if r is None:
            return None
        c = r.config
        return {"capacity": c.capacity, "samples_per_insert": c.samples_per_insert, "max_reuse": c.max_reuse,
                "inserted": r.limiter.inserted, "replayed": r.limiter.replayed, **r.metrics(),
                "evicted": r.stats.evicted, "exhausted": r.stats.exhausted, "oversize": r.stats.oversize}

    def _policy_breaker_summary(self) -> dict[str, Any] | None:
        b = self.policy_breaker
        if b is None:
            return None
        return {"open_above": b.open_above, "close_below": b.close_below, "trips": b.trips, "state": b.state.name,
                "holds": self.stats.policy_lag_holds, "overrides": self.stats.policy_lag_overrides}

    def close(self) -> None:
        # (ranks: a collective, each caller's final snapshot covers it; fenced: the store is the newer learner's)
        if self._snapshot_due and self.ranks.world == 1 and not self.fenced:
            self.snapshot()
        if self.consumer is not None:
            self.consumer.close()
        if self._versions is not None:
            self._versions.close()
