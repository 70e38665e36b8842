"""``KafkaBus``: the ``Bus`` on Kafka. Over ``KafkaAdmin`` it adds the producer side (``produce``;
``flush``, which raises what failed delivery and waits out a broker outage), its consumers
(``streams.bus.kafka.consumer``) and ``close``."""

from __future__ import annotations

import logging
import time
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from streams.bus.base import Bus, BusError, RecordTooLargeError, StartAt, normalise_start
from streams.bus.kafka.admin import KafkaAdmin
from streams.bus.kafka.consumer import KafkaConsumer
from streams.bus.kafka.errors import ERRORS, LOG_INTERVAL_S, kafka_error

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
        if self._fatal is not None:
            raise BusError(f"kafka producer failed fatally: {self._fatal}")
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
        if on_delivery is not None:  # the record's own report, beside the bus's accounting
            kw["on_delivery"] = self._reporting(on_delivery)
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
                size = len(value) + (len(key) if key else 0)
                if _too_large(err):
                    raise RecordTooLargeError(
                        f"record of {size} bytes exceeds message.max.bytes={self.max_message_bytes} on {topic}"
                    ) from e
                raise BusError(f"produce to {topic} failed: {e}") from e
        self._produced += 1
        self._producer.poll(0)

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
        if self._fatal is not None:
            raise BusError(f"kafka producer failed fatally: {self._fatal}")
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
            self.flush(timeout)
        finally:
            if self._meta is not None:
                self._meta.close()
                self._meta = None
            for reader in self._group_readers.values():
                reader.close()
            self._group_readers.clear()

