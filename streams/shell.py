"""The core both processor shells call: ``streams.worker`` (in-process, any bus) and
``streams.faust_app`` (``faust -A streams worker``). A shell only moves bytes::

    core = ShellCore(prepare, events.dead_letters, stage="streams.prepare", codec=events.codec)
    core.deliver(core.on_policy(rec), produce)        # every record of rl.policy.versions
    core.deliver(core.on_sample(rec, handle), produce)  # every record of rl.samples.raw
    core.deliver(core.tick(), produce)                 # periodically: reorder timeouts

Each call returns ``Send``s: PreparedBatch records for ``rl.samples.prepared`` (key actor_id),
DeadLetter records for ``rl.deadletter``, and bare releases (``topic`` None: a record that left
without output, e.g. a duplicate). ``deliver`` (or the Faust shell's async twin) writes them,
reports each with ``sent`` or ``failed``, and the shell acknowledges a send's ``done`` handle
once it is written.

Rules kept here, once:

* **decode and dead-letter**: a raw record that does not decode, or whose push raises, is
  dead-lettered with the codec's reason (or ``processor_error``) through
  ``streams.events.DeadLetters.build`` -- the one DeadLetter builder. A bad policy record is
  skipped and counted (the learner owns its dead letter, ``streams.topics.DEAD_LETTER_OWNERS``).
* **held records**: ``ledger`` (``streams.offsets.OffsetLedger``) holds each raw record read
  and still inside ``Prepare`` (buffered for reordering) with its shell handle; the in-process
  shell commits what it says is safe (no partition past its lowest held offset); the Faust
  shell acks a record only once its output is written, and in offset order (``InOrderAcks``,
  the same ledger over the records taken and not yet written).
* **a rejection whose record is no longer held** (a rebalance or a redelivery replaced it) is
  still dead-lettered, from the batch it carries (re-encoded; partition and offset from the
  rejection): no rejection leaves without its dead letter, and there is nothing to ack.
* **a failed publish** of a PreparedBatch dead-letters its raw record (``processor_error``).
* **policy records**: ``PolicyRecords`` keeps the records of the newest versions, so a version
  whose weights do not build a policy can be reported against its record.
* **where the policy reader starts**: ``policy_starts`` -- K + 1 records back from the end of
  each partition of rl.policy.versions (what the staleness window needs).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from runtime.logging import RateLimiter
from schemas.codec import Codec
from schemas.errors import CodecError
from schemas.events import PolicyVersion, PreparedBatch, SampleBatch
from streams.bus.base import Record
from streams.events import DeadLetters
from streams.offsets import OffsetLedger
from streams.processors.pipeline import REASON_PROCESSOR_ERROR, Output, Prepare, Rejection
from streams.processors.staleness import PolicyStalenessError
from streams.topics import DEADLETTER, SAMPLES_PREPARED, SAMPLES_RAW, dead_letters_here

log = logging.getLogger(__name__)

#: Policy records remembered, newest versions first out last.
POLICY_RECORDS_KEPT = 16
#: At most one ``PolicyStalenessError`` log line per this many seconds per reason (the others are
#: counted and reported with the next line; every one is dead-lettered and counted regardless).
STALE_LOG_EVERY_S = 10.0


@dataclass(frozen=True, slots=True)
class Send:
    """One record to write (``topic`` None: nothing to write, only ``done`` to release)."""

    topic: str | None
    key: bytes | None = None
    value: bytes = b""
    headers: Mapping[str, bytes] | None = None
    source: Record | None = None
    """The raw record this send finishes (dead-lettered if a PreparedBatch cannot be written)."""
    done: Any = None
    """The shell's handle of ``source``, released once this send is written."""
    reason: str = ""
    """Dead letters: the reason, for the counts."""


class PolicyRecords:
    """Records of the newest policy versions read, by version (the seam where a window of
    policy versions plugs in): ``remember`` the newest, ``pop`` one whose weights failed."""

    def __init__(self, keep: int = POLICY_RECORDS_KEPT) -> None:
        self.keep = keep
        self._by_version: dict[int, Record] = {}

    def remember(self, version: int, record: Record) -> None:
        self._by_version[version] = record
        while len(self._by_version) > self.keep:
            self._by_version.pop(next(iter(self._by_version)))

    def pop(self, version: int) -> Record | None:
        return self._by_version.pop(version, None)

    def __len__(self) -> int:
        return len(self._by_version)


def policy_backlog(prepare: Prepare, override: int | None = None) -> int:
    """How many PolicyVersion records back from the end a reader starts: K + 1 (the staleness
    window's ``max_versions`` plus the newest), or ``override``; at least 1."""
    backlog = prepare.staleness.max_versions + 1 if override is None else override
    return max(1, min(int(backlog), 1 << 20))


def policy_starts(ends: Mapping[Any, int], backlog: int, begins: Mapping[Any, int] | None = None) -> dict[Any, int]:
    """Start offset of each partition (any key): ``backlog`` back from its end, not before its
    beginning."""
    begins = begins or {}
    return {tp: max(begins.get(tp, 0), end - backlog) for tp, end in ends.items()}


#: ``InOrderAcks.arrived`` verdicts.
TAKE, SKIP, SEEK = "take", "skip", "seek"


class InOrderAcks:
    """Takes each partition's records in offset order, each once, and acks them in that order.

    Two faust-streaming (0.15.3) behaviours lose records otherwise:

    * it commits the first run of consecutive acked offsets above the committed one, and its
      check for an unacked record at the head of that run is off by one: a record held for
      reordering at the committed offset, with its successor acked, was committed past;
    * it drops records fetched while a partition is paused or a rebalance is under way, and
      rewinds to the committed offset only when there is one above 0: a worker that took over a
      partition never committed went on from wherever the fetch had got to.

    So a record is acked only once it and every record before it in its partition are done,
    and records arrive in order from the partition's start offset (``expect``: the group's
    committed offset, or the log start): a record past the next expected offset is a gap, and
    the shell seeks back to it (``SEEK``), skipping what was fetched beyond until the gap is
    filled (``SKIP``); a record already taken is skipped too. The rl.samples.raw offsets are
    contiguous (no transactions, no compaction), so a gap is always a loss.

        acks.expect(partition, committed)   # on assignment
        verdict = acks.arrived(handle)      # TAKE: process it; SEEK: seek to acks.next(p); SKIP
        for h in acks.done(handle):         # its output is written: what may be acked now
            h.ack()
    """

    def __init__(self, where: Callable[[Any], tuple[int, int]], reseek_after: int = 1024) -> None:
        self.where = where  # handle -> (partition, offset)
        # records taken and not done are held; ``upto`` is the offset expected next
        self.ledger: OffsetLedger[int] = OffsetLedger()
        self._done: dict[int, dict[int, Any]] = {}  # partition -> offset -> handle, done and not acked yet
        self._seeking: dict[int, tuple[int, int]] = {}  # partition -> (highest offset skipped, how many) since the seek
        self.reseek_after = reseek_after
        self.rewinds = 0  # seeks back over a gap

    def expect(self, partition: int, offset: int) -> None:
        """``partition`` (newly assigned) starts at ``offset``."""
        self.ledger.start(partition, offset)
        self._done.pop(partition, None)
        self._seeking.pop(partition, None)

    def next(self, partition: int) -> int | None:
        return self.ledger.upto(partition)

    def arrived(self, handle: Any) -> str:
        p, o = self.where(handle)
        nxt = self.ledger.upto(p)
        if nxt is None or o == nxt:  # no start known: the first record is the start
            self.ledger.read(p, o)
            self.ledger.hold(p, o)
            self._seeking.pop(p, None)
            return TAKE
        if o < nxt:
            return SKIP  # taken already: a second delivery
        mark, skipped = self._seeking.get(p, (None, 0))
        if mark is not None and o > mark and skipped < self.reseek_after:
            self._seeking[p] = (o, skipped + 1)  # fetched before the seek back took effect
            return SKIP
        # a gap; again if the stream restarted below what it skipped, or the seek seems lost
        self._seeking[p] = (o, 0)
        self.rewinds += 1
        return SEEK

    def rewind(self, partition: int) -> int:
        """A seek back decided outside ``arrived`` (a partition that stalled after a gap):
        counted with the others; the offset to seek to."""
        self.rewinds += 1
        return self.ledger.upto(partition)

    def done(self, handle: Any) -> list[Any]:
        """Mark ``handle`` done; the handles that may be acked now, in offset order: those below
        the partition's lowest record still held (none of a partition this shell no longer
        owns: its records go to the new owner)."""
        p, o = self.where(handle)
        if not self.ledger.holds(p, o):
            return []
        self.ledger.release(p, o)
        done = self._done.setdefault(p, {})
        done[o] = handle
        safe = self.ledger.safe(p)
        out = [done.pop(off) for off in sorted(done) if off < safe]
        if not done:
            del self._done[p]
        return out

    def pending(self, partition: int) -> int:
        """Records of ``partition`` taken and not acked yet."""
        return len(self.ledger.held(partition)) + len(self._done.get(partition, ()))

    def forget(self, partitions: Iterable[int]) -> None:
        """A rebalance took ``partitions``: their records are redelivered to the new owner."""
        ps = list(partitions)
        self.ledger.forget(ps)
        for p in ps:
            self._done.pop(p, None)
            self._seeking.pop(p, None)


class ShellCore:
    """Decode, hold, prepare, emit, dead-letter. See the module docstring.

    Args:
        prepare: the pipeline.
        dead_letters: builds and counts dead letters (its bus is not used; the shell writes).
        stage: the shell's stage name in DeadLetters (``streams.topics.DEAD_LETTER_OWNERS``).
        codec: encodes outputs and decodes inputs.
        policy_records: the policy-record map (default ``PolicyRecords()``).
    """

    def __init__(self, prepare: Prepare, dead_letters: DeadLetters, stage: str, codec: Codec,
                 policy_records: PolicyRecords | None = None, stale_log: RateLimiter | None = None) -> None:
        self.prepare = prepare
        self.dead_letters = dead_letters
        self.stage = stage
        self.codec = codec
        self.policy_records = policy_records if policy_records is not None else PolicyRecords()
        # raw records read and held inside ``Prepare``, with their handles: item (record, handle)
        self.ledger: OffsetLedger[int] = OffsetLedger()
        self.published = 0
        self.dead_lettered = 0
        self.skipped = 0  # bad records of a topic whose dead letters another role owns
        self.errors = 0  # periodic stages or writes that failed (logged)
        self.stale_log = stale_log if stale_log is not None else RateLimiter(STALE_LOG_EVERY_S)

    # -- inputs ------------------------------------------------------------------------------
    def on_policy(self, rec: Record) -> list[Send]:
        """One record of rl.policy.versions."""
        try:
            pv = self.codec.decode_valid(rec.value, PolicyVersion, rec.topic)
            if self.prepare.on_policy(pv):
                self.policy_records.remember(pv.version, rec)
            return []
        except Exception as e:
            self.prepare.stats.policy_errors += 1
            return self.dead_letter(rec, e.reason if isinstance(e, CodecError) else REASON_PROCESSOR_ERROR, e)

    def on_sample(self, rec: Record, handle: Any = None) -> list[Send]:
        """One record of rl.samples.raw; ``handle`` is what the shell releases once it is done."""
        key = (rec.partition, rec.offset)
        self.ledger.read(*key)
        reason = REASON_PROCESSOR_ERROR
        try:
            try:
                batch = self.codec.decode_valid(rec.value, SampleBatch, rec.topic)
            except CodecError as e:
                reason = e.reason
                raise
            self.ledger.hold(*key, (rec, handle))
            outs = self.prepare.push(batch, rec.partition, rec.offset)
        except Exception as e:
            self.ledger.release(*key)
            self.prepare.reject_record(reason, e, rec.partition, rec.offset)
            return self.dead_letter(rec, reason, e, done=handle)
        return self.emit(outs)

    def tick(self) -> list[Send]:
        """Release what timed out in the reorder buffer."""
        return self.emit(self._safe(self.prepare.tick))

    def drain(self) -> list[Send]:
        """Release everything the reorder buffer holds (co-located shutdown)."""
        return self.emit(self._safe(self.prepare.drain))

    def revoke(self, partitions: Iterable[int]) -> int:
        """Forget what is held of ``partitions`` (a rebalance moved them; unacknowledged, they are
        redelivered to the new owner). Returns how many buffered batches were dropped."""
        ps = set(partitions)
        if not ps:
            return 0
        self.ledger.forget(ps)
        return self.prepare.revoke(ps)

    # -- outputs -----------------------------------------------------------------------------
    def emit(self, outs: list[Output]) -> list[Send]:
        """Sends for the pipeline's outputs, after dead letters of policies that failed to build."""
        sends: list[Send] = []
        for version, error in self.prepare.take_policy_failures():
            rec = self.policy_records.pop(version)
            if rec is not None:  # its weights do not build a policy: IS goes on with the last good one
                sends += self.dead_letter(rec, getattr(error, "reason", "policy_unusable"), error)
        for out in outs:
            if isinstance(out, PreparedBatch):
                rec, handle = self.ledger.release(out.source_partition, out.source_offset, (None, None))
                sends.append(Send(SAMPLES_PREPARED, out.sample.actor_id.encode(), self.codec.encode(out),
                                  self.codec.headers_for(out), source=rec, done=handle))
                continue
            rec, handle = self.ledger.release(out.partition, out.offset, (None, None))
            if isinstance(out.error, PolicyStalenessError):
                self._log_stale(out, out.error)
            if not out.dead_letter:
                sends.append(Send(None, done=handle))
                continue
            if rec is None:  # no longer held: dead-letter it from the batch it carries
                batch = out.batch
                rec = Record(SAMPLES_RAW, out.partition, out.offset, batch.actor_id.encode() if batch else None,
                             self.codec.encode(batch) if batch is not None else b"")
            sends += self.dead_letter(rec, out.reason, out.error or out.reason, out.detail, done=handle)
        return sends

    def _log_stale(self, out: Rejection, e: PolicyStalenessError) -> None:
        """A stale batch, in the log operators read (rate-limited per reason): its lag and the window."""
        ok, suppressed = self.stale_log.allow(e.reason)
        if not ok:
            return
        b = out.batch
        log.warning("PolicyStalenessError (%s): batch %s of %s, behaviour version %s, is %d versions behind "
                    "and %d ms old; window: at most %d versions%s; dead-lettered (%d more since the last such line)",
                    e.reason, b.batch_id if b else "?", b.actor_id if b else "?", b.policy_version if b else "?",
                    e.versions, e.ms, e.max_versions, "" if e.max_ms is None else f", {e.max_ms} ms", suppressed,
                    extra={"reason": e.reason, "lag_versions": e.versions, "lag_ms": e.ms,
                           "max_versions": e.max_versions, "max_ms": e.max_ms, "suppressed": suppressed})

    def dead_letter(self, rec: Record, reason: str, error: BaseException | str, detail: str = "",
                    done: Any = None) -> list[Send]:
        """The dead letter of ``rec``, or nothing (counted as skipped) where another role owns it."""
        if not dead_letters_here(rec.topic, self.stage):
            self.dead_letters.skip(rec.topic, reason)
            self.skipped += 1
            return [Send(None, done=done)]
        dl = self.dead_letters.build(rec, reason, error, self.stage, detail)
        return [Send(DEADLETTER, rec.key, self.codec.encode(dl), self.codec.headers_for(dl), source=rec,
                     done=done, reason=reason)]

    def sent(self, send: Send) -> None:
        """``send`` was written."""
        if send.topic == SAMPLES_PREPARED:
            self.published += 1
        elif send.topic == DEADLETTER:
            self.dead_lettered += 1
            self.dead_letters.count(send.source.topic if send.source else SAMPLES_RAW, send.reason)

    def failed(self, send: Send, error: BaseException) -> list[Send]:
        """``send`` could not be written: a PreparedBatch's raw record is dead-lettered instead;
        a dead letter that cannot be written is logged and counted in ``errors``, and its record
        released like a written one (both shells commit past it)."""
        self.errors += 1
        if send.topic == SAMPLES_PREPARED and send.source is not None:
            rec = send.source
            self.prepare.reject_record(REASON_PROCESSOR_ERROR, error, rec.partition, rec.offset)
            return self.dead_letter(rec, REASON_PROCESSOR_ERROR, error, done=send.done)
        log.error("could not write to %s (%s): %r", send.topic, send.reason or "output", error)
        return [Send(None, done=send.done)]

    def deliver(self, sends: list[Send], produce: Callable[[Send], Any]) -> None:
        """Write ``sends`` with ``produce`` (raises on failure), in order, reporting each."""
        for s in sends:
            if s.topic is None:
                continue
            try:
                produce(s)
            except Exception as e:
                self.deliver(self.failed(s, e), produce)
            else:
                self.sent(s)

    # -- stats -------------------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        return {"published": self.published, "dead_lettered": self.dead_lettered, "skipped": self.skipped}

    def summary(self) -> dict[str, Any]:
        """The role summary both shells print on shutdown."""
        return {"role": "streams", "policy_id": self.prepare.policy_id, **self.counts(),
                **self.prepare.stats.as_dict()}

    def _safe(self, fn: Callable[[], list[Output]]) -> list[Output]:
        try:
            return fn()
        except Exception:  # a bug in a periodic stage: keep the shell alive, say so
            self.errors += 1
            log.exception("prepare stage failed")
            return []
