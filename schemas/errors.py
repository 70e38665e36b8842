"""Typed codec errors. Every decode failure is one of these, so callers can dead-letter it."""

from __future__ import annotations


class CodecError(Exception):
    """Base class of every encode/decode error. ``reason`` is a short machine-readable tag."""

    reason = "codec_error"


class SchemaDefinitionError(CodecError):
    """An .avsc file (or a published schema) is invalid, or a schema name is unknown."""

    reason = "schema_definition"


class CorruptEventError(CodecError):
    """The bytes are not a valid single-object-encoded event (bad magic, truncated, garbage)."""

    reason = "corrupt"


class UnknownSchemaError(CodecError):
    """The writer fingerprint is not known to this reader (and not published on the schema topic)."""

    reason = "unknown_schema"

    def __init__(self, fingerprint: bytes) -> None:
        self.fingerprint = fingerprint
        super().__init__(
            f"unknown writer schema fingerprint {fingerprint.hex()}: the producer uses a schema "
            "this reader has not seen; publish it to the schema topic or upgrade the reader"
        )


class SchemaMismatchError(CodecError):
    """The event is valid but of another type than the reader expected."""

    reason = "wrong_type"


class InvalidEventError(CodecError):
    """The event decoded but its content is invalid (bad tensor dtype/shape, NaN where forbidden)."""

    reason = "invalid"
