"""The Kafka bus's errors and retries: client errors logged once per kind per interval
(``ErrorLog``, ``ERRORS``), the classification of Kafka errors (``RETRIABLE``, ``TRANSIENT``,
``is_retriable``), ``retrying`` (a call repeated through a settling cluster until its deadline),
and the bus's own error classes (``NoBrokerError``, ``TopicNotFoundError``, ``FewerPartitionsError``)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from streams.bus.base import BusError, WriterFencedError
from streams.topics import describe_namespaces

log = logging.getLogger("streams.bus.kafka")  # the whole Kafka bus logs under one name
LOG_INTERVAL_S = 10.0  # repeated client errors of one kind: one line per interval, with a count


class ErrorLog:
    """Client errors of this process, collapsed: the first of a kind is logged at once, the
    repeats within ``interval`` seconds are counted into the next line of that kind, and one
    line says when the connection recovered (``recovered()``, called on a successful round trip).
    A broker outage so logs a few lines, not one per reconnect attempt of every client."""

    def __init__(self, interval: float = LOG_INTERVAL_S) -> None:
        self.interval = interval
        self._lock = threading.Lock()
        self._kinds: dict[str, list] = {}  # kind -> [time of its last line, repeats since then]
        self._errors = 0  # since the last recovery
        self._first = 0.0
        self._recovered_at = -interval  # when the last "recovered" line was logged
        self._last_at = -float("inf")  # when the last connection error came, recovered or not
        self.count = 0  # every error reported, logged or not

    def error(self, logger: logging.Logger, level: int, kind: str, text: str, connection: bool = True) -> None:
        """Log ``text`` unless ``kind`` was logged less than ``interval`` ago (then count it).
        ``connection``: the error is of the connection, so a later round trip is its recovery."""
        now = time.monotonic()
        with self._lock:
            if connection:
                if not self._errors:
                    self._first = now
                self._errors += 1
                self._last_at = now
            self.count += 1
            seen = self._kinds.get(kind)
            if seen is not None and now - seen[0] < self.interval:
                seen[1] += 1
                return
            repeats = seen[1] if seen is not None else 0
            self._kinds[kind] = [now, 0]
        more = f" (+{repeats} more like it in {self.interval:.0f}s)" if repeats else ""
        logger.log(level, "%s%s", text, more)

    def outage(self) -> bool:
        """Connection errors since the last recovery (the broker may be unreachable)."""
        return self._errors > 0

    def seen_since(self, t: float) -> bool:
        """A connection error came at or after ``t`` (``time.monotonic()``), whether or not a
        round trip has recovered since: on a cluster that has lost some nodes, a call that reaches
        a live one recovers the log while records for the others still wait."""
        return self._last_at >= t

    def recovered(self, where: str = "") -> None:
        """A round trip succeeded: log the recovery, at most once per interval (a connection that
        flaps while the broker restarts adds its errors to the next line)."""
        if not self._errors:  # the common case, without the lock
            return
        now = time.monotonic()
        with self._lock:
            if now - self._recovered_at < self.interval:
                return
            self._recovered_at = now
            errors, first, self._errors = self._errors, self._first, 0
            repeats = sum(k[1] for k in self._kinds.values())
            self._kinds.clear()
        if errors:
            log.warning("kafka connection%s recovered after %d client error(s) over %.1fs (%d not logged)",
                        f" to {where}" if where else "", errors, time.monotonic() - first, repeats)


ERRORS = ErrorLog()

REQUEST_TIMEOUT = 10.0  # seconds, for metadata / offset / commit requests
#: Seconds one offset or metadata request may take before it is asked again. A request to a leader
#: or coordinator that was just SIGKILLed waits out its whole timeout; asked again, it goes where
#: the refreshed metadata says. Uncapped, the learner's lag reading held it 10 s after a broker's
#: death (tests/faults/test_cluster_faults.py).
ATTEMPT_S = 2.5


def kafka_error(e: BaseException) -> KafkaError | None:
    """The ``KafkaError`` a ``KafkaException`` carries, else None."""
    if isinstance(e, KafkaException) and e.args and isinstance(e.args[0], KafkaError):
        return e.args[0]
    return None


# Commit errors while the coordinator is unreachable or moving: retried for COMMIT_RETRY_S (the consumer's).
TRANSIENT = {KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaError.NOT_COORDINATOR,
             KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError.REQUEST_TIMED_OUT, KafkaError._TRANSPORT,
             KafkaError._TIMED_OUT, KafkaError._WAIT_COORD, KafkaError._ALL_BROKERS_DOWN}
# Errors of a cluster that is settling, not of a wrong request: a partition whose leader is not
# elected yet (or moved) right after a create or a restart, a topic not yet in every broker's
# metadata, a group coordinator loading its offsets, a request that timed out. Every admin,
# metadata and offset call retries them until its deadline (``retrying``).
RETRIABLE = {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
             KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_PARTITION, KafkaError._UNKNOWN_TOPIC,
             KafkaError.FENCED_LEADER_EPOCH, KafkaError.UNKNOWN_LEADER_EPOCH, KafkaError.OFFSET_NOT_AVAILABLE,
             KafkaError.NOT_ENOUGH_REPLICAS, *TRANSIENT}


def first_error(tps: list[TopicPartition]) -> Any:
    """``tps``, or the first retriable per-partition error among them (for ``retrying``)."""
    return next((tp.error for tp in tps if is_retriable(tp.error)), tps)


def is_retriable(err: KafkaError | None) -> bool:
    """Whether a call that failed with ``err`` may succeed if simply repeated (``RETRIABLE``, or
    librdkafka flagged it so); never for a fatal error."""
    return err is not None and not err.fatal() and (err.code() in RETRIABLE or err.retriable())


def retrying(what: str, call: Any, timeout: float = REQUEST_TIMEOUT, on_retry: Any = None,
             attempt: float | None = None) -> Any:
    """``call(seconds)`` until it returns, retrying retriable Kafka errors (raised as
    ``KafkaException``, or a ``KafkaError`` it returns in place of a result) with backoff until
    ``timeout`` has passed; then, or on any other Kafka error, ``BusError`` naming ``what``.
    ``seconds`` is what remains of ``timeout``, at most ``attempt`` (``ATTEMPT_S`` for a request
    that a dead leader would hold). ``on_retry()`` runs before each retry (it may raise, e.g.
    ``BusAuthenticationError``)."""
    deadline = time.monotonic() + timeout
    pause = 0.05
    while True:
        left = max(0.1, deadline - time.monotonic())
        if attempt is not None:
            left = min(left, attempt)
        try:
            out = call(left)
            err = out if isinstance(out, KafkaError) else None
            if err is None:
                ERRORS.recovered()
                return out
            exc: BaseException = KafkaException(err)
        except KafkaException as e:
            err, exc = kafka_error(e), e
        if not is_retriable(err) or time.monotonic() + pause > deadline:
            raise BusError(f"{what}: {exc}") from exc
        if on_retry is not None:
            on_retry()
        log.debug("%s: %s; retrying", what, err)
        time.sleep(pause)
        pause = min(pause * 2, 0.5)


#: A transactional producer's errors that mean a newer producer of its identity has taken over.
FENCED_WRITER = {KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH}


class AbortableError(BusError):
    """The open transaction failed but the producer can go on: abort it and write it again."""


def fenced(transactional_id: str, err: KafkaError) -> WriterFencedError:
    return WriterFencedError(
        f"a newer writer with transactional id {transactional_id!r} has started (a restarted learner of this "
        f"run and rank): this one is fenced and stops, its unfinished transaction aborted ({err.str()})")


def transaction_call(what: str, transactional_id: str, call: Any, deadline: float,
                     attempt: float | None = None) -> None:
    """``call(seconds)``, one transaction API call of librdkafka, repeated while it fails
    retriably and ``deadline`` (``time.monotonic()``) is ahead, each try given at most
    ``attempt`` seconds (a retry is logged, collapsed). Raises ``WriterFencedError`` when fenced,
    ``AbortableError`` when the transaction must be aborted, else ``BusError``."""
    pause = 0.05
    while True:
        left = max(0.1, deadline - time.monotonic())
        try:
            call(left if attempt is None else min(left, attempt))
            return
        except KafkaException as e:
            err = kafka_error(e)
            if err is None:
                raise BusError(f"{what}: {e}") from e
            if err.code() in FENCED_WRITER:
                raise fenced(transactional_id, err) from e
            if err.fatal():
                raise BusError(f"{what}: fatal producer error: {err.str()}") from e
            if err.txn_requires_abort():
                raise AbortableError(f"{what}: {err.str()}") from e
            if not err.retriable() or time.monotonic() + pause > deadline:
                raise BusError(f"{what}: {err.str()}") from e
            ERRORS.error(log, logging.WARNING, f"txn:{err.name()}", f"{what}: {err.str()}; retrying for up to "
                         f"{max(0.0, deadline - time.monotonic()):.0f}s more", connection=False)
            time.sleep(pause)
            pause = min(pause * 2, 0.5)


#: What to do about a missing broker, for ``NoBrokerError``.
START_BROKER = "rlstream broker start"


class NoBrokerError(BusError):
    """Nothing accepts a connection at any of the bootstrap addresses: no broker to retry."""

    def __init__(self, bootstrap: str, why: str = "") -> None:
        super().__init__(f"no Kafka broker at {bootstrap}; start one with {START_BROKER}")
        self.bootstrap, self.why = bootstrap, why


class TopicNotFoundError(BusError):
    """A tool's topic is not on the broker in the namespace it reads; names the namespaces there."""

    def __init__(self, topics: list[str], bootstrap: str, namespace: str, namespaces: list[str]) -> None:
        where = f"namespace {namespace!r}" if namespace else "no namespace: the legacy unscoped names"
        there = (f"namespaces with rlstream topics there: {describe_namespaces(namespaces)}; choose one with "
                 "--namespace NS (or RLSTREAM_NAMESPACE), or name the run with --run-dir RUN"
                 if namespaces else "the broker holds no rlstream topics: has a run been started on it?")
        super().__init__(f"no topic {', '.join(topics)} on the Kafka broker at {bootstrap} ({where}); {there}")
        self.topics, self.namespace, self.namespaces = topics, namespace, namespaces


class FewerPartitionsError(BusError):
    """A topic exists with fewer partitions than asked (``--partitions``). Kafka cannot shrink
    a topic, and adding partitions moves keys (actor ids) to other partitions, so per-actor order
    across the change would not hold: use a new namespace, or add them between runs on purpose
    (``KafkaBus.add_partitions``; docs/howto/scale-out.md)."""

    def __init__(self, topic: str, have: int, want: int) -> None:
        super().__init__(
            f"topic {topic} exists with {have} partition(s), {want} asked (--partitions {want}); "
            f"start a new namespace (--namespace) for {want}, or add partitions to the existing "
            f"topic between runs (KafkaBus.add_partitions / kafka-topics.sh --alter --partitions {want}): "
            f"records already written stay where they are and new ones of a key may land on another "
            f"partition, so per-actor order holds only after the change (docs/howto/scale-out.md)")
        self.topic, self.have, self.want = topic, have, want
