"""Versioned Avro schemas, loaded from ``.avsc`` files and identified by fingerprint.

File names carry the version: ``rlstream.SampleBatch.v1.avsc``. Shared named types
(``rlstream.Tensor.avsc``) have no version suffix; references to them, and to other
event records, are expanded inline so that every registered schema is standalone.
A standalone schema is what a writer publishes (see ``schemas.codec``) and what any
reader needs to resolve writer -> reader.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fastavro
from fastavro.schema import fingerprint, to_parsing_canonical_form

from schemas.errors import SchemaDefinitionError, UnknownSchemaError

log = logging.getLogger(__name__)

AVSC_DIR = Path(__file__).parent / "avsc"
_VERSIONED = re.compile(r"^(?P<name>[\w.]+)\.v(?P<version>\d+)\.avsc$")
_PRIMITIVES = {"null", "boolean", "int", "long", "float", "double", "bytes", "string"}


@dataclass(frozen=True)
class RegisteredSchema:
    """One version of one record schema."""

    name: str  # full name, e.g. rlstream.SampleBatch
    version: int
    fingerprint: bytes  # CRC-64-AVRO of the parsing canonical form, 8 bytes little-endian
    parsed: Any  # fastavro parsed schema
    standalone_json: str  # expanded JSON, enough for any reader to resolve

    @property
    def legacy_fingerprint(self) -> bytes:
        """The fingerprint in the byte order rlstream wrote before it followed the spec
        (big-endian): still read from old logs and topics, never written."""
        return self.fingerprint[::-1]


def _fingerprint(parsed: Any) -> bytes:
    """CRC-64-AVRO of the parsing canonical form as Avro single-object encoding stores it: the
    64-bit value little-endian (fastavro's hex digest already lists the bytes in that order)."""
    return bytes.fromhex(fingerprint(to_parsing_canonical_form(parsed), "CRC-64-AVRO"))


_warned_legacy: set[tuple[str, int]] = set()


def _warn_legacy(reg: RegisteredSchema) -> None:
    """Once per process and schema: a record carries the old (byte-swapped) fingerprint."""
    key = (reg.name, reg.version)
    if key not in _warned_legacy:
        _warned_legacy.add(key)
        log.warning("reading %s v%d records with the pre-spec fingerprint byte order %s (spec order %s): "
                    "written by an older rlstream; readable, but standard Avro readers cannot read them",
                    reg.name, reg.version, reg.legacy_fingerprint.hex(), reg.fingerprint.hex())


def _expand(node: Any, types: dict[str, Any], seen: set[str], namespace: str | None) -> Any:
    """Inline named-type references so the schema is standalone (first use defines it)."""
    if isinstance(node, str):
        if node in _PRIMITIVES:
            return node
        full = node if "." in node else f"{namespace}.{node}" if namespace else node
        if full in seen:
            return full
        if full not in types:
            raise SchemaDefinitionError(f"unknown named type {full!r}")
        seen.add(full)
        return _expand(copy.deepcopy(types[full]), types, seen, namespace)
    if isinstance(node, list):
        return [_expand(n, types, seen, namespace) for n in node]
    if isinstance(node, dict):
        kind = node.get("type")
        if kind in ("record", "error", "enum", "fixed"):
            ns = node.get("namespace", namespace)
            full = node["name"] if "." in node["name"] else f"{ns}.{node['name']}"
            seen.add(full)
            out = dict(node)
            if kind in ("record", "error"):
                out["fields"] = [
                    {**f, "type": _expand(f["type"], types, seen, ns)} for f in node["fields"]
                ]
            return out
        if kind == "array":
            return {**node, "items": _expand(node["items"], types, seen, namespace)}
        if kind == "map":
            return {**node, "values": _expand(node["values"], types, seen, namespace)}
        if isinstance(kind, (dict, list)):
            return {**node, "type": _expand(kind, types, seen, namespace)}
        return node
    return node


def _full_name(schema: dict) -> str:
    name = schema["name"]
    return name if "." in name else f"{schema.get('namespace', '')}.{name}".lstrip(".")


class SchemaRegistry:
    """All schema versions this process knows, by full name and by fingerprint.

    ``latest(name)`` is what a writer uses and what a reader resolves to. A reader meets
    writer schemas it was not built with (a newer producer) through ``register_standalone``,
    which the bus-backed schema topic feeds (``schemas.codec.SchemaTopic``).
    """

    def __init__(self, dirs: list[Path] | None = None) -> None:
        self._lock = threading.Lock()
        self._by_fp: dict[bytes, RegisteredSchema] = {}
        self._by_legacy_fp: dict[bytes, RegisteredSchema] = {}  # old byte order, read-only
        self._by_name: dict[str, dict[int, RegisteredSchema]] = {}
        self._local: set[str] = set()  # names loaded from .avsc files (not learnt from others)
        self._shared: dict[str, Any] = {}
        for d in dirs if dirs is not None else [AVSC_DIR]:
            self.load_dir(Path(d))

    def load_dir(self, directory: Path) -> None:
        files = sorted(directory.glob("*.avsc"))
        if not files:
            raise SchemaDefinitionError(f"no .avsc files in {directory}")
        versioned: list[tuple[int, str, dict]] = []
        for f in files:
            try:
                raw = json.loads(f.read_text())
            except json.JSONDecodeError as e:
                raise SchemaDefinitionError(f"{f}: invalid JSON: {e}") from e
            m = _VERSIONED.match(f.name)
            if m:
                if _full_name(raw) != m["name"]:
                    raise SchemaDefinitionError(f"{f}: file name does not match {_full_name(raw)}")
                versioned.append((int(m["version"]), m["name"], raw))
            else:
                self._shared[_full_name(raw)] = raw
        # An event that embeds another (PreparedBatch -> SampleBatch) embeds the newest
        # version of it known at load time.
        for version, name, raw in sorted(versioned, key=lambda t: t[0]):
            self._shared[name] = raw
        for version, name, raw in versioned:
            self._register(name, version, raw)

    def _register(self, name: str, version: int, raw: dict) -> RegisteredSchema:
        types = dict(self._shared)
        types[name] = raw
        standalone = _expand(copy.deepcopy(raw), types, set(), raw.get("namespace"))
        try:
            parsed = fastavro.parse_schema(standalone, _write_hint=False)
        except Exception as e:  # fastavro raises several types for bad schemas
            raise SchemaDefinitionError(f"{name} v{version}: {e}") from e
        reg = RegisteredSchema(
            name=name,
            version=version,
            fingerprint=_fingerprint(parsed),
            parsed=parsed,
            standalone_json=json.dumps(standalone, sort_keys=True),
        )
        with self._lock:
            self._index(reg)
            self._by_name.setdefault(name, {})[version] = reg
            self._local.add(name)
        return reg

    def register_standalone(self, name: str, version: int, standalone_json: str) -> RegisteredSchema:
        """Learn a writer schema published by another process (e.g. a newer version)."""
        existing = self._by_name.get(name, {}).get(version)
        if existing is not None and existing.standalone_json == standalone_json:
            return existing
        try:
            raw = json.loads(standalone_json)
            parsed = fastavro.parse_schema(raw, _write_hint=False)
        except Exception as e:
            raise SchemaDefinitionError(f"{name} v{version}: {e}") from e
        reg = RegisteredSchema(name, version, _fingerprint(parsed), parsed, standalone_json)
        with self._lock:
            self._index(reg)
            # A remote version never replaces the reader schema this process was built with:
            # it is a writer schema to resolve from (by fingerprint), not a new ``latest``,
            # which would make this process read into, and write, a schema its code lacks.
            if name not in self._local:
                self._by_name.setdefault(name, {}).setdefault(version, reg)
        return reg

    def _index(self, reg: RegisteredSchema) -> None:
        self._by_fp[reg.fingerprint] = reg
        self._by_legacy_fp.setdefault(reg.legacy_fingerprint, reg)

    def by_fingerprint(self, fp: bytes) -> RegisteredSchema:
        """The schema of a spec-order fingerprint, else of an old byte-swapped one (logged once)."""
        reg = self._by_fp.get(fp)
        if reg is not None:
            return reg
        reg = self._by_legacy_fp.get(fp)
        if reg is None:
            raise UnknownSchemaError(fp)
        _warn_legacy(reg)
        return reg

    def knows(self, fp: bytes) -> bool:
        return fp in self._by_fp or fp in self._by_legacy_fp

    def latest(self, name: str) -> RegisteredSchema:
        versions = self._by_name.get(name)
        if not versions:
            raise SchemaDefinitionError(f"no schema named {name!r}; known: {sorted(self._by_name)}")
        return versions[max(versions)]

    def get(self, name: str, version: int) -> RegisteredSchema:
        try:
            return self._by_name[name][version]
        except KeyError:
            raise SchemaDefinitionError(f"no schema {name} v{version}") from None

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def all(self) -> list[RegisteredSchema]:
        return [r for versions in self._by_name.values() for r in versions.values()]


_default: SchemaRegistry | None = None


def default_registry() -> SchemaRegistry:
    global _default
    if _default is None:
        _default = SchemaRegistry()
    return _default
