"""The learner shell: consumes PreparedBatch events, runs the algorithm, publishes GradientStep
and PolicyVersion events, snapshots, resumes and rolls back.

    learner = Learner(config, algo, events, snapshots=store)
    learner.start()                 # resume from the newest snapshot, or publish version 0
    while not stop.is_set():
        learner.step(timeout=0.1)   # poll; once train_batch_size transitions are in, one update on all of them

Versions are immutable and monotonic: a resumed or rolled-back learner publishes a NEW version
(number = newest published + 1) whose parent is the snapshot it restored.

Exactly-once training across restarts: every snapshot stores the input offsets its state has
consumed and the ids of the batches it trained on; a resumed learner seeks to those offsets,
so batches after the snapshot are re-delivered and trained once, and a batch_id seen twice
(an actor's retry) is skipped and counted.

Nothing it consumes can stop it: an undecodable or invalid record, a duplicate, and a batch
whose observation/action sizes the model does not have (reason ``incompatible``) are
dead-lettered; a lag signal that cannot be read (broker down) leaves the breaker as it is.

Two circuit breakers may hold training back: ``breaker`` over an outside ``lag_signal`` (the
stream processors' backlog), which stops polling too, and ``policy_breaker`` over the policy
lag the learner sees itself (``policy_lag``: its version minus the newest behaviour version of
the last records it read). While the policy-lag breaker is open the learner keeps reading (so
it sees the lag fall as actors adopt the version it holds still) but does not update, until
``hold_cap`` transitions wait: a full buffer trains anyway (``policy_lag_overrides``), so a
learner can never wait for data it will not read.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agents.core import Algorithm
from learner.batching import StreamIds, to_trajectory_batch
from learner.provenance import record_digest, stamp
from schemas.errors import CodecError
from schemas.events import GradientStep, PreparedBatch, now_ms
from streams.bus.base import BusError, Record
from streams.events import EventBus
from streams.policies import (
    DEFAULT_CLAIM_CHECK_ABOVE,
    BlobStore,
    PolicyFollower,
    StartRule,
    arch_of,
    load_policy,
    make_policy_version,
    newest_version,
    publish_policy_version,
)
from streams.topics import LEARNER_STEPS, SAMPLES_PREPARED

REASON_INCOMPATIBLE = "incompatible"
SEEN_IDS_KEPT = 20_000


@dataclass(frozen=True)
class LearnerConfig:
    learner_id: str = "learner-0"
    """Key of this learner's GradientStep events."""
    policy_id: str = "policy"
    """Key of the PolicyVersion events it publishes."""
    algo: str = "ppo"
    """Algorithm name (recorded on every event)."""
    train_batch_size: int = 2048
    """Transitions per update; fragments are accumulated until at least this many arrived."""
    snapshot_every: int = 10
    """Snapshot the full learner state every this many updates (0: never)."""
    group: str = "learner"
    """Consumer group on rl.samples.prepared."""
    max_updates: int | None = None
    """Stop (``done``) after this many updates; None: run until stopped."""
    total_samples: int | None = None
    """The run's budget: once the samples trained and buffered reach it, the remainder is
    trained as a last, smaller update rather than waited on (None: no budget)."""
    env_id: str = ""
    """Recorded in snapshots, so a rollback can check it restores a policy of the same env."""
    run_id: str = ""
    """Recorded in each PolicyVersion's provenance (``rlstream verify``/``lineage`` select by it)."""
    fork_of: dict | None = None
    """``{"run_id", "version", "source"}`` of the parent when this learner continues a fork
    (``rlstream fork``); recorded in the provenance of its versions."""
    claim_check_above: int = DEFAULT_CLAIM_CHECK_ABOVE
    """Weights over this many bytes go by claim check when a blob store is configured."""


@dataclass
class LearnerStats:
    updates: int = 0
    samples_trained: int = 0
    duplicates_skipped: int = 0
    redelivered_skipped: int = 0
    """Records handled already, read again at the same offset (Kafka redelivers from the last
    commit after a rebalance or a broker restart): skipped, not dead-lettered, as not bad input."""
    paused_polls: int = 0
    lag_signal_errors: int = 0
    adopted_versions: int = 0
    policy_lag: int = 0
    """The learner's version minus the newest behaviour version of the last records read."""
    policy_lag_holds: int = 0
    """Steps in which the policy-lag breaker held back an update that was ready."""
    policy_lag_overrides: int = 0
    """Updates taken with the policy-lag breaker open because ``hold_cap`` transitions waited."""
    last_metrics: dict[str, float] = field(default_factory=dict)


class Learner:
    def __init__(self, config: LearnerConfig, algo: Algorithm, events: EventBus, snapshots: Any = None,
                 breaker: Any = None, lag_signal: Callable[[], float] | None = None,
                 on_update: Callable[["Learner", dict[str, float], float], None] | None = None,
                 blob_store: BlobStore | None = None, stream_ids: StreamIds | None = None,
                 parallel: Any = None, policy_breaker: Any = None, hold_cap: int | None = None) -> None:
        self.config = config
        self.parallel = parallel  # learner.distributed.DataParallel of a rank of N (docs/learners.md)
        self.algo = algo
        self.events = events
        self.snapshots = snapshots
        self.breaker = breaker
        self.lag_signal = lag_signal
        self.policy_breaker = policy_breaker
        self.hold_cap = hold_cap if hold_cap is not None else 4 * config.train_batch_size
        self.on_update = on_update
        self.blob_store = blob_store
        self.stats = LearnerStats()
        self.version = -1  # newest version this learner published
        self.model_version = -1  # version whose weights the algorithm holds
        self._seen: OrderedDict[str, None] = OrderedDict()
        # fragments waiting for the next update, of any lengths, in arrival order
        self._pending: list[tuple[Record, PreparedBatch]] = []
        self._pending_ids: set[str] = set()
        self._pending_size = 0
        self._stream_ids = stream_ids or StreamIds()  # a fork passes the parent's, replayed
        self._offsets: dict[tuple[str, int], int] = {}
        self.consumer = None
        self._versions = None

    # -- lifecycle ----------------------------------------------------------------------------
    def latest_published(self) -> int:
        """Newest version of this policy on the topic (-1 if none), whatever else shares it."""
        newest = newest_version(self.events, self.config.policy_id)
        return -1 if newest is None else newest.version

    def start(self, resume: bool = True, from_version: int | None = None, publish: bool = True) -> None:
        """Restore state (newest snapshot, or ``from_version``) and publish the current policy
        (``publish=False``: it is already the newest version on the topic, as in a fork)."""
        published = self.latest_published()
        if self.parallel is not None:
            published = self.parallel.broadcast(published)
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
        if self.parallel is not None:
            parts = len(self.events.bus.end_offsets(SAMPLES_PREPARED))
            self.parallel.settle(self.consumer, SAMPLES_PREPARED, parts, restored)
        self.version = published
        if publish:
            self._publish(parent=self.model_version if self.model_version >= 0 else None)
        # from the newest version of this policy (its own, just published): every later one,
        # in log order, older ones too (a bad one is dead-lettered whether adopted or not)
        self._versions = PolicyFollower(self.events, self.config.policy_id, StartRule.newest(),
                                        blobs=self.blob_store, stage="learner", monotonic=False)

    def _restore(self, version: int | None) -> dict | None:
        if version is None:
            version = self.snapshots.latest()
            if version is None:
                return None
        _, meta = self.snapshots.load(version)
        state = self.snapshots.load_state(version)
        if state is None:
            raise RuntimeError(f"snapshot {version} has no learner state; cannot resume from it")
        self.algo.load_state_dict(state)
        self.model_version = version
        self.stats.updates = int(meta.get("updates", 0))
        self.stats.samples_trained = int(meta.get("samples_trained", self.stats.updates * self.config.train_batch_size))
        for bid in meta.get("trained_batch_ids", []):
            self._seen[bid] = None
        return {(t, int(p)): int(o) for t, p, o in meta.get("offsets", [])} or None

    def rollback(self, to_version: int) -> int:
        """Restore snapshot ``to_version`` and publish it as a new version; returns that number."""
        self._restore(to_version)
        self._drop_buffered()
        return self._publish(parent=to_version)

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
            restored = False
            if self.snapshots is not None and pv.parent_version is not None and \
                    pv.parent_version in self.snapshots.versions():
                state = self.snapshots.load_state(pv.parent_version)
                if state is not None:
                    self.algo.load_state_dict(state)  # weights, optimiser and normalisers of the snapshot
                    restored = True
            if not restored:
                self.algo.policy.load_state_dict(policy.state_dict())
            self.version = self.model_version = pv.version
            self._drop_buffered()  # collected under the abandoned line of versions
            self.stats.adopted_versions += 1

    def step(self, timeout: float = 0.1) -> dict[str, float] | None:
        if self._versions is not None and self.parallel is None:  # ranks: see docs/learners.md
            self._follow_foreign_versions()
        paused = False
        if self.breaker is not None and self.lag_signal is not None:
            try:
                self.breaker.update(self.lag_signal())
            except BusError:  # broker unreachable: the lag is unknown, the breaker stays as it is
                self.stats.lag_signal_errors += 1
            if not self.breaker.allow():
                self.stats.paused_polls += 1
                time.sleep(min(timeout, 0.05))
                if self.parallel is None:
                    return None
                paused = True
        held = False
        if self.policy_breaker is not None:
            self.policy_breaker.update(self.stats.policy_lag)
            held = not self.policy_breaker.allow()
        newest = None  # newest behaviour version read in this poll
        for rec, pb in [] if paused else self.consumer.poll(timeout, max_records=64):
            newest = pb.sample.policy_version if newest is None else max(newest, pb.sample.policy_version)
            bid = pb.sample.batch_id
            if bid in self._seen and rec.offset < self._offsets.get((rec.topic, rec.partition), 0):
                self.stats.redelivered_skipped += 1  # this very record, trained before the rewind
                continue
            if bid in self._seen or bid in self._pending_ids:
                self.stats.duplicates_skipped += 1
                self.consumer.dead_letter(rec, "duplicate", "DuplicateBatch", f"batch_id {bid} already trained")
                continue
            why = self._incompatible(pb)
            if why is not None:  # another env's batch: training on it would raise (a poison pill)
                self.consumer.dead_letter(rec, REASON_INCOMPATIBLE, "IncompatibleBatch", why)
                continue
            self._pending.append((rec, pb))
            self._pending_ids.add(bid)
            self._pending_size += pb.sample.size
        if newest is not None:
            self.stats.policy_lag = max(0, self.version - newest)
        need = self.config.train_batch_size
        if self.config.total_samples is not None:
            need = max(1, min(need, self.config.total_samples - self.stats.samples_trained))
        ready = bool(self._pending) and self._pending_size >= need
        hold = held and self._pending_size < self.hold_cap
        if self.parallel is not None:  # every rank decides together, each with its share
            ready = self.parallel.agree(self._pending_size, paused or hold, need).train
        elif ready and hold:
            self.stats.policy_lag_holds += 1
            ready = False
        if ready and held and not hold:
            self.stats.policy_lag_overrides += 1
        if ready:
            return self._train()
        self._commit_handled()
        return None

    def _commit_handled(self) -> None:
        """Commit past records handled without an update (dead-lettered), so that the group's
        offset reaches the log end when the last records were bad ones."""
        safe = self._safe_offsets()
        if safe != self._offsets:
            self._offsets = safe
            self.consumer.commit(offsets=safe)

    def _drop_buffered(self) -> None:
        """After a rollback: buffered fragments were collected under the abandoned line of
        versions; they are dead-lettered (reason ``rolled_back``), not trained, not lost."""
        for rec, pb in self._pending:
            self.consumer.dead_letter(rec, "rolled_back", "RolledBack",
                                      f"batch {pb.sample.batch_id} predates the rollback to version {self.version}")
        self._take_pending()

    def _take_pending(self) -> list[tuple[Record, PreparedBatch]]:
        taken, self._pending, self._pending_size = self._pending, [], 0
        self._pending_ids.clear()
        return taken

    @property
    def buffered(self) -> int:
        """Transitions waiting for the next update (fewer than ``train_batch_size``)."""
        return self._pending_size

    def _safe_offsets(self) -> dict[tuple[str, int], int]:
        """Per partition, the offset before which every record is trained or dead-lettered: what
        may be committed and recorded in a snapshot (a record still waiting for an update is not)."""
        safe = dict(self.consumer.polled_upto)
        for r, _ in self._pending:
            tp = (r.topic, r.partition)
            safe[tp] = min(safe.get(tp, r.offset), r.offset)
        return safe

    def _incompatible(self, pb: PreparedBatch) -> str | None:
        """Why the model cannot train on ``pb`` (observation/action sizes it does not have), or None."""
        policy = self.algo.policy
        obs, act = pb.sample.obs.shape[2:], pb.sample.actions.shape[2:]
        if obs != (policy.obs_dim,) or act != (policy.act_dim,):
            return (f"batch {pb.sample.batch_id} of {pb.sample.env_id}: observations {obs} / actions {act} "
                    f"do not fit the model's ({policy.obs_dim},) / ({policy.act_dim},)")
        return None

    def _train(self) -> dict[str, float]:
        """One update on every buffered fragment, whatever their lengths (``to_trajectory_batch``
        pads and masks them so each keeps its own returns), then publish, commit and snapshot."""
        started = now_ms()
        t0 = time.perf_counter()
        n_samples = self._pending_size
        pending = self._take_pending()
        batches = [pb for _, pb in pending]
        batch = to_trajectory_batch(batches, self._stream_ids) if batches else None  # None: a rank with no share
        ids = [b.sample.batch_id for b in batches]
        digests = [record_digest(r.value) for r, _ in pending]
        if self.parallel is None:
            metrics = self.algo.update(batch)
            total = n_samples
        else:  # rank 0 publishes the step of the whole group
            metrics = self.parallel.update(batch, n_samples)
            shares = self.parallel.gather((ids, digests, n_samples))
            ids, digests = [i for s in shares for i in s[0]], [d for s in shares for d in s[1]]
            total = sum(s[2] for s in shares)
        self.stats.updates += 1
        self.stats.samples_trained += total
        self.stats.last_metrics = metrics
        for b in batches:
            self._seen[b.sample.batch_id] = None
        while len(self._seen) > SEEN_IDS_KEPT:
            self._seen.popitem(last=False)
        self._offsets = self._safe_offsets()
        from_version = self.model_version
        new_version = self._publish(parent=from_version, metrics=metrics)
        step = GradientStep(
            learner_id=self.config.learner_id, step=self.stats.updates, from_version=from_version,
            to_version=new_version, algo=self.config.algo,
            losses={k: float(v) for k, v in metrics.items()},
            grad_norm=float(metrics.get("grad_norm", 0.0)), batch_ids=ids,
            num_samples=total, started_at_ms=started, finished_at_ms=now_ms(), batch_digests=digests,
        )
        if self._publishes:
            self.events.publish(LEARNER_STEPS, step, key=self.config.learner_id)
            self.events.flush()
        self.consumer.commit(offsets=self._offsets)
        if self.snapshots is not None and self.config.snapshot_every and \
                self.stats.updates % self.config.snapshot_every == 0:
            self.snapshot()
        if self.on_update is not None:
            self.on_update(self, metrics, time.perf_counter() - t0)
        return metrics

    @property
    def _publishes(self) -> bool:
        """One writer per group: rank 0 (or the only learner)."""
        return self.parallel is None or self.parallel.publisher

    def _publish(self, parent: int | None, metrics: dict[str, float] | None = None) -> int:
        self.version += 1
        if not self._publishes:  # ranks > 0 count the versions rank 0 publishes
            self.model_version = self.version
            return self.version
        pv = make_policy_version(
            self.algo.policy, policy_id=self.config.policy_id, version=self.version, parent_version=parent,
            learner_id=self.config.learner_id, algo=self.config.algo,
            metrics={k: float(v) for k, v in (metrics or {}).items()}, blob_store=self.blob_store,
            claim_check_above=self.config.claim_check_above,
        )
        pv = stamp(pv, self.algo, self.config.run_id, self.config.fork_of, self.config.train_batch_size)
        self.model_version = self.version
        publish_policy_version(self.events, pv)
        return self.version

    def snapshot(self) -> None:
        """Save the state; with ranks, a collective: rank 0 saves every rank's offsets and ids."""
        offsets, seen = dict(self._offsets), list(self._seen.keys())[-SEEN_IDS_KEPT:]
        if self.parallel is not None:
            shares = self.parallel.gather((offsets, seen))
            if not self.parallel.publisher:
                return
            offsets = {tp: o for s in shares for tp, o in s[0].items()}
            seen = [i for s in shares for i in s[1]]
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
        self.snapshots.save(self.model_version, self.algo.policy.state_dict(), meta, state=self.algo.state_dict())

    def summary(self) -> dict[str, Any]:
        """What this learner did (the role protocol's summary)."""
        return {"role": "learner", "updates": self.stats.updates, "final_version": self.version,
                "policy_id": self.config.policy_id, "samples_trained": self.stats.samples_trained,
                "duplicates_skipped": self.stats.duplicates_skipped, "last_metrics": self.stats.last_metrics,
                "policy_lag": self.stats.policy_lag, "policy_lag_breaker": self._policy_breaker_summary()}

    def _policy_breaker_summary(self) -> dict[str, Any] | None:
        b = self.policy_breaker
        if b is None:
            return None
        return {"open_above": b.open_above, "close_below": b.close_below, "trips": b.trips, "state": b.state.name,
                "holds": self.stats.policy_lag_holds, "overrides": self.stats.policy_lag_overrides}

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.close()
        if self._versions is not None:
            self._versions.close()
