"""The Faust shell's per-actor state: ``TableState`` (the reorder and dedup state in a Faust
table, written through its changelog) and ``raw_partitions_of`` (how many partitions that table
gets: those of rl.samples.raw)."""

from __future__ import annotations

import logging
from collections.abc import Iterator, MutableMapping
from typing import Any

from streams.settings import StreamsSettings
from streams.topics import SAMPLES_RAW

log = logging.getLogger("streams.faust_app")  # the whole Faust shell logs under one name


def raw_partitions_of(settings: StreamsSettings, timeout: float = 5.0) -> int:
    """Partitions of the namespace's rl.samples.raw on the broker; ``topic_partitions`` (what
    Faust creates it with) when it does not exist or the broker does not answer in time."""
    try:
        from confluent_kafka.admin import AdminClient

        # quiet: a broker that is down is this fallback's expected case, said once below
        admin = AdminClient({"bootstrap.servers": settings.brokers, **settings.client_config, "log_level": 0})
        topic = settings.namespace.topic(SAMPLES_RAW)
        meta = admin.list_topics(topic, timeout=timeout).topics.get(topic)
        if meta is not None and meta.error is None and meta.partitions:
            return len(meta.partitions)
    except Exception as e:
        log.warning("could not read the partitions of %s: %r", SAMPLES_RAW, e)
    return settings.topic_partitions


class TableState(MutableMapping):
    """Per-actor state (``ReorderBuffer``'s ``state``) in a Faust Table: reads and writes the
    table's local store, and queues each change as a changelog record of the actor's partition
    (the value's ``"p"``); ``flush`` sends them. Writes need no stream context, so a timer's
    reorder release can change state too. On a rebalance Faust restores the changelog of the
    partitions a worker gains, so the state follows the actor."""

    def __init__(self, table: Any) -> None:
        self.table = table
        self.pending: dict[str, tuple[int, dict | None]] = {}

    def __getitem__(self, key: str) -> dict:
        return self.table.data[key]

    def __setitem__(self, key: str, value: dict) -> None:
        self.table.data[key] = value
        self.pending[key] = (int(value.get("p", -1)), value)

    def __delitem__(self, key: str) -> None:
        value = self.table.data.pop(key)
        self.pending[key] = (int(value.get("p", -1)), None)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.table.data.keys()))

    def __len__(self) -> int:
        return len(self.table.data)

    async def flush(self) -> None:
        """Send the queued changes and wait until each is written; what fails stays queued."""
        sent = dict(self.pending)
        futs = [self.table.send_changelog(partition, key, value, value_serializer="raw" if value is None else None)
                for key, (partition, value) in sent.items() if partition >= 0]  # None: a tombstone
        for fut in futs:
            await fut
        for key, change in sent.items():
            if self.pending.get(key) is change:
                del self.pending[key]
