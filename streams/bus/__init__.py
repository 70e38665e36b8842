"""The bus interface and its backends; ``make_bus`` is the one place a backend is chosen."""

from __future__ import annotations

from streams.bus.base import Bus, BusError, Consumer, Record, RecordTooLargeError, StartAt

__all__ = ["Bus", "BusError", "Consumer", "Record", "RecordTooLargeError", "StartAt", "make_bus"]


def make_bus(kind: str = "memory", **options) -> Bus:
    """``memory`` (in-process, the co-located default) or ``kafka`` (options: bootstrap, config)."""
    if kind == "memory":
        from streams.bus.memory import MemoryBus

        return MemoryBus(**options)
    if kind == "kafka":
        from streams.bus.kafka import KafkaBus

        return KafkaBus(**options)
    raise ValueError(f"unknown bus {kind!r}: use 'memory' or 'kafka'")
