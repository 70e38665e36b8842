"""In-process shell of the prepare pipeline (co-located mode, or any bus backend).

    worker = PrepareWorker(events, Prepare.from_config(cfg, PolicyLogpFn.from_policy_version))
    stop = threading.Event()
    worker.run(stop)                 # or: while ...: worker.step(0.1)

Each ``step``: read new PolicyVersions (an ephemeral reader: every worker sees every version,
starting ``max_versions + 1`` back from the end), poll raw SampleBatches, push them through
``Prepare``, publish PreparedBatches to ``rl.samples.prepared`` (key ``actor_id``),
dead-letter rejections with their reason, flush, then commit.

Commits never pass a batch still held in the reorder buffer: the committed offset of a
partition stops at the lowest held offset, so a crash redelivers held batches (at least once;
the learner's batch_id dedup or ours drops the copies). Any exception raised while handling
one record dead-letters that record (reason ``processor_error``) and the worker goes on. A bad
record of rl.policy.versions is skipped and counted instead (``skipped``): the learner owns its
dead letter (``streams.topics.DEAD_LETTER_OWNERS``).
"""

from __future__ import annotations

import threading
import traceback
from typing import Any

from schemas.errors import CodecError
from schemas.events import PolicyVersion, PreparedBatch, SampleBatch
from streams.bus.base import Record
from streams.events import EventBus, EventConsumer
from streams.processors.pipeline import REASON_PROCESSOR_ERROR, Output, Prepare, Rejection
from streams.topics import POLICY_VERSIONS, SAMPLES_PREPARED, SAMPLES_RAW

STAGE = "streams.prepare"


class PrepareWorker:
    """Drives a ``Prepare`` from the bus. See the module docstring.

    Args:
        events: the typed bus.
        prepare: the pipeline (owned by this worker; not thread-safe).
        group: consumer group of the raw-sample reader.
        max_records: most raw records per poll.
        metrics: optional ``runtime.metrics.Metrics`` (consumer lag).
        policy_backlog: how many PolicyVersions back from the end to start reading
            (default: the staleness window's K + 1).
    """

    def __init__(self, events: EventBus, prepare: Prepare, group: str = "streams", *,
                 max_records: int = 256, metrics: Any = None, policy_backlog: int | None = None) -> None:
        self.events = events
        self.prepare = prepare
        self.group = group
        self.max_records = max_records
        self.metrics = metrics
        self.samples: EventConsumer = events.consumer(group, [SAMPLES_RAW], stage=STAGE, expect=SampleBatch)
        backlog = prepare.staleness.max_versions + 1 if policy_backlog is None else policy_backlog
        backlog = max(1, min(backlog, 1 << 20))
        ends = events.bus.end_offsets(POLICY_VERSIONS)
        start = {(POLICY_VERSIONS, p): max(0, e - backlog) for p, e in ends.items()}
        self.policies: EventConsumer = events.consumer(None, [POLICY_VERSIONS], stage=STAGE,
                                                       expect=PolicyVersion, start=start or "earliest")
        self._policy_records: dict[int, Record] = {}  # newest versions' records, to dead-letter a bad one
        self._held: dict[tuple[int, int], Record] = {}  # (partition, offset) -> raw record in Prepare
        self._polled: dict[int, int] = {}  # partition -> next offset after the last polled record
        self._committed: dict[int, int] = {}
        self.published = 0
        self.dead_lettered = 0
        self.skipped = 0  # bad records of a topic whose dead letters another role owns
        self.errors = 0

    # -- one step ---------------------------------------------------------------------------
    def step(self, timeout: float = 0.1) -> int:
        """One round; returns how much work it did (records read + outputs), 0 when idle."""
        work = self._read_policies()
        records = self.samples.raw.poll(timeout if not work else 0.0, self.max_records)
        for rec in records:
            work += 1
            self._polled[rec.partition] = max(self._polled.get(rec.partition, 0), rec.offset + 1)
            self._handle(rec)
        outs = self._safe(self.prepare.tick)
        work += len(outs)
        self._emit(outs)
        for version, error in self.prepare.take_policy_failures():
            rec = self._policy_records.pop(version, None)
            if rec is not None:  # its weights do not build a policy: IS goes on with the last good one
                self._dead_letter(self.policies, rec, getattr(error, "reason", "policy_unusable"), error)
        self.events.flush()
        self._commit()
        if self.metrics is not None:
            try:
                self.metrics.set_consumer_lag(self.group, SAMPLES_RAW, sum(self.samples.lag().values()))
            except Exception:
                pass
        return work

    def _read_policies(self) -> int:
        n = 0
        while True:
            recs = self.policies.raw.poll(0.0, 64)
            if not recs:
                return n
            for rec in recs:
                n += 1
                try:
                    pv = self._decode(rec, PolicyVersion)
                    if pv is not None and self.prepare.on_policy(pv):
                        self._policy_records[pv.version] = rec
                        while len(self._policy_records) > 16:
                            self._policy_records.pop(next(iter(self._policy_records)))
                except Exception as e:
                    self._dead_letter(self.policies, rec, REASON_PROCESSOR_ERROR, e)

    def _decode(self, rec: Record, expect: type) -> Any:
        """The record's event, or None after dead-lettering it with the codec's reason."""
        try:
            return self.events.codec.decode_valid(rec.value, expect, rec.topic)
        except CodecError as e:
            if rec.topic == SAMPLES_RAW:
                self.prepare.reject_record(e.reason, e, rec.partition, rec.offset)
                self._dead_letter(self.samples, rec, e.reason, e)
            else:
                self.prepare.stats.policy_errors += 1
                self._dead_letter(self.policies, rec, e.reason, e)
            return None

    def _handle(self, rec: Record) -> None:
        key = (rec.partition, rec.offset)
        try:
            batch = self._decode(rec, SampleBatch)
            if batch is None:
                return
            self._held[key] = rec
            outs = self.prepare.push(batch, rec.partition, rec.offset)
        except Exception as e:
            self._held.pop(key, None)
            self.prepare.reject_record(REASON_PROCESSOR_ERROR, e, rec.partition, rec.offset)
            self._dead_letter(self.samples, rec, REASON_PROCESSOR_ERROR, e)
            return
        self._emit(outs)

    def _safe(self, fn) -> list[Output]:
        try:
            return fn()
        except Exception:  # a bug in a periodic stage: keep the worker alive, say so
            self.errors += 1
            traceback.print_exc()
            return []

    def _emit(self, outs: list[Output]) -> None:
        for out in outs:
            if isinstance(out, Rejection):
                rec = self._held.pop((out.partition, out.offset), None)
            else:
                rec = self._held.pop((out.source_partition, out.source_offset), None)
            if isinstance(out, PreparedBatch):
                try:
                    self.events.publish(SAMPLES_PREPARED, out, key=out.sample.actor_id)
                    self.published += 1
                except Exception as e:
                    if rec is None:
                        raise
                    self.prepare.reject_record(REASON_PROCESSOR_ERROR, e, rec.partition, rec.offset)
                    self._dead_letter(self.samples, rec, REASON_PROCESSOR_ERROR, e)
            elif out.dead_letter:
                if rec is None:
                    rec = Record(SAMPLES_RAW, out.partition, out.offset, None, b"")
                self._dead_letter(self.samples, rec, out.reason, out.error or out.reason, out.detail)

    def _dead_letter(self, consumer: EventConsumer, rec: Record, reason: str, error: BaseException | str,
                     detail: str = "") -> None:
        if consumer.dead_letter(rec, reason, error, detail):
            self.dead_lettered += 1
        else:  # a policy record: the learner owns its dead letter
            self.skipped += 1

    def _commit(self) -> None:
        low: dict[int, int] = {}
        for p, o in self._held:
            if o < low.get(p, 1 << 62):
                low[p] = o
        offsets = {}
        for p, nxt in self._polled.items():
            upto = min(nxt, low.get(p, nxt))
            if upto > self._committed.get(p, 0):
                offsets[(SAMPLES_RAW, p)] = upto
                self._committed[p] = upto
        if offsets:
            self.samples.commit(offsets=offsets)

    # -- loop -------------------------------------------------------------------------------
    def run(self, stop: threading.Event, timeout: float = 0.1, drain: bool = False) -> None:
        """``step`` until ``stop`` is set. ``drain`` releases the reorder buffer at the end
        (co-located runs); otherwise held batches stay uncommitted for the next worker."""
        from runtime.roles import Slot, drive

        try:
            drive([Slot(self, timeout)], stop=stop)
            if drain:
                self.drain()
        finally:
            self.close()

    def drain(self) -> None:
        self._emit(self._safe(self.prepare.drain))
        self.events.flush()
        self._commit()

    def summary(self) -> dict[str, Any]:
        """What this shell did (the role protocol's summary): the processors' stats."""
        return {"role": "streams", "published": self.published, "dead_lettered": self.dead_lettered,
                "skipped": self.skipped, **self.prepare.stats.as_dict()}

    def close(self) -> None:
        for c in (self.samples, self.policies):
            try:
                c.close()
            except Exception:
                pass
