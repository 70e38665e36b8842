"""The bus interface and its backends; ``make_bus`` is the one place a backend is chosen, and
``open_bus`` the bus of a ``config.BusConfig`` (backend, namespace, security, topics created)."""

from __future__ import annotations

from config.bus import BusConfig
from streams.bus.base import Bus, BusError, Consumer, Record, RecordTooLargeError, ReplicationError, StartAt

__all__ = ["Bus", "BusError", "Consumer", "Record", "RecordTooLargeError", "ReplicationError", "StartAt", "kafka_bus", "make_bus",
           "in_namespace", "open_bus"]


def make_bus(kind: str = "memory", **options) -> Bus:
    """``memory`` (in-process, the co-located default) or ``kafka`` (options: bootstrap, config)."""
    if kind == "memory":
        from streams.bus.memory import MemoryBus

        return MemoryBus(**options)
    if kind == "kafka":
        from streams.bus.kafka import KafkaBus

        return KafkaBus(**options)
    raise ValueError(f"unknown bus {kind!r}: use 'memory' or 'kafka'")


def kafka_bus(cfg: BusConfig, client_id: str = "rlstream", transactional_id: str | None = None) -> Bus:
    """A Kafka bus on ``cfg``'s brokers with its client security settings and the replication of
    the topics it creates (not namespaced); ``transactional_id``: its writes are transactions of
    that identity (``KafkaBus``)."""
    extra = {"transactional_id": transactional_id} if transactional_id else {}
    return make_bus("kafka", bootstrap=cfg.bootstrap, config=dict(cfg.security), client_id=client_id,
                    **cfg.replication.bus_options(), **extra)


def in_namespace(bus: Bus, namespace: str) -> Bus:
    """``bus`` under run namespace ``namespace`` ("": as it is, the legacy names)."""
    from streams.topics import Namespace

    ns = Namespace(namespace)
    if not ns.name:
        return bus
    from streams.bus.namespaced import NamespacedBus

    return NamespacedBus(bus, ns)


def writer_id(namespace: str, writer: str) -> str:
    """The Kafka ``transactional.id`` of ``writer`` in run namespace ``namespace``."""
    return f"rlstream.{namespace or '-'}.{writer}"


def open_bus(cfg: BusConfig, writer: str | None = None) -> Bus:
    """The bus of ``cfg`` in its namespace (roles use logical topic names), every topic created.
    ``writer``: a stable identity of the one writer it stands for (the learner's run and rank):
    on Kafka its writes are transactions under that identity, so a newer writer of it fences
    this one; the memory bus has a single process and needs no fence."""
    from streams.topics import all_topics

    specs = all_topics(cfg.partitions, cfg.retention)  # refuses a retention of an unknown topic
    if cfg.kind == "memory":
        bus = make_bus("memory", path=cfg.log_dir)
    elif cfg.kind == "kafka":
        bus = kafka_bus(cfg, transactional_id=None if writer is None else writer_id(cfg.namespace, writer))
    else:
        raise ValueError(f"unknown bus {cfg.kind!r}")
    bus = in_namespace(bus, cfg.namespace)
    bus.create_topics(specs)
    return bus
