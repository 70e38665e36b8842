"""``KafkaConsumer``: a group member (eager subscribe, start offsets by memory's rule) or a
group-less reader (``assign``) on librdkafka, whose commit runs on a helper thread so that no
commit blocks its caller longer than ``COMMIT_RETRY_S``."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

from confluent_kafka import Consumer as _RdConsumer, KafkaError, KafkaException, TopicPartition

from streams.bus.base import TP, BusError, Consumer, Record, explicit_offset
from streams.bus.kafka.errors import ATTEMPT_S, ERRORS, TRANSIENT, first_error, kafka_error, retrying
from streams.offsets import commit_targets

if TYPE_CHECKING:
    from streams.bus.kafka.admin import KafkaAdmin

log = logging.getLogger("streams.bus.kafka")  # the whole Kafka bus logs under one name

# Commit errors of a member the group no longer knows (rebalance, broker restart): dropped.
_FENCED = {KafkaError.UNKNOWN_MEMBER_ID, KafkaError.ILLEGAL_GENERATION, KafkaError.REBALANCE_IN_PROGRESS,
           KafkaError.FENCED_INSTANCE_ID}
COMMIT_RETRY_S = 10.0
#: How long ``close`` waits for librdkafka's close (a group leave; it can hang without a broker).
CLOSE_TIMEOUT_S = 10.0


class _Unanswered(Exception):
    """A commit got no answer before its deadline; it is still in flight."""


class KafkaConsumer(Consumer):
    """A consumer of ``KafkaBus.consumer`` (the package docstring says how it maps memory's rules)."""

    def __init__(self, bus: KafkaAdmin, group: str | None, topics: list[str], policy: str,
                 offsets: dict, partitions: dict[str, int]) -> None:
        self.bus = bus
        self.group = group
        self.topics = topics
        self.policy = policy
        self.offsets = offsets
        self._positions: dict[TP, int] = {}  # next offset to return, per assigned partition
        self._polled: dict[TP, int] = {}  # next offset after the last record returned
        self._committed: dict[TP, int] = {}  # what this member knows is committed
        self._kept: dict[TP, int] = {}  # positions of partitions revoked by a rebalance
        self._closed = False
        self.commit_failures = 0  # commits the group refused or that timed out (records redelivered)
        self._inflight: tuple[Future, dict[TP, int]] | None = None  # a commit still waiting on the broker
        gid = group if group is not None else f"rlstream-reader-{uuid.uuid4().hex}"
        conf = {**bus.consumer_config, "group.id": gid, "auto.offset.reset": policy,
                "error_cb": self._on_error}
        self._c = _RdConsumer(conf)
        # "latest" is the end now, as in memory (a group join completes seconds later).
        self._ends = {}
        if policy == "latest":
            self._ends = {(t, p): bus._watermarks(t, p)[1] for t, n in partitions.items() for p in range(n)}
        if group is None:
            tps = []
            for t, n in partitions.items():
                for p in range(n):
                    off = self._start_offset((t, p), None)
                    tps.append(TopicPartition(t, p, off))
                    self._positions[(t, p)] = off
            self._c.assign(tps)
        else:
            self._c.subscribe(topics, on_assign=self._on_assign, on_revoke=self._on_revoke,
                              on_lost=self._on_lost)

    # -- assignment ---------------------------------------------------------------------------
    def _clamp(self, tp: TP, offset: int) -> int:
        low, high = self.bus._watermarks(*tp)
        return max(low, min(offset, high))

    def _start_offset(self, tp: TP, committed: int | None) -> int:
        """Memory's rule: explicit start offset > committed > reset policy (concrete offsets)."""
        explicit = explicit_offset(self.offsets, *tp)
        if explicit is not None:
            return self._clamp(tp, explicit)
        if committed is not None and committed >= 0:
            return committed
        if self.policy == "latest":
            return self._ends[tp] if tp in self._ends else self.bus._watermarks(*tp)[1]
        return self.bus._watermarks(*tp)[0]

    def _on_assign(self, consumer: _RdConsumer, partitions: list[TopicPartition]) -> None:
        kept, self._kept = self._kept, {}
        need = [TopicPartition(p.topic, p.partition) for p in partitions if (p.topic, p.partition) not in kept]
        committed: dict[TP, int] = {}
        if need:
            try:
                for p in retrying(f"committed offsets of group {self.group}",
                                  lambda t: first_error(consumer.committed(need, timeout=t)), attempt=ATTEMPT_S):
                    if p.error is None and p.offset >= 0:
                        committed[(p.topic, p.partition)] = p.offset
            except BusError as e:
                log.warning("committed offsets of group %s unavailable (%s); using the reset policy",
                            self.group, e)
        positions: dict[TP, int] = {}
        out = []
        for p in partitions:
            tp = (p.topic, p.partition)
            off = kept[tp] if tp in kept else self._start_offset(tp, committed.get(tp))
            positions[tp] = off
            out.append(TopicPartition(p.topic, p.partition, off))
        self._positions = positions
        self._committed = {tp: o for tp, o in {**self._committed, **committed}.items() if tp in positions}
        self._polled = {tp: o for tp, o in self._polled.items() if tp in positions}
        consumer.assign(out)

    def _on_revoke(self, consumer: _RdConsumer, partitions: list[TopicPartition]) -> None:
        self._kept = dict(self._positions)
        self._positions = {}
        consumer.unassign()

    def _on_lost(self, consumer: _RdConsumer, partitions: list[TopicPartition]) -> None:
        # The group moved on without us: another member may own these now; start over.
        self._kept = {}
        self._positions = {}
        self._polled = {}
        consumer.unassign()

    def _on_error(self, err: KafkaError) -> None:
        self.bus._note_auth(err)
        ERRORS.error(log, logging.WARNING, f"client:{err.name()}", f"kafka consumer ({self.group}): {err}")

    # -- consume --------------------------------------------------------------------------------
    def poll(self, timeout: float = 1.0, max_records: int = 500) -> list[Record]:
        if self._closed:
            raise BusError("consumer is closed")
        c = self._c
        try:
            msgs = c.consume(max_records, 0)  # what is already fetched
            if not msgs and timeout > 0:
                first = c.poll(timeout)  # wait for the first record only, as memory does
                if first is not None:
                    msgs = [first]
                    if max_records > 1:
                        msgs += c.consume(max_records - 1, 0)
        except KafkaException as e:
            raise BusError(f"consume failed: {e}") from e
        if msgs:
            self.bus._auth_ok()
        out: list[Record] = []
        positions, polled = self._positions, self._polled
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    continue
                if err.fatal() or not err.retriable():
                    raise BusError(f"consumer of {self.topics}: {err}")
                ERRORS.error(log, logging.WARNING, f"consume:{err.name()}", f"consumer of {self.topics}: {err}")
                continue
            tp = (m.topic(), m.partition())
            if tp not in positions:  # fetched before a revoke: not ours any more
                continue
            off = m.offset()
            positions[tp] = polled[tp] = off + 1
            h = m.headers()
            v = m.value()
            out.append(Record(tp[0], tp[1], off, m.key(), b"" if v is None else v,
                              dict(h) if h else {}, m.timestamp()[1]))
        return out

    def commit(self, records: Iterable[Record] | None = None, *, offsets: dict[TP, int] | None = None) -> None:
        if self.group is None or self._closed:
            return
        upto = commit_targets(records, offsets, self._polled)
        todo = {tp: o for tp, o in upto.items()
                if tp in self._positions and o > self._committed.get(tp, -1)}
        if not todo:
            return
        deadline = time.monotonic() + COMMIT_RETRY_S
        while True:
            try:
                err = self._commit_within(todo, deadline)
            except _Unanswered:
                self.commit_failures += 1
                ERRORS.error(log, logging.WARNING, "commit:unanswered",
                             f"commit of group {self.group} unanswered (the broker holds the connection but does "
                             "not reply); it stays in flight, and later commits are skipped until it ends")
                return
            if err is None:  # _await_inflight noted the offsets
                return
            code = err.code()
            if code in _FENCED:
                # A rebalance (or a broker restart) fenced this member: the group refuses its
                # commit. Nothing to retry: the records are redelivered to whoever owns the
                # partitions next (at least once), and commits resume after the rejoin.
                self.commit_failures += 1
                log.warning("commit of group %s refused (%s): the records will be redelivered", self.group, err)
                return
            if code in TRANSIENT or err.retriable():
                if time.monotonic() < deadline:
                    time.sleep(0.2)  # librdkafka looks the coordinator up meanwhile
                    continue
                self.commit_failures += 1
                log.warning("commit of group %s failed for %.0fs (%s); the next commit retries it",
                            self.group, COMMIT_RETRY_S, err)
                return
            raise BusError(f"commit of group {self.group} failed: {err}")

    def _commit_within(self, todo: dict[TP, int], deadline: float) -> KafkaError | None:
        """One synchronous commit of ``todo`` on a helper thread, waited for until ``deadline``:
        its error, or None; ``_Unanswered`` past the deadline (the commit left in flight) or at
        once while an earlier one is still in flight."""
        if self._inflight is not None:
            self._await_inflight(time.monotonic())  # raises _Unanswered while it still waits
        fut: Future = Future()
        tps = [TopicPartition(t, p, o) for (t, p), o in todo.items()]

        def run() -> None:
            try:
                fut.set_result(self._c.commit(offsets=tps, asynchronous=False))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                fut.set_exception(e)

        self._inflight = (fut, todo)
        threading.Thread(target=run, name=f"rlstream-commit-{self.group}", daemon=True).start()
        return self._await_inflight(deadline)

    def _await_inflight(self, deadline: float) -> KafkaError | None:
        """Wait until ``deadline`` for the commit in flight: its error or None (its offsets
        noted as committed); ``_Unanswered`` if it is still waiting on the broker."""
        fut, todo = self._inflight
        try:
            res = fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            raise _Unanswered from None
        except KafkaException as e:
            err = kafka_error(e)
            if err is None:
                raise BusError(f"commit of group {self.group} failed: {e}") from e
            return err
        finally:
            if fut.done():
                self._inflight = None
        err = next((p.error for p in res or [] if p.error is not None), None)
        if err is None:
            self._note_committed(todo)
        return err

    def _note_committed(self, todo: dict[TP, int]) -> None:
        for tp, o in todo.items():
            if o > self._committed.get(tp, -1):
                self._committed[tp] = o

    def committed(self) -> dict[TP, int]:
        if self.group is None or not self._positions:
            return {}
        tps = [TopicPartition(t, p) for t, p in self._positions]
        res = retrying(f"committed offsets of group {self.group}",
                       lambda t: first_error(self._c.committed(tps, timeout=t)), attempt=ATTEMPT_S)
        return {(p.topic, p.partition): p.offset for p in res if p.error is None and p.offset >= 0}

    def seek(self, topic: str, partition: int, offset: int) -> None:
        tp = (topic, partition)
        if tp not in self._positions:
            raise BusError(f"{tp} is not assigned to this consumer")
        off = self._clamp(tp, offset)
        try:
            self._c.seek(TopicPartition(topic, partition, off))
        except KafkaException as e:
            err = kafka_error(e)
            if err is None or err.code() != KafkaError._STATE:
                raise BusError(f"seek {tp} to {off}: {e}") from e
            # Not fetching yet (just assigned): re-assign with the new start offset instead.
            self._positions[tp] = off
            self._c.assign([TopicPartition(t, p, o) for (t, p), o in self._positions.items()])
        self._positions[tp] = off

    def assignment(self) -> list[TP]:
        return sorted(self._positions)

    def position(self, topic: str, partition: int) -> int | None:
        """The next offset to read: past the last record returned, or past the transaction
        markers after it once librdkafka has fetched them (they are never returned)."""
        tp = (topic, partition)
        if tp not in self._positions:
            return None
        try:
            rd = self._c.position([TopicPartition(topic, partition)])[0].offset
        except KafkaException:
            rd = -1
        return max(self._positions[tp], rd)

    def lag(self) -> dict[TP, int]:
        return {tp: max(0, self.bus._watermarks(*tp)[1] - pos) for tp, pos in self._positions.items()}

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Leave the group and release the client, waiting at most ``timeout`` s: librdkafka's
        close can hang while the broker is gone, so it runs on a daemon thread that is then left
        to finish (or to the process's exit), with one log line."""
        if self._closed:
            return
        self._closed = True
        if self._inflight is not None:
            try:
                self._await_inflight(time.monotonic() + COMMIT_RETRY_S)
            except (_Unanswered, BusError):
                pass
            if self._inflight is not None:
                # Destroying the client under a thread still inside its commit is unsafe: the
                # handle is left to the process's exit; the group drops the member by timeout.
                log.warning("consumer of group %s not closed: a commit is still unanswered", self.group)
                return
        closer = threading.Thread(target=self._close_client, name=f"rlstream-close-{self.group}", daemon=True)
        closer.start()
        closer.join(timeout)
        if closer.is_alive():
            ERRORS.error(log, logging.WARNING, "consumer:close",
                         f"consumer of {self.topics} (group {self.group}) not closed within {timeout:.0f}s "
                         "(broker unreachable?); left to close in the background", connection=False)

    def _close_client(self) -> None:
        try:
            self._c.close()
        except Exception as e:  # noqa: BLE001 - a closing client's error only matters to the log
            log.debug("consumer of %s: close failed: %s", self.topics, e)
