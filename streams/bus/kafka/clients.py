"""The Kafka bus's clients: the librdkafka settings of each role (``PRODUCER_DEFAULTS``,
``CONSUMER_DEFAULTS``, ``REPLICATED_CLIENT_DEFAULTS``), librdkafka's log collapsed through
``ERRORS``, the TCP check that a broker is there at all (``broker_unreachable``), and
``KafkaClients``: the bus's settings, its producer and admin client made on first use, their
error callbacks and the refused-login check (``check_auth``)."""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from typing import Any

from confluent_kafka import Consumer as _RdConsumer, KafkaError, Producer as _RdProducer
from confluent_kafka.admin import AdminClient

from config.env import check_kafka_security
from config.limits import DEFAULT_BOOTSTRAP, MAX_MESSAGE_BYTES

from streams.bus.base import BusAuthenticationError, BusError
from streams.bus.kafka.errors import ERRORS, NoBrokerError, transaction_call
from streams.bus.kafka.produce_errors import PRODUCE_DEBUG, PRODUCE_ERRORS

log = logging.getLogger("streams.bus.kafka")  # the whole Kafka bus logs under one name
_rdlog = logging.getLogger("rlstream.librdkafka")  # librdkafka's own log lines, not stderr
_RD_NOISE = re.compile(r"\[thrd:[^\]]*\]:\s*|\d+")


class _RdLogger:
    """librdkafka's log lines (the clients' ``logger``) into ``rlstream.librdkafka``, collapsed
    by kind (facility + text without numbers) through ``ERRORS``."""

    def log(self, level: int, fmt: str, *args: Any) -> None:
        fac, text = (args[0], args[-1]) if len(args) >= 3 else ("", fmt % args if args else fmt)
        PRODUCE_ERRORS.note(fac, str(text))  # a produce request's error code, counted by name
        if level < logging.WARNING or _says_refused(str(text)):  # a refusal: check_auth says it, once
            _rdlog.log(logging.DEBUG if level >= logging.WARNING else level, fmt, *args)
            return
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
    "delivery.report.only.error": False,  # a record's on_delivery hears of its acknowledgement too
    "debug": PRODUCE_DEBUG,  # the only report of the produce errors librdkafka retries (produce_errors.py)
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
    "isolation.level": "read_committed",  # librdkafka's default, stated: a fenced or aborted write is never read
}

#: A transactional producer's ``transaction.timeout.ms``. Past it the broker aborts an open
#: transaction and fences its writer (librdkafka reports ``_FENCED``, as for a newer instance),
#: so it is longer than a flush can take (its timeout + ``OUTAGE_WAIT_S``): a flush gives up
#: first. A writer killed inside a transaction holds back read_committed readers of its
#: partitions until its successor's ``init_transactions`` aborts it, or at most this long.
TRANSACTION_TIMEOUT_MS = 180_000

#: Every client's settings on a replicated cluster (factor above 1), where a partition's leader
#: can die while its followers carry on. librdkafka learns of the new leader only from a metadata
#: refresh, which a failed reconnect to the dead one triggers; its reconnect backoff grows to 10 s
#: by default, so a producer to a SIGKILLed leader sat idle ~10 s after the cluster had already
#: moved leadership (tests/faults/test_cluster_faults.py). At most 1 s between tries bounds that.
REPLICATED_CLIENT_DEFAULTS: dict[str, Any] = {"reconnect.backoff.max.ms": 1000}

# A flush that times out while the broker is unreachable (a restart) waits this much longer for
# the broker: librdkafka keeps the records queued, they are delivered once it is back.
OUTAGE_WAIT_S = 120.0
# A refused login or TLS handshake that persists this long (nothing succeeding meanwhile) fails
# the operation waiting on the broker with BusAuthenticationError; shorter ones (a broker that
# has not loaded its SCRAM credentials yet) are ridden out.
AUTH_GRACE_S = 2.0
_KEEP_ERRORS = 100  # delivery errors kept for the report in flush (all are counted)

#: How long a bus's first call waits for any bootstrap address to accept a TCP connection before
#: ``NoBrokerError``: a broker that is (re)starting is waited for, a missing one said within seconds.
BROKER_WAIT_S = 3.0


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


#: What librdkafka says when a TLS handshake is refused (an untrusted broker certificate, a
#: client certificate the broker wants and did not get or does not trust, TLS to a plaintext
#: listener). ``_SSL`` errors always are; a ``_TRANSPORT`` error only with one of these.
_TLS_REFUSED = ("SSL handshake failed", "certificate verify failed", "alert certificate required",
                "alert bad certificate", "alert unknown ca", "alert handshake failure")
_AFTER = re.compile(r"\s*\(after \d+ms in state [A-Z_]+\)$")


def _says_refused(text: str) -> bool:
    """Does a librdkafka log line report a refused login or TLS handshake?"""
    return "SASL authentication error" in text or any(t in text for t in _TLS_REFUSED)


def _quiet(err: KafkaError, refusal_pending: bool) -> bool:
    """Leave ``err`` to ``check_auth`` (logged at debug): a refused login or TLS handshake, or
    every broker down because of one."""
    return not err.fatal() and (refused_security(err) is not None
                                or (refusal_pending and err.code() == KafkaError._ALL_BROKERS_DOWN))


def refused_security(err: KafkaError) -> str | None:
    """``"login"`` when ``err`` is the broker refusing the SASL credentials, ``"tls"`` when it is a
    refused TLS handshake (``_TLS_REFUSED``), else None."""
    code = err.code()
    if code == KafkaError._AUTHENTICATION:
        return "login"
    if code == KafkaError._SSL or (code == KafkaError._TRANSPORT and any(t in err.str() for t in _TLS_REFUSED)):
        return "tls"
    return None


def refusal_message(bootstrap: str, conf: dict[str, Any], err: KafkaError) -> str:
    """One line: what Kafka at ``bootstrap`` refused, with the settings in use (never a password
    or a key's), librdkafka's reason, and the variables to check."""
    tls = refused_security(err) == "tls"
    keys = (("security.protocol", "ssl.ca.location", "ssl.certificate.location", "ssl.endpoint.identification.algorithm")
            if tls else ("security.protocol", "sasl.mechanism", "sasl.mechanisms", "sasl.username"))
    used = ", ".join(f"{k}={conf[k]}" for k in keys if k in conf) or "no security settings"
    reason = _AFTER.sub("", err.str())
    if tls:
        return (f"Kafka at {bootstrap} refused the TLS connection ({used}): {reason}; check "
                "RLSTREAM_KAFKA_SSL_CA_LOCATION (the CA that signed the broker's certificate) and, where the "
                "broker asks for one, RLSTREAM_KAFKA_SSL_CERTIFICATE_LOCATION / RLSTREAM_KAFKA_SSL_KEY_LOCATION")
    return (f"Kafka at {bootstrap} refused the credentials ({used}): {reason}; "
            "check RLSTREAM_KAFKA_SECURITY_PROTOCOL and RLSTREAM_KAFKA_SASL_* / RLSTREAM_KAFKA_SSL_*")


class KafkaClients:
    """What every part of ``KafkaBus`` stands on: its settings, its librdkafka producer and
    admin client (made once a broker accepts a connection), their callbacks and the
    refused-login check."""

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
        transactional_id: str | None = None,
    ) -> None:
        """``replication_factor`` -1 takes the broker's default, and ``min_insync_replicas``
        None the broker's ``min.insync.replicas``, for the topics this bus creates (a topic spec's
        own ``min.insync.replicas`` wins); ``auto_create`` creates a topic
        met in produce/consume that does not exist (its ``streams.topics`` spec, else 1
        partition), as memory does; ``produce_timeout`` bounds waiting on a full local queue;
        ``outage_wait``: how much longer ``flush`` waits while the broker is unreachable;
        ``transactional_id``: write in transactions under this stable identity (the records of
        each ``flush`` are one transaction), so a newer producer of that identity fences this one
        (``KafkaBus`` says how)."""
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
        self.transactional_id = transactional_id
        txn = {"transactional.id": transactional_id, "transaction.timeout.ms": TRANSACTION_TIMEOUT_MS} \
            if transactional_id else {}
        pconf = {**PRODUCER_DEFAULTS, **self.common, **txn, **(producer_config or {})}
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
        self._txn: list[tuple[str, dict[str, Any], Any]] = []  # the open transaction's records
        self._txn_open = False
        self._fenced = False  # a newer producer of ``transactional_id`` took over

    # -- clients, made once a broker accepts a connection ----------------------------------
    def _reach(self) -> None:
        """Raise ``BusAuthenticationError`` for security settings no client could use (a SASL
        protocol without a password, a CA file that is not there: ``check_kafka_security``), and
        ``NoBrokerError`` unless some bootstrap address accepts a TCP connection within
        ``BROKER_WAIT_S``; checked once per bus, before its first client is made."""
        if self._reached:
            return
        try:
            check_kafka_security({k: str(v) for k, v in self.common.items() if isinstance(v, str)})
        except ValueError as e:
            raise BusAuthenticationError(f"cannot connect to Kafka at {self.bootstrap}: {e}") from None
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
                    producer = _RdProducer(self._pconf)
                    if self.transactional_id:
                        self._init_transactions(producer)
                    self._producer_client = producer
        return self._producer_client

    def _init_transactions(self, producer: _RdProducer) -> None:
        """Register this producer's transactional identity: the broker aborts what an earlier
        producer of it left open and fences that one for good. Retried through a settling
        coordinator for ``produce_timeout`` + ``outage_wait`` seconds."""
        transaction_call(f"init_transactions of {self.transactional_id}", self.transactional_id,
                         producer.init_transactions, time.monotonic() + self.produce_timeout + self.outage_wait)
        log.info("kafka producer %s: transactional, epoch registered", self.transactional_id)

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
        if _quiet(err, self._auth_error is not None):  # check_auth raises it, with the settings in use
            log.debug("kafka producer: %s", err)
            return
        if err.fatal():
            self._fatal = err
            log.error("kafka producer fatal error: %s", err)
        else:
            ERRORS.error(log, logging.WARNING, f"client:{err.name()}", f"kafka producer: {err}")

    def _on_client_error(self, err: KafkaError) -> None:
        self._note_auth(err)
        if _quiet(err, self._auth_error is not None):  # check_auth raises it, with the settings in use
            log.debug("kafka client: %s", err)
            return
        ERRORS.error(log, logging.WARNING, f"client:{err.name()}", f"kafka client: {err}")

    # -- authentication ---------------------------------------------------------------------
    def _note_auth(self, err: KafkaError) -> None:
        """Remember a refused login or TLS handshake (any client's error callback): librdkafka
        only logs it and retries forever, so without this a wrong password or an untrusted
        certificate looks like a broker that times out."""
        if refused_security(err) is not None:
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
        raise BusAuthenticationError(refusal_message(self.bootstrap, self.common, err))

    def settle_auth(self) -> None:
        """Before failing with another error (a timeout): if a refused login or TLS handshake
        is pending, wait out the rest of its ``AUTH_GRACE_S`` (a success meanwhile clears it) and
        raise ``BusAuthenticationError`` if it still holds: the refusal is the reason."""
        deadline = time.monotonic() + AUTH_GRACE_S + 0.5
        while self._auth_error is not None and time.monotonic() < deadline:
            self.check_auth()
            time.sleep(0.05)

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

