"""``KafkaBus``: the ``Bus`` on Kafka. Over ``KafkaAdmin`` it adds the producer side (``produce``;
``flush``, which raises what failed delivery and waits out a broker outage), its consumers
(``streams.bus.kafka.consumer``) and ``close``.

Made with a ``transactional_id`` (the learner's: run and rank), the records produced between two
flushes are one Kafka transaction, begun by the first produce and committed by the flush. Readers
read committed only, so a writer that a newer one of the same id has fenced (its
``init_transactions`` bumped the epoch) cannot add to the log, even by a late packet of a killed
process: the broker refuses it and the old writer gets ``WriterFencedError``."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from streams.bus.base import Bus, BusError, RecordTooLargeError, StartAt, WriterFencedError, normalise_start
from streams.bus.kafka.admin import KafkaAdmin
from streams.bus.kafka.consumer import KafkaConsumer
from streams.bus.kafka.errors import (
    ERRORS,
    FENCED_WRITER,
    LOG_INTERVAL_S,
    AbortableError,
    fenced,
    kafka_error,
    transaction_call,
)

log = logging.getLogger("streams.bus.kafka")  # the whole Kafka bus logs under one name

_TOO_LARGE = {KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE}


def _too_large(err: KafkaError | None) -> bool:
    return err is not None and err.code() in _TOO_LARGE


class KafkaBus(KafkaAdmin, Bus):
    """The ``Bus`` on Kafka (the package docstring says how memory's semantics map onto it)."""

    name = "kafka"

    # -- produce ----------------------------------------------------------------------------
    def produce(self, topic, value, key=None, headers=None, partition=None, on_delivery=None) -> None:
        if self._closed:
            raise BusError("bus is closed")
        self._raise_fatal()
        if not isinstance(value, bytes):
            if not isinstance(value, (bytearray, memoryview)):
                raise TypeError(f"value must be bytes, not {type(value).__name__}")
            value = bytes(value)
        if topic not in self._known:
            self._partitions(topic)
        kw: dict[str, Any] = {"value": value, "key": key}
        if headers:
            kw["headers"] = headers
        if partition is not None:
            kw["partition"] = partition
        if self.transactional_id:
            self._begin()
            self._send(topic, kw)
            self._txn.append((topic, kw, on_delivery))  # kept until the commit: an aborted one is written again
            return
        if on_delivery is not None:  # the record's own report, beside the bus's accounting
            kw["on_delivery"] = self._reporting(on_delivery)
        self._send(topic, kw)

    def _send(self, topic: str, kw: dict[str, Any]) -> None:
        deadline = None
        while True:
            try:
                self._producer.produce(topic, **kw)
                break
            except BufferError:  # local queue full: serve delivery reports until there is room
                deadline = deadline or time.monotonic() + self.produce_timeout
                if time.monotonic() > deadline:
                    raise BusError(f"producer queue stayed full for {self.produce_timeout:.0f}s "
                                   f"(broker {self.bootstrap} slow or down)") from None
                self._producer.poll(0.05)
            except KafkaException as e:
                err = kafka_error(e)
                value, key = kw["value"], kw.get("key")
                size = len(value) + (len(key) if key else 0)
                if _too_large(err):
                    raise RecordTooLargeError(
                        f"record of {size} bytes exceeds message.max.bytes={self.max_message_bytes} on {topic}"
                    ) from e
                if err is not None and self.transactional_id and err.code() in FENCED_WRITER:
                    raise fenced(self.transactional_id, err) from e
                raise BusError(f"produce to {topic} failed: {e}") from e
        self._produced += 1
        self._producer.poll(0)

    def _raise_fatal(self) -> None:
        if self._fatal is None:
            return
        if self.transactional_id and self._fatal.code() in FENCED_WRITER:
            raise fenced(self.transactional_id, self._fatal)
        raise BusError(f"kafka producer failed fatally: {self._fatal}")

    # -- transactions (a bus made with ``transactional_id``) ---------------------------------
    def _begin(self) -> None:
        if not self._txn_open:
            transaction_call("begin_transaction", self.transactional_id,
                             lambda _t: self._producer.begin_transaction(), time.monotonic())
            self._txn_open = True

    def _commit(self, timeout: float) -> None:
        """Commit the open transaction: retriable errors are retried, and an abortable one
        aborts it and writes its records again, until ``timeout`` (+ ``outage_wait``) is spent;
        fenced: ``WriterFencedError``. The records' ``on_delivery`` hear of the outcome."""
        deadline = time.monotonic() + timeout + self.outage_wait
        tid = self.transactional_id
        try:
            while True:
                try:
                    transaction_call(f"commit of a transaction of {tid}", tid, self._producer.commit_transaction,
                                     deadline, attempt=timeout)
                    break
                except AbortableError as e:
                    ERRORS.error(log, logging.WARNING, "txn:abort", f"kafka producer {tid}: {e}; aborting the "
                                 f"transaction and writing its {len(self._txn)} record(s) again", connection=False)
                    transaction_call(f"abort of a transaction of {tid}", tid, self._producer.abort_transaction,
                                     deadline, attempt=timeout)
                    self._txn_open = False
                    with self._lock:
                        failed, self._failed, self._unraised = self._failed, [], 0
                    if any(_too_large(err) for _, err in failed):
                        raise RecordTooLargeError(f"{e} (record over the topic's max.message.bytes?)") from e
                    if time.monotonic() >= deadline:
                        raise BusError(f"transaction of {tid} not committed within {timeout:.0f}s "
                                       f"(+{self.outage_wait:.0f}s): {e}") from e
                    self._begin()
                    for topic, kw, _ in self._txn:
                        self._send(topic, kw)
        except WriterFencedError:
            self._fenced = True
            self._settle_txn("fenced: a newer writer took over")
            raise
        except BusError as e:
            with contextlib.suppress(KafkaException):  # leave nothing open; the caller hears of the failure
                self._producer.abort_transaction(5.0)
            self._settle_txn(str(e))
            raise
        self._settle_txn(None)
        ERRORS.recovered(self.bootstrap)

    def _settle_txn(self, error: str | None) -> None:
        """The open transaction is over: tell its records' ``on_delivery`` and forget them."""
        records, self._txn, self._txn_open = self._txn, [], False
        with self._lock:
            self._failed, self._unraised = [], 0
        self._produced = 0
        for _, _, report in records:
            if report is not None:
                report(error)

    def _reporting(self, on_delivery):
        """A record's delivery callback: the bus's own (failures counted and raised by ``flush``),
        then ``on_delivery(None or the error's text)``."""
        def report(err, msg) -> None:
            self._on_delivery(err, msg)
            on_delivery(None if err is None else f"{err.name()}: {err.str()}")
        return report

    def flush(self, timeout: float = 30.0) -> None:
        if self._producer_client is None:
            return  # nothing was ever produced
        if self.transactional_id:
            self._raise_fatal()
            if self._txn_open:  # the records since the last flush are one transaction
                self._commit(timeout)
            return
        queued = len(self._producer)  # records, and events such as error callbacks
        produced = self._produced
        began = time.monotonic()
        left = self._producer.flush(timeout)
        waited = 0.0
        # an outage: connection errors not recovered from, or any during this flush or the timeout before it (a call that
        # reached a live node of a cluster missing others recovers the log, while the records
        # for the missing ones wait: below min.insync.replicas, tests/faults/test_cluster_faults.py)
        if left and self.outage_wait > 0 and (ERRORS.outage() or ERRORS.seen_since(began - timeout)):
            log.warning("%d record(s) not delivered within %.0fs: Kafka at %s unreachable or short of "
                        "in-sync replicas, waiting up to %.0fs more", left, timeout, self.bootstrap, self.outage_wait)
            deadline = time.monotonic() + self.outage_wait
            said, waited = time.monotonic(), self.outage_wait
            while left and time.monotonic() < deadline:
                self.check_auth()
                left = self._producer.flush(1.0)
                if left and time.monotonic() - said >= LOG_INTERVAL_S:  # not silent while it waits
                    said = time.monotonic()
                    log.warning("%d record(s) still not delivered to %s; giving up in %.0fs", left,
                                self.bootstrap, max(0.0, deadline - said))
        with self._lock:
            failed, self._failed = self._failed, []
            count, self._unraised = self._unraised, 0
        if failed:
            self._produced = 0
            first_topic, first = failed[0]
            kinds = sorted({e.name() for _, e in failed})
            msg = (f"{count} record(s) failed delivery ({', '.join(kinds)}); first on {first_topic}: "
                   f"{first.str()}")
            if any(_too_large(e) for _, e in failed):
                raise RecordTooLargeError(msg + " (record over the topic's max.message.bytes?)")
            raise BusError(msg)
        self._raise_fatal()
        if left:
            self.check_auth()
            raise BusError(f"{left} record(s) not delivered within {timeout}s to {self.bootstrap}"
                           + (f" and {waited:.0f}s more while it was unreachable" if waited else ""))
        if queued:
            self._auth_ok()
        if produced:  # records reached the broker (not only callbacks served): a round trip
            self._produced -= produced
            ERRORS.recovered(self.bootstrap)

    # -- consume ----------------------------------------------------------------------------
    def consumer(self, group: str | None, topics: list[str], start: StartAt = "earliest") -> KafkaConsumer:
        if self._closed:
            raise BusError("bus is closed")
        policy, offsets = normalise_start(start, topics)
        parts = {t: self._partitions(t) for t in topics}
        return KafkaConsumer(self, group, list(topics), policy, offsets, parts)

    def close(self, timeout: float = 30.0) -> None:
        """Flush (raising what failed) and release the clients."""
        if self._closed:
            return
        self._closed = True
        try:
            if not (self._fenced or (self._fatal is not None and self._fatal.code() in FENCED_WRITER)):
                # (a fenced writer has nothing it could still deliver)
                self.flush(timeout)
        finally:
            if self._meta is not None:
                self._meta.close()
                self._meta = None
            for reader in self._group_readers.values():
                reader.close()
            self._group_readers.clear()

