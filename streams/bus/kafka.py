"""Kafka bus: the ``Bus`` interface on confluent-kafka (librdkafka), same semantics as memory.

    bus = KafkaBus("127.0.0.1:9092")
    bus.create_topics(all_topics())
    bus.produce(SAMPLES_RAW, value, key=b"actor-0")
    bus.flush()                                        # raises BusError if any delivery failed
    with bus.consumer("learner", [SAMPLES_PREPARED]) as c:
        recs = c.poll(0.1)
        c.commit(recs)

How the memory semantics (``streams.bus.base``) map onto Kafka:

- producer: idempotent (``enable.idempotence``, ``acks=all``), so retries never duplicate or
  reorder a partition, and a write is acknowledged once every in-sync replica has it (at least
  the topic's ``min.insync.replicas``: a broker lost after the acknowledgement loses nothing). Delivery failures are collected by the delivery callback and raised
  by the next ``flush`` (``RecordTooLargeError`` for oversize records); ``delivery_failures``
  counts them all. A record over the client's ``message.max.bytes`` fails at ``produce``.
- partitioner ``murmur2_random``: the Java/aiokafka default, so the Faust app and this bus
  put one key on one partition.
- group consumers subscribe with the eager protocol; the rebalance callback sets every newly
  assigned partition's start offset by memory's rule: kept position (partition retained
  across a rebalance) > explicit ``start`` offset > committed offset > reset policy. Offsets
  are never auto-committed. ``"latest"`` means the log end when ``consumer()`` was called
  (as in memory), not when the group join finishes seconds later.
- ``commit`` outlives broker restarts: errors while the group coordinator is unreachable are
  retried for ``COMMIT_RETRY_S``, and no commit blocks its caller longer than that: librdkafka's
  synchronous commit has no timeout and waits for ever on a broker that holds the connection
  but does not answer (a network partition, a stopped process), so it runs on a helper thread;
  one left unanswered stays in flight (one at most; later commits are skipped until it ends,
  and a later commit carries their offsets) and counts in ``commit_failures``. A commit the
  group refuses because it fenced this member (``UNKNOWN_MEMBER_ID``/``ILLEGAL_GENERATION``
  after a rebalance or a broker restart) is dropped with a warning (``commit_failures`` counts
  both): the records are redelivered, at least once, as after a crash. Other commit errors
  raise ``BusError``.
- topics are created with ``replication_factor`` copies and ``min.insync.replicas`` (the
  run's ``config.bus.Replication``: ``RLSTREAM_REPLICATION_FACTOR``,
  ``RLSTREAM_MIN_INSYNC_REPLICAS``); a factor above the number of brokers alive is refused with
  ``ReplicationError`` before any topic is asked for.
- admin, metadata and offset calls retry the errors of a settling cluster (no leader elected yet
  after a create, a coordinator loading, leadership moving, a request timed out; ``RETRIABLE``)
  until their deadline (``retrying``); ``create_topics`` returns once every partition has a leader.
  A ``flush`` that times out while the broker is unreachable waits ``outage_wait`` more (a broker
  restart): the records stay queued in librdkafka and are delivered once it is back.
- client errors (error callbacks, librdkafka's log, consume errors) are logged once per kind per
  ``LOG_INTERVAL_S`` with a count of the repeats, and one line says when the connection recovered
  (``ErrorLog``): a broker outage does not flood the logs.
- a refused login (wrong SASL credentials) makes an operation that fails or times out raise
  ``BusAuthenticationError``, naming the settings in use, instead of a bare timeout
  (librdkafka only logs the refusal and retries); ``create_topics``, the first call of every
  role (``rlstream.wiring.build_bus``), fails that way within about ``AUTH_GRACE_S``.
- no broker at all: the first call that needs the cluster first tries a TCP connection to the
  bootstrap addresses for ``BROKER_WAIT_S`` and raises ``NoBrokerError`` ("no Kafka broker at
  X; start one with rlstream broker start") if none accepts one; the librdkafka clients are
  made only after that, so nothing is logged before it. Once a broker was reached, an outage
  is retried as above.
- ``group=None`` readers take every partition with ``assign`` (no group join, no commit), under
  a unique throw-away ``group.id``.
- explicit and ``seek`` offsets are clamped into [low, high] watermark, as memory clamps.

Client settings: ``config`` goes to every client (producer, consumer, admin): the security
settings (``config.BusConfig.security``, from ``RLSTREAM_KAFKA_*`` at the entry point) and any
other; ``producer_config`` and ``consumer_config`` go to one role only.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Any

from confluent_kafka import (
    Consumer as _RdConsumer,
    KafkaError,
    KafkaException,
    Producer as _RdProducer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic

from config.limits import DEFAULT_BOOTSTRAP, MAX_MESSAGE_BYTES

from streams.bus.base import (
    TP,
    Bus,
    BusAuthenticationError,
    BusError,
    Consumer,
    Record,
    RecordTooLargeError,
    ReplicationError,
    StartAt,
    explicit_offset,
    normalise_start,
)
from streams.offsets import next_offsets
from streams.topics import TOPICS, Namespace, TopicSpec, describe_namespaces, namespaces_in

log = logging.getLogger(__name__)
_rdlog = logging.getLogger("rlstream.librdkafka")  # librdkafka's own log lines, not stderr
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
_RD_NOISE = re.compile(r"\[thrd:[^\]]*\]:\s*|\d+")


class _RdLogger:
    """librdkafka's log lines (the clients' ``logger``) into ``rlstream.librdkafka``, collapsed
    by kind (facility + text without numbers) through ``ERRORS``."""

    def log(self, level: int, fmt: str, *args: Any) -> None:
        fac, text = (args[0], args[-1]) if len(args) >= 3 else ("", fmt % args if args else fmt)
        if level < logging.WARNING:
            _rdlog.log(level, fmt, *args)
            return
        ERRORS.error(_rdlog, level, f"{fac}:{_RD_NOISE.sub('#', str(text))}", fmt % args if args else fmt)


_RD_LOGGER = _RdLogger()

PRODUCER_DEFAULTS: dict[str, Any] = {
    "enable.idempotence": True,
    "acks": "all",
    "partitioner": "murmur2_random",
    "compression.type": "none",  # the payload is packed float32: it does not compress
    "linger.ms": 5,
    "batch.size": 4 * 1024 * 1024,
    "batch.num.messages": 10000,
    "queue.buffering.max.kbytes": 512 * 1024,
    "queue.buffering.max.messages": 200000,
    "message.max.bytes": MAX_MESSAGE_BYTES,
    "delivery.report.only.error": True,  # success needs no callback: flush waits for it
}

CONSUMER_DEFAULTS: dict[str, Any] = {
    "enable.auto.commit": False,
    "enable.auto.offset.store": False,
    "enable.partition.eof": False,
    "session.timeout.ms": 10000,
    "heartbeat.interval.ms": 1000,
    "fetch.wait.max.ms": 100,
    "fetch.max.bytes": 64 * 1024 * 1024,
    "max.partition.fetch.bytes": MAX_MESSAGE_BYTES,
    "receive.message.max.bytes": 64 * 1024 * 1024 + 1024 * 1024,
    "queued.max.messages.kbytes": 128 * 1024,
}

#: Every client's settings on a replicated cluster (factor above 1), where a partition's leader
#: can die while its followers carry on. librdkafka learns of the new leader only from a metadata
#: refresh, which a failed reconnect to the dead one triggers; its reconnect backoff grows to 10 s
#: by default, so a producer to a SIGKILLed leader sat idle ~10 s after the cluster had already
#: moved leadership (tests/faults/test_cluster_faults.py). At most 1 s between tries bounds that.
REPLICATED_CLIENT_DEFAULTS: dict[str, Any] = {"reconnect.backoff.max.ms": 1000}

_TIMEOUT = 10.0  # seconds, for metadata / offset / commit requests
#: Seconds one offset or metadata request may take before it is asked again. A request to a leader
#: or coordinator that was just SIGKILLed waits out its whole timeout; asked again, it goes where
#: the refreshed metadata says. Uncapped, the learner's lag reading held it 10 s after a broker's
#: death (tests/faults/test_cluster_faults.py).
_ATTEMPT_S = 2.5


def _err(e: BaseException) -> KafkaError | None:
    if isinstance(e, KafkaException) and e.args and isinstance(e.args[0], KafkaError):
        return e.args[0]
    return None


_TOO_LARGE = {KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE}
# Commit errors of a member the group no longer knows (rebalance, broker restart): dropped.
_FENCED = {KafkaError.UNKNOWN_MEMBER_ID, KafkaError.ILLEGAL_GENERATION, KafkaError.REBALANCE_IN_PROGRESS,
           KafkaError.FENCED_INSTANCE_ID}
# Commit errors while the coordinator is unreachable or moving: retried for COMMIT_RETRY_S.
_TRANSIENT = {KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaError.NOT_COORDINATOR,
              KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError.REQUEST_TIMED_OUT, KafkaError._TRANSPORT,
              KafkaError._TIMED_OUT, KafkaError._WAIT_COORD, KafkaError._ALL_BROKERS_DOWN}
COMMIT_RETRY_S = 10.0
# A flush that times out while the broker is unreachable (a restart) waits this much longer for
# the broker: librdkafka keeps the records queued, they are delivered once it is back.
OUTAGE_WAIT_S = 120.0
# Errors of a cluster that is settling, not of a wrong request: a partition whose leader is not
# elected yet (or moved) right after a create or a restart, a topic not yet in every broker's
# metadata, a group coordinator loading its offsets, a request that timed out. Every admin,
# metadata and offset call retries them until its deadline (``retrying``).
RETRIABLE = {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
             KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_PARTITION, KafkaError._UNKNOWN_TOPIC,
             KafkaError.FENCED_LEADER_EPOCH, KafkaError.UNKNOWN_LEADER_EPOCH, KafkaError.OFFSET_NOT_AVAILABLE,
             KafkaError.NOT_ENOUGH_REPLICAS, *_TRANSIENT}
# A refused login that persists this long (nothing succeeding meanwhile) fails the operation
# waiting on the broker with BusAuthenticationError; shorter ones (a broker that has not loaded
# its SCRAM credentials yet) are ridden out.
AUTH_GRACE_S = 2.0
_KEEP_ERRORS = 100  # delivery errors kept for the report in flush (all are counted)


def _too_large(err: KafkaError | None) -> bool:
    return err is not None and err.code() in _TOO_LARGE


def _first_error(tps: list[TopicPartition]) -> Any:
    """``tps``, or the first retriable per-partition error among them (for ``retrying``)."""
    return next((tp.error for tp in tps if is_retriable(tp.error)), tps)


def is_retriable(err: KafkaError | None) -> bool:
    """Whether a call that failed with ``err`` may succeed if simply repeated (``RETRIABLE``, or
    librdkafka flagged it so); never for a fatal error."""
    return err is not None and not err.fatal() and (err.code() in RETRIABLE or err.retriable())


#: How long topic creation asks again when the cluster lists fewer brokers than the replication
#: factor before refusing (``KafkaBus._check_replication``; CI once saw 2 of 3 just after start).
REGISTRATION_GRACE_S = 5.0


def retrying(what: str, call: Any, timeout: float = _TIMEOUT, on_retry: Any = None,
             attempt: float | None = None) -> Any:
    """``call(seconds)`` until it returns, retrying retriable Kafka errors (raised as
    ``KafkaException``, or a ``KafkaError`` it returns in place of a result) with backoff until
    ``timeout`` has passed; then, or on any other Kafka error, ``BusError`` naming ``what``.
    ``seconds`` is what remains of ``timeout``, at most ``attempt`` (``_ATTEMPT_S`` for a request
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
            err, exc = _err(e), e
        if not is_retriable(err) or time.monotonic() + pause > deadline:
            raise BusError(f"{what}: {exc}") from exc
        if on_retry is not None:
            on_retry()
        log.debug("%s: %s; retrying", what, err)
        time.sleep(pause)
        pause = min(pause * 2, 0.5)


#: How long a bus's first call waits for any bootstrap address to accept a TCP connection before
#: ``NoBrokerError``: a broker that is (re)starting is waited for, a missing one said within seconds.
BROKER_WAIT_S = 3.0
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


def bootstrap_addresses(bootstrap: str) -> list[tuple[str, int]]:
    """``"h1:9092,PLAINTEXT://h2:9094,[::1]:9096"`` -> [(host, port)]; a missing port is 9092."""
    out = []
    for item in filter(None, (x.strip() for x in bootstrap.split(","))):
        item = item.split("://", 1)[-1]
        host, sep, port = item.rpartition(":")
        if not sep or not port.isdigit() or host.endswith(":"):  # no port (or a bare IPv6 address)
            host, port = item, "9092"
        out.append((host.strip("[]"), int(port)))
    return out


def broker_unreachable(bootstrap: str, wait_s: float = BROKER_WAIT_S) -> str | None:
    """None as soon as one bootstrap address accepts a TCP connection, else (after ``wait_s``)
    why none did."""
    addresses = bootstrap_addresses(bootstrap)
    if not addresses:
        return "no bootstrap address"
    deadline = time.monotonic() + wait_s
    while True:
        why = ""
        for host, port in addresses:
            try:
                with socket.create_connection((host, port), timeout=min(1.0, max(0.1, wait_s))):
                    return None
            except OSError as e:
                why = f"{host}:{port}: {e.strerror or e}"
        if time.monotonic() >= deadline:
            return why
        time.sleep(0.25)


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


class KafkaBus(Bus):
    name = "kafka"

    def __init__(
        self,
        bootstrap: str | None = None,
        config: dict | None = None,
        client_id: str = "rlstream",
        producer_config: dict | None = None,
        consumer_config: dict | None = None,
        auto_create: bool = True,
        replication_factor: int = -1,
        produce_timeout: float = 30.0,
        outage_wait: float = OUTAGE_WAIT_S,
        min_insync_replicas: int | None = None,
    ) -> None:
        """``replication_factor`` -1 takes the broker's default, and ``min_insync_replicas``
        None the broker's ``min.insync.replicas``, for the topics this bus creates (a topic spec's
        own ``min.insync.replicas`` wins); ``auto_create`` creates a topic
        met in produce/consume that does not exist (its ``streams.topics`` spec, else 1
        partition), as memory does; ``produce_timeout`` bounds waiting on a full local queue;
        ``outage_wait``: how much longer ``flush`` waits while the broker is unreachable."""
        self.bootstrap = bootstrap or DEFAULT_BOOTSTRAP
        self.client_id = client_id
        self.auto_create = auto_create
        self.replication_factor = replication_factor
        self.min_insync_replicas = min_insync_replicas
        self.produce_timeout = produce_timeout
        self.outage_wait = outage_wait
        self.common = {"bootstrap.servers": self.bootstrap, "client.id": client_id, "logger": _RD_LOGGER,
                       **(REPLICATED_CLIENT_DEFAULTS if replication_factor > 1 else {}), **(config or {})}
        self.consumer_config = {**CONSUMER_DEFAULTS, **self.common, **(consumer_config or {})}
        pconf = {**PRODUCER_DEFAULTS, **self.common, **(producer_config or {})}
        self.producer_config = dict(pconf)  # effective settings, for reports
        pconf["on_delivery"] = self._on_delivery
        pconf["error_cb"] = self._on_error
        self.max_message_bytes = int(pconf["message.max.bytes"])
        self._pconf = pconf
        self.admin_config = dict(self.common)
        # The librdkafka clients are made on first use, once a broker answers (``_reach``).
        self._producer_client: _RdProducer | None = None
        self._admin_client: AdminClient | None = None
        self._reached = False
        self._clients_lock = threading.Lock()
        self._lock = threading.Lock()
        self._failed: list[tuple[str, KafkaError]] = []  # delivery failures not yet raised
        self._unraised = 0  # how many: _failed keeps the first _KEEP_ERRORS
        self.delivery_failures = 0  # every failed delivery since the bus was made
        self._fatal: KafkaError | None = None
        self._auth_error: KafkaError | None = None  # the broker refused our credentials...
        self._auth_since = 0.0  # ...since then, with nothing succeeding meanwhile
        self._known: dict[str, int] = {}  # topic -> partitions, seen in metadata
        self._meta: _RdConsumer | None = None  # for watermark queries
        self._group_readers: dict[str, _RdConsumer] = {}  # group -> committed-offset reader (group_lag)
        self._produced = 0  # records produced since the last flush that delivered them all
        self._closed = False

    # -- clients, made once a broker accepts a connection ----------------------------------
    def _reach(self) -> None:
        """Raise ``NoBrokerError`` unless some bootstrap address accepts a TCP connection within
        ``BROKER_WAIT_S``; checked once per bus, before its first client is made."""
        if self._reached:
            return
        why = broker_unreachable(self.bootstrap)
        if why is not None:
            raise NoBrokerError(self.bootstrap, why)
        self._reached = True

    @property
    def _producer(self) -> _RdProducer:
        if self._producer_client is None:
            with self._clients_lock:
                if self._producer_client is None:
                    self._reach()
                    self._producer_client = _RdProducer(self._pconf)
        return self._producer_client

    @property
    def _admin(self) -> AdminClient:
        if self._admin_client is None:
            with self._clients_lock:
                if self._admin_client is None:
                    self._reach()
                    self._admin_client = AdminClient({**self.admin_config, "error_cb": self._on_client_error})
        return self._admin_client

    # -- callbacks (run inside producer.poll/flush) ----------------------------------------
    def _on_delivery(self, err: KafkaError | None, msg: Any) -> None:
        if err is None:
            return
        with self._lock:
            self.delivery_failures += 1
            self._unraised += 1
            if len(self._failed) < _KEEP_ERRORS:
                self._failed.append((msg.topic() or "?", err))
        ERRORS.error(log, logging.WARNING, f"delivery:{msg.topic()}:{err.name()}",
                     f"kafka delivery to {msg.topic()} failed: {err}", connection=False)

    def _on_error(self, err: KafkaError) -> None:
        self._note_auth(err)
        if err.fatal():
            self._fatal = err
            log.error("kafka producer fatal error: %s", err)
        else:
            ERRORS.error(log, logging.WARNING, f"client:{err.name()}", f"kafka producer: {err}")

    def _on_client_error(self, err: KafkaError) -> None:
        self._note_auth(err)
        ERRORS.error(log, logging.WARNING, f"client:{err.name()}", f"kafka client: {err}")

    # -- authentication ---------------------------------------------------------------------
    def _note_auth(self, err: KafkaError) -> None:
        """Remember a refused login (any client's error callback): librdkafka only logs it and
        retries forever, so without this a wrong password looks like a broker that times out."""
        if err.code() == KafkaError._AUTHENTICATION:
            if self._auth_error is None:
                self._auth_since = time.monotonic()
            self._auth_error = err

    def _auth_ok(self) -> None:
        """Something succeeded: a refused login seen before was transient (a broker starting)."""
        self._auth_error = None

    def check_auth(self) -> None:
        """Raise ``BusAuthenticationError`` if the broker has refused our credentials for
        ``AUTH_GRACE_S`` with nothing succeeding since (the message names the settings in use,
        never the password)."""
        if self._admin_client is not None:
            self._admin_client.poll(0)  # serve the admin client's error callbacks
        err = self._auth_error
        if err is None or time.monotonic() - self._auth_since < AUTH_GRACE_S:
            return
        c = self.common
        used = ", ".join(f"{k}={c[k]}" for k in ("security.protocol", "sasl.mechanism", "sasl.mechanisms",
                                                   "sasl.username") if k in c) or "no security settings"
        raise BusAuthenticationError(
            f"Kafka at {self.bootstrap} refused the credentials ({used}): {err.str()}; "
            "check RLSTREAM_KAFKA_SECURITY_PROTOCOL and RLSTREAM_KAFKA_SASL_* / RLSTREAM_KAFKA_SSL_*")

    def _wait(self, fut: Any, timeout: float) -> Any:
        """``fut.result()``, failing fast with ``BusAuthenticationError`` on a refused login."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return fut.result(timeout=0.2)
            except TimeoutError:
                self.check_auth()
                if time.monotonic() > deadline:
                    raise BusError(f"no answer from {self.bootstrap} within {timeout:.0f}s") from None

    # -- topics -----------------------------------------------------------------------------
    def create_topics(self, specs: Iterable[TopicSpec], timeout: float = 30.0) -> None:
        specs = list(specs)
        if not specs:
            return
        new = []
        for s in specs:
            config = {k: str(v) for k, v in s.config.items()}
            if s.compacted:
                config.setdefault("cleanup.policy", "compact")
            if self.min_insync_replicas is not None:
                config.setdefault("min.insync.replicas", str(self.min_insync_replicas))
            new.append(NewTopic(s.name, num_partitions=max(1, s.partitions),
                                replication_factor=self.replication_factor, config=config))
        pending = {t.topic: t for t in new}
        if self.replication_factor > 1:
            self._check_replication([s.name for s in specs], timeout)

        def attempt(left: float) -> KafkaError | None:
            retry = None
            futures = self._admin.create_topics(list(pending.values()), request_timeout=left,
                                                operation_timeout=left)
            for name, fut in futures.items():
                try:
                    self._wait(fut, left + 5)
                except KafkaException as e:
                    err = _err(e)
                    if is_retriable(err):
                        retry = err
                        continue
                    if err is None or err.code() != KafkaError.TOPIC_ALREADY_EXISTS:
                        self.check_auth()
                        raise BusError(f"cannot create topic {name}: {e}") from e
                del pending[name]
            return retry

        retrying(f"cannot create topics {sorted(pending)}", attempt, timeout, on_retry=self.check_auth)
        self._auth_ok()
        self._wait_topics({s.name: max(1, s.partitions) for s in specs}, timeout)

    def _check_replication(self, names: list[str], timeout: float) -> None:
        """Raise ``ReplicationError`` if a topic of ``names`` does not exist yet and the cluster
        has fewer brokers alive than ``replication_factor`` (topics that exist are left alone: a
        role restarting while one broker is down carries on). Too few brokers are asked about
        again for ``REGISTRATION_GRACE_S``: each broker learns of the others on its own time, so
        one asked just after ``rlstream broker start`` may not list them all yet."""
        grace = time.monotonic() + min(REGISTRATION_GRACE_S, timeout)
        while True:
            md = retrying("cannot read the cluster's metadata",
                          lambda left: self._admin.list_topics(timeout=max(left, 1.0)), timeout,
                          on_retry=self.check_auth)
            missing = [n for n in names if n not in md.topics or md.topics[n].error is not None]
            if not missing or len(md.brokers) >= self.replication_factor:
                return
            if time.monotonic() >= grace:
                raise ReplicationError(self.replication_factor, len(md.brokers), self.bootstrap, missing)
            time.sleep(0.25)

    def add_partitions(self, topic: str, total: int, timeout: float = 30.0) -> None:
        """Grow ``topic`` to ``total`` partitions (Kafka cannot shrink one). Keys hash to new
        partitions afterwards: run it between runs, when no actor is producing."""
        from confluent_kafka.admin import NewPartitions

        if self._partitions(topic, create=False) < total:
            for fut in self._admin.create_partitions([NewPartitions(topic, total)],
                                                     request_timeout=timeout).values():
                self._wait(fut, timeout + 5)
            self._known.pop(topic, None)
        self._wait_topics({topic: total}, timeout, growing=True)

    def delete_topics(self, names: Iterable[str], timeout: float = 30.0) -> None:
        """Delete topics (benchmarks and tests clean up after themselves); missing ones are fine."""
        names = list(names)
        if not names:
            return
        for name, fut in self._admin.delete_topics(names, operation_timeout=timeout,
                                                   request_timeout=timeout).items():
            try:
                fut.result()
            except KafkaException as e:
                err = _err(e)
                if err is None or err.code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                    raise BusError(f"cannot delete topic {name}: {e}") from e
            self._known.pop(name, None)

    def reset_topics(self, specs: Iterable[TopicSpec], groups: Iterable[str] = (), timeout: float = 60.0) -> None:
        """Delete the topics of ``specs`` and the consumer ``groups`` (their committed offsets),
        wait until the broker has forgotten them, and create the topics afresh: a clean slate for
        a test or benchmark that uses the fixed ``streams.topics`` names on a shared broker.
        Destructive: whatever those topics held is gone. Groups with live members are left as
        they are (a warning is logged)."""
        specs = list(specs)
        names = [s.name for s in specs]
        self.delete_topics(names, timeout=timeout)
        deadline = time.monotonic() + timeout
        while True:  # deletion is asynchronous: a name is reusable once metadata no longer has it
            try:
                present = set(self._admin.list_topics(timeout=min(5.0, timeout)).topics)
            except KafkaException:
                present = set(names)
            left = present & set(names)
            if not left:
                break
            if time.monotonic() > deadline:
                raise BusError(f"topics {sorted(left)} still exist {timeout:.0f}s after deletion")
            time.sleep(0.1)
        groups = list(groups)
        if groups:
            for group, fut in self._admin.delete_consumer_groups(groups, request_timeout=timeout).items():
                try:
                    fut.result()
                except KafkaException as e:
                    err = _err(e)
                    if err is None or err.code() not in (KafkaError.GROUP_ID_NOT_FOUND, KafkaError.NOT_COORDINATOR):
                        log.warning("consumer group %s not deleted: %s", group, e)
        while True:
            try:
                self.create_topics(specs, timeout=timeout)
                return
            except BusError as e:  # the controller may still be finishing the deletion
                if "TOPIC_ALREADY_EXISTS" not in str(e) and "marked for deletion" not in str(e) \
                        or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _wait_topics(self, want: dict[str, int], timeout: float, growing: bool = False) -> None:
        """Poll metadata until every topic has a leader for each of (at least) its partitions:
        ``create_topics`` returns only then, so the first produce or offset read finds them. An
        existing topic with fewer partitions raises ``FewerPartitionsError`` (``growing``: waits
        for the ones being added)."""
        deadline = time.monotonic() + timeout
        pending = dict(want)
        while True:
            for name in list(pending):
                try:
                    md = self._admin.list_topics(topic=name, timeout=min(5.0, timeout)).topics.get(name)
                except KafkaException:
                    md = None
                if md is not None and md.error is None and md.partitions and all(
                    p.leader >= 0 and p.error is None for p in md.partitions.values()
                ):
                    if len(md.partitions) < pending[name]:
                        if growing:
                            continue
                        raise FewerPartitionsError(name, len(md.partitions), pending[name])
                    self._known[name] = len(md.partitions)
                    del pending[name]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise BusError(f"topics {sorted(pending)} have no leader after {timeout:.0f}s")
            time.sleep(0.05)

    def _partitions(self, topic: str, create: bool | None = None) -> int:
        """Partition count of ``topic``; creates it (auto_create) when missing."""
        n = self._known.get(topic)
        if n is not None:
            return n
        try:
            md = retrying(f"cannot read metadata of {topic} from {self.bootstrap}",
                          lambda t: self._admin.list_topics(topic=topic, timeout=t).topics.get(topic),
                          on_retry=self.check_auth, attempt=_ATTEMPT_S)
        except BusError:
            self.check_auth()
            raise
        if md is not None and md.error is None and md.partitions:
            self._known[topic] = len(md.partitions)
            return self._known[topic]
        if md is not None and md.error is not None and md.error.code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
            raise BusError(f"metadata of {topic}: {md.error}")
        if not (self.auto_create if create is None else create):
            raise BusError(f"unknown topic {topic!r}")
        spec = TOPICS.get(topic) or TopicSpec(topic, key="", partitions=1)
        self.create_topics([spec])
        return self._known[topic]

    def partitions(self, topic: str) -> int:
        return self._partitions(topic)

    # -- what the cluster holds (the tools: ``rlstream lag``, the namespace checks) --------------
    def topic_names(self, timeout: float = _TIMEOUT) -> set[str]:
        """Every topic on the cluster."""
        md = retrying(f"cannot list the topics at {self.bootstrap}", lambda t: self._admin.list_topics(timeout=t),
                      timeout, on_retry=self.check_auth, attempt=_ATTEMPT_S)
        return {name for name, t in md.topics.items() if t.error is None}

    def require_topics(self, names: Iterable[str], namespace: str = "") -> None:
        """Raise ``TopicNotFoundError`` (naming the namespaces the cluster has) unless every topic
        of ``names`` (full names, in ``namespace``) exists; creates nothing."""
        have = self.topic_names()
        missing = [n for n in names if n not in have]
        if missing:
            raise TopicNotFoundError(missing, self.bootstrap, namespace, namespaces_in(have))

    def _admin_call(self, what: str, request: Any, timeout: float = _TIMEOUT) -> Any:
        """The result of the admin future ``request(seconds)`` returns, retried as ``retrying`` does.
        Admin group requests are for tools run while a broker answers (``group_positions``, which
        the roles use during outages, avoids them: confluentinc/librdkafka#4605)."""
        return retrying(what, lambda t: self._wait(request(t), t + 5), timeout, on_retry=self.check_auth,
                        attempt=_ATTEMPT_S)

    def consumer_groups(self) -> dict[str, str]:
        """Group id -> state (``stable``, ``empty``...) of every consumer group on the cluster."""
        def request(t: float) -> Any:
            return self._admin.list_consumer_groups(request_timeout=t)

        res = self._admin_call(f"cannot list the consumer groups at {self.bootstrap}", request)
        if res.errors:
            raise BusError(f"cannot list every consumer group at {self.bootstrap}: {res.errors[0]}")
        return {g.group_id: g.state.name.lower() for g in res.valid}

    def describe_group(self, group: str) -> tuple[str, dict[TP, dict[str, str]]]:
        """``(state, {(topic, partition): {consumer_id, host, client_id}})``: the partitions the
        group's members are assigned now, and who has each."""
        desc = self._admin_call(f"cannot describe consumer group {group}",
                                lambda t: self._admin.describe_consumer_groups([group], request_timeout=t)[group])
        owners: dict[TP, dict[str, str]] = {}
        for m in desc.members:
            for tp in (m.assignment.topic_partitions if m.assignment is not None else []):
                owners[(tp.topic, tp.partition)] = {"consumer_id": m.member_id, "host": m.host,
                                                    "client_id": m.client_id}
        return desc.state.name.lower(), owners

    def group_offsets(self, group: str) -> dict[TP, int]:
        """``(topic, partition) -> offset`` committed by ``group``, on every topic it committed on."""
        from confluent_kafka import ConsumerGroupTopicPartitions

        res = self._admin_call(
            f"cannot read committed offsets of group {group}",
            lambda t: self._admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)],
                                                              request_timeout=t)[group])
        return {(tp.topic, tp.partition): tp.offset for tp in res.topic_partitions or []
                if tp.error is None and tp.offset >= 0}

    def log_end(self, topic: str, partition: int) -> int:
        """The partition's high watermark: the offset the next record will get."""
        return self._watermarks(topic, partition)[1]

    def log_start(self, topic: str, partition: int) -> int:
        """The partition's low watermark: its oldest offset still held (retention moves it up)."""
        return self._watermarks(topic, partition)[0]

    def _watermarks(self, topic: str, partition: int) -> tuple[int, int]:
        if self._meta is None:
            self._reach()
            with self._lock:
                if self._meta is None:
                    self._meta = _RdConsumer({**self.consumer_config, "group.id": f"rlstream-meta-{uuid.uuid4().hex}"})
        tp = TopicPartition(topic, partition)

        def refresh() -> None:
            """Before asking again: fresh metadata. The request goes to the leader librdkafka has
            cached, which a timeout does not refresh; a SIGKILLed leader kept the learner's lag
            reading waiting 15 s after leadership had moved."""
            self.check_auth()
            try:
                self._meta.list_topics(topic=topic, timeout=_ATTEMPT_S)
            except KafkaException:
                pass  # the next attempt retries, or fails with the reason

        try:
            return retrying(f"cannot read offsets of {topic}[{partition}]",
                            lambda t: self._meta.get_watermark_offsets(tp, timeout=t, cached=False),
                            on_retry=refresh, attempt=_ATTEMPT_S)
        except BusError:
            self.check_auth()
            raise

    def end_offsets(self, topic: str) -> dict[int, int]:
        return {p: self._watermarks(topic, p)[1] for p in range(self._partitions(topic))}

    def group_lag(self, group: str, topic: str) -> int:
        """End offsets minus the group's positions (``group_positions``)."""
        ends = self.end_offsets(topic)
        return sum(ends[p] - pos for p, pos in self.group_positions(group, topic).items())

    def group_positions(self, group: str, topic: str) -> dict[int, int]:
        """Partition -> where ``group`` resumes reading ``topic``: its committed offset, or the
        log start where it has none.

        The committed offsets come from a consumer of that ``group.id`` that never subscribes
        (an OffsetFetch; it does not join the group), not from the admin API: admin group
        requests that time out while the broker is down abort the process in librdkafka
        (confluentinc/librdkafka#4605), and the lag is read while the broker may be down."""
        parts = range(self._partitions(topic))
        self._reach()
        with self._lock:
            reader = self._group_readers.get(group)
            if reader is None:
                reader = self._group_readers[group] = _RdConsumer(
                    {**self.consumer_config, "group.id": group, "error_cb": self._on_client_error})
        res = retrying(f"cannot read committed offsets of group {group} on {topic}",
                       lambda t: _first_error(reader.committed([TopicPartition(topic, p) for p in parts], timeout=t)),
                       attempt=_ATTEMPT_S)
        committed = {tp.partition: tp.offset for tp in res if tp.error is None}
        return {p: committed[p] if committed.get(p, -1) >= 0 else self._watermarks(topic, p)[0] for p in parts}

    # -- produce ----------------------------------------------------------------------------
    def produce(self, topic, value, key=None, headers=None, partition=None) -> None:
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
                err = _err(e)
                size = len(value) + (len(key) if key else 0)
                if _too_large(err):
                    raise RecordTooLargeError(
                        f"record of {size} bytes exceeds message.max.bytes={self.max_message_bytes} on {topic}"
                    ) from e
                raise BusError(f"produce to {topic} failed: {e}") from e
        self._produced += 1
        self._producer.poll(0)

    def flush(self, timeout: float = 30.0) -> None:
        if self._producer_client is None:
            return  # nothing was ever produced
        queued = len(self._producer)  # records, and events such as error callbacks
        produced = self._produced
        left = self._producer.flush(timeout)
        waited = 0.0
        if left and self.outage_wait > 0 and ERRORS.outage():
            log.warning("%d record(s) not delivered within %.0fs: broker %s unreachable, waiting up to "
                        "%.0fs more", left, timeout, self.bootstrap, self.outage_wait)
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
    def consumer(self, group: str | None, topics: list[str], start: StartAt = "earliest") -> "KafkaConsumer":
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


class _Unanswered(Exception):
    """A commit got no answer before its deadline; it is still in flight."""


class KafkaConsumer(Consumer):
    def __init__(self, bus: KafkaBus, group: str | None, topics: list[str], policy: str,
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
                                  lambda t: _first_error(consumer.committed(need, timeout=t)), attempt=_ATTEMPT_S):
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
        if offsets is not None:
            upto = dict(offsets)
        elif records is None:
            upto = dict(self._polled)
        else:
            upto = next_offsets(records)
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
            if code in _TRANSIENT or err.retriable():
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
            err = _err(e)
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
                       lambda t: _first_error(self._c.committed(tps, timeout=t)), attempt=_ATTEMPT_S)
        return {(p.topic, p.partition): p.offset for p in res if p.error is None and p.offset >= 0}

    def seek(self, topic: str, partition: int, offset: int) -> None:
        tp = (topic, partition)
        if tp not in self._positions:
            raise BusError(f"{tp} is not assigned to this consumer")
        off = self._clamp(tp, offset)
        try:
            self._c.seek(TopicPartition(topic, partition, off))
        except KafkaException as e:
            err = _err(e)
            if err is None or err.code() != KafkaError._STATE:
                raise BusError(f"seek {tp} to {off}: {e}") from e
            # Not fetching yet (just assigned): re-assign with the new start offset instead.
            self._positions[tp] = off
            self._c.assign([TopicPartition(t, p, o) for (t, p), o in self._positions.items()])
        self._positions[tp] = off

    def assignment(self) -> list[TP]:
        return sorted(self._positions)

    def lag(self) -> dict[TP, int]:
        return {tp: max(0, self.bus._watermarks(*tp)[1] - pos) for tp, pos in self._positions.items()}

    def close(self) -> None:
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
        self._c.close()
