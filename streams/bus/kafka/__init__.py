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

Modules: ``errors`` (error log, classification, ``retrying``, the error classes), ``clients``
(client settings, the lazy librdkafka clients, the login check), ``admin`` (topics, groups,
offsets), ``producer`` (``KafkaBus``: produce, flush, close) and ``consumer`` (``KafkaConsumer``).
"""

from streams.bus.base import ReplicationError
from streams.bus.kafka.clients import BROKER_WAIT_S
from streams.bus.kafka.consumer import KafkaConsumer
from streams.bus.kafka.errors import FewerPartitionsError, NoBrokerError, TopicNotFoundError
from streams.bus.kafka.producer import KafkaBus

__all__ = ["BROKER_WAIT_S", "FewerPartitionsError", "KafkaBus", "KafkaConsumer", "NoBrokerError",
           "ReplicationError", "TopicNotFoundError"]
