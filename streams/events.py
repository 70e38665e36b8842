"""Typed events over the bus: publish dataclass events, consume decoded ones, and dead-letter
every record that cannot be decoded or is invalid — with the reason, never silently.

    events = EventBus(bus, codec, metrics=m)
    events.publish(SAMPLES_RAW, batch, key=batch.actor_id)
    c = events.consumer("learner", [SAMPLES_PREPARED], stage="learner", expect=PreparedBatch)
    for rec, ev in c.poll(0.1):
        ...
    c.commit()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from schemas.codec import Codec
from schemas.errors import CodecError
from schemas.events import DeadLetter, now_ms
from streams.bus.base import Bus, Consumer, Record, StartAt
from streams.offsets import OffsetLedger
from streams.topics import DEADLETTER, dead_letters_here

E = TypeVar("E")

# A dead letter keeps the original bytes up to this size; the rest is cut and said so in detail.
MAX_DEADLETTER_PAYLOAD = 4 * 1024 * 1024


class DeadLetters:
    """Writes DeadLetter events and counts them by reason. A record of a topic another stage
    owns (``streams.topics.DEAD_LETTER_OWNERS``) is only counted, in ``skipped``."""

    def __init__(self, bus: Bus, codec: Codec, on_dead_letter: Callable[[str, str], None] | None = None,
                 topic: str = DEADLETTER, on_skip: Callable[[str, str], None] | None = None) -> None:
        self.bus = bus
        self.codec = codec
        self.topic = topic
        self.on_dead_letter = on_dead_letter
        self.on_skip = on_skip
        self.counts: dict[str, int] = {}
        self.skipped: dict[tuple[str, str], int] = {}  # (topic, reason) -> records skipped

    def send(self, record: Record, reason: str, error: BaseException | str, stage: str, detail: str = "") -> bool:
        """Dead-letter ``record``; True, or False when ``stage`` does not own its topic's dead
        letters and the record was only skipped and counted."""
        if not dead_letters_here(record.topic, stage):
            self.skip(record.topic, reason)
            return False
        dl = self.build(record, reason, error, stage, detail)
        self.bus.produce(self.topic, self.codec.encode(dl), key=record.key, headers=self.codec.headers_for(dl))
        self.count(record.topic, reason)
        return True

    @staticmethod
    def build(record: Record, reason: str, error: BaseException | str, stage: str, detail: str = "") -> DeadLetter:
        """The one DeadLetter of ``record``: its bytes (cut past ``MAX_DEADLETTER_PAYLOAD``, said so
        in ``detail``), ``error_class`` the exception's class (or ``error`` itself when it is a
        string) and ``detail`` the given text or else ``"<Class>: <message>"``."""
        value = record.value
        if len(value) > MAX_DEADLETTER_PAYLOAD:
            detail = f"{detail} (payload of {len(value)} bytes cut to {MAX_DEADLETTER_PAYLOAD})".strip()
            value = value[:MAX_DEADLETTER_PAYLOAD]
        err_class = type(error).__name__ if isinstance(error, BaseException) else str(error)
        if isinstance(error, BaseException) and not detail:
            detail = f"{err_class}: {error}".strip()[:2000]
        return DeadLetter(
            topic=record.topic, partition=record.partition, offset=record.offset, value=bytes(value),
            reason=reason, error_class=err_class, stage=stage, occurred_at_ms=now_ms(),
            key=record.key, headers=dict(record.headers), detail=detail,
        )

    def count(self, topic: str, reason: str) -> None:
        """Count a dead letter of a record of ``topic`` that was written."""
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if self.on_dead_letter is not None:
            self.on_dead_letter(topic, reason)

    def skip(self, topic: str, reason: str) -> None:
        """Count a bad record of ``topic`` that its owner dead-letters."""
        self.skipped[(topic, reason)] = self.skipped.get((topic, reason), 0) + 1
        if self.on_skip is not None:
            self.on_skip(topic, reason)


class EventBus:
    """A bus plus the codec: the only way roles touch topics."""

    def __init__(self, bus: Bus, codec: Codec | None = None,
                 on_dead_letter: Callable[[str, str], None] | None = None,
                 dead_letter_topic: str = DEADLETTER, on_skip: Callable[[str, str], None] | None = None) -> None:
        self.bus = bus
        self.codec = codec or Codec()
        self.dead_letters = DeadLetters(bus, self.codec, on_dead_letter, topic=dead_letter_topic, on_skip=on_skip)

    def publish(self, topic: str, event: Any, key: str | bytes | None = None,
                on_delivery: Callable[[str | None], None] | None = None) -> None:
        """Encode and produce ``event``; ``on_delivery``: ``Bus.produce``'s (acknowledged or failed)."""
        if isinstance(key, str):
            key = key.encode()
        kw = {} if on_delivery is None else {"on_delivery": on_delivery}
        self.bus.produce(topic, self.codec.encode(event), key=key, headers=self.codec.headers_for(event), **kw)

    def flush(self, timeout: float = 30.0) -> None:
        self.bus.flush(timeout)

    def consumer(self, group: str | None, topics: list[str], stage: str, expect: type[E] | tuple | None = None,
                 start: StartAt = "earliest") -> "EventConsumer[E]":
        return EventConsumer(self, self.bus.consumer(group, topics, start=start), stage, expect)


class EventConsumer(Generic[E]):
    """Decodes records; a record that fails (corrupt, unknown schema, wrong type, invalid) goes
    to the dead-letter topic with the reason (or, on a topic another stage owns, is skipped and
    counted) and is committed past like any handled record."""

    def __init__(self, events: EventBus, consumer: Consumer, stage: str, expect: type | tuple | None) -> None:
        self.events = events
        self.raw = consumer
        self.stage = stage
        self.expect = expect if isinstance(expect, tuple) or expect is None else (expect,)
        # (topic, partition) -> how far polled, dead-lettered records included (``read``); the
        # caller holds what it keeps and commits ``ledger.offsets()`` (streams.offsets)
        self.ledger: OffsetLedger[tuple[str, int]] = OffsetLedger()

    def poll(self, timeout: float = 1.0, max_records: int = 500) -> list[tuple[Record, E]]:
        out: list[tuple[Record, E]] = []
        for rec in self.raw.poll(timeout, max_records):
            self.ledger.read((rec.topic, rec.partition), rec.offset)
            ev = self.decode(rec)
            if ev is not None:
                out.append((rec, ev))
        return out

    def decode(self, rec: Record) -> E | None:
        try:
            return self.events.codec.decode_valid(rec.value, self.expect, rec.topic)
        except CodecError as e:
            self.events.dead_letters.send(rec, e.reason, e, self.stage)
            return None

    def dead_letter(self, rec: Record, reason: str, error: BaseException | str, detail: str = "") -> bool:
        """Dead-letter ``rec`` (True), or skip and count it where another stage owns the topic's."""
        return self.events.dead_letters.send(rec, reason, error, self.stage, detail)

    def commit(self, records: list[Record] | None = None, *, offsets: dict | None = None) -> None:
        self.raw.commit(records, offsets=offsets)

    def lag(self) -> dict:
        return self.raw.lag()

    def close(self) -> None:
        self.raw.close()


def schema_codec(bus: Bus) -> Codec:
    """The codec of every process: it resolves a schema it does not know (a newer writer's) from
    the schema topic on ``bus``."""
    from schemas.codec import SchemaTopic
    from streams.topics import SCHEMAS

    return Codec(resolver=SchemaTopic(bus, SCHEMAS))


def event_bus(bus: Bus, metrics: Any = None, publish_schemas: bool = True) -> EventBus:
    """The ``EventBus`` of a process on ``bus``: the schema-resolving codec, dead letters and
    skips counted in ``metrics`` (a ``runtime.metrics.Metrics``), this codec's schemas published."""
    from schemas.codec import SchemaTopic
    from streams.topics import SCHEMAS

    codec = schema_codec(bus)
    hook = skip = None
    if metrics is not None:
        hook, skip = metrics.count_dead_letter, metrics.count_skipped
    events = EventBus(bus, codec, on_dead_letter=hook, on_skip=skip)
    if publish_schemas:
        SchemaTopic(bus, SCHEMAS).publish(codec.registry)
    return events
