"""Avro codec: Avro single-object encoding (``C3 01`` + 8-byte CRC-64-AVRO fingerprint of the
writer schema, little-endian as the spec says + binary datum), decoded with writer -> reader
schema resolution. Records written by rlstream before it followed the spec carry the fingerprint
byte-swapped; they are still read, with one warning per schema (``SchemaRegistry.by_fingerprint``).

The fingerprint header makes every record self-describing: a reader looks the writer schema
up by fingerprint (its own registry, or schemas another process published on the schema topic,
see ``SchemaTopic``) and resolves it to the newest version of that record it was built with.
"""

from __future__ import annotations

import io
import json
from typing import Any, TypeVar

import fastavro

from schemas.errors import CodecError, CorruptEventError, SchemaMismatchError, UnknownSchemaError
from schemas.events import EVENT_TYPES, from_datum, to_datum
from schemas.registry import RegisteredSchema, SchemaRegistry, default_registry

MAGIC = b"\xc3\x01"
HEADER_LEN = 10
SCHEMA_HEADER = "rl-schema"  # bus header carrying "name/version", for humans and routing

E = TypeVar("E")


class Codec:
    """Encodes event dataclasses to bytes and back. Thread-safe; create one per process."""

    def __init__(self, registry: SchemaRegistry | None = None, resolver: "SchemaTopic | None" = None) -> None:
        self.registry = registry or default_registry()
        self.resolver = resolver

    def writer_schema(self, event_type: type) -> RegisteredSchema:
        return self.registry.latest(event_type.AVRO_NAME)

    def encode(self, event: Any) -> bytes:
        reg = self.writer_schema(type(event))
        buf = io.BytesIO()
        buf.write(MAGIC)
        buf.write(reg.fingerprint)
        try:
            fastavro.schemaless_writer(buf, reg.parsed, to_datum(event))
        except (ValueError, TypeError) as e:
            raise CodecError(f"cannot encode {type(event).__name__}: {e}") from e
        return buf.getvalue()

    def headers_for(self, event: Any) -> dict[str, bytes]:
        reg = self.writer_schema(type(event))
        return {SCHEMA_HEADER: f"{reg.name}/{reg.version}".encode()}

    def writer_of(self, data: bytes) -> RegisteredSchema:
        """The writer schema of an encoded record (raises CorruptEventError / UnknownSchemaError)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise CorruptEventError(f"expected bytes, got {type(data).__name__}")
        if len(data) < HEADER_LEN:
            raise CorruptEventError(f"record of {len(data)} bytes is shorter than the 10-byte header")
        if bytes(data[:2]) != MAGIC:
            raise CorruptEventError(f"bad magic {bytes(data[:2]).hex()}, expected c301 (Avro single-object)")
        fp = bytes(data[2:HEADER_LEN])
        if not self.registry.knows(fp) and self.resolver is not None:
            self.resolver.refresh(self.registry)
        return self.registry.by_fingerprint(fp)

    def decode(self, data: bytes, expected: type[E] | None = None) -> E:
        writer = self.writer_of(data)
        cls = EVENT_TYPES.get(writer.name)
        if cls is None:
            raise SchemaMismatchError(f"no event class for schema {writer.name}")
        if expected is not None and cls is not expected:
            raise SchemaMismatchError(f"expected {expected.__name__}, got {cls.__name__}")
        reader = self.registry.latest(writer.name)
        buf = io.BytesIO(data)
        buf.seek(HEADER_LEN)
        try:
            datum = fastavro.schemaless_reader(
                buf, writer.parsed, reader.parsed if reader is not writer else None
            )
        except CodecError:
            raise
        except Exception as e:  # fastavro raises EOFError, ValueError, IndexError, UnicodeDecodeError...
            raise CorruptEventError(f"{writer.name} v{writer.version}: undecodable payload: {e!r}") from e
        if buf.tell() != len(data):
            raise CorruptEventError(
                f"{writer.name}: {len(data) - buf.tell()} trailing bytes after the datum"
            )
        return from_datum(cls, datum)


    def decode_valid(self, data: bytes, expect: type | tuple[type, ...] | None = None, where: str = "") -> Any:
        """``decode``, then check the event is one of ``expect`` and passes its ``validate()``:
        what every consumer needs before it acts on a record. Raises CodecError subclasses."""
        ev = self.decode(data)
        if expect is not None:
            kinds = expect if isinstance(expect, tuple) else (expect,)
            if not isinstance(ev, kinds):
                names = "/".join(t.__name__ for t in kinds)
                raise SchemaMismatchError(f"expected {names}{' on ' + where if where else ''}, got {type(ev).__name__}")
        validate = getattr(ev, "validate", None)
        if validate is not None:
            validate()
        return ev


class SchemaTopic:
    """Writers publish their standalone schemas to a compacted topic keyed by fingerprint;
    readers learn unknown writer schemas from it (a schema registry that lives on the bus).

    The bus is any ``streams.bus.Bus``; this class only uses produce/consume.
    """

    def __init__(self, bus: Any, topic: str) -> None:
        self.bus = bus
        self.topic = topic

    def publish(self, registry: SchemaRegistry) -> None:
        for reg in registry.all():
            value = json.dumps(
                {"name": reg.name, "version": reg.version, "schema": reg.standalone_json}
            ).encode()
            self.bus.produce(self.topic, value, key=reg.fingerprint)
        self.bus.flush()

    def refresh(self, registry: SchemaRegistry) -> int:
        """Read the whole schema topic and register what is new. Returns how many were added."""
        added = 0
        for rec in self.bus.read_all(self.topic):
            try:
                doc = json.loads(rec.value)
                if not registry.knows(rec.key or b""):
                    registry.register_standalone(doc["name"], int(doc["version"]), doc["schema"])
                    added += 1
            except (ValueError, KeyError, TypeError, CodecError):
                continue  # a broken schema record cannot make a good one unreadable
        return added


__all__ = ["Codec", "SchemaTopic", "MAGIC", "SCHEMA_HEADER", "UnknownSchemaError"]
