"""The schema compatibility gate: which schemas must read which, and fastavro's verdict.

Every event schema rlstream writes, or ever wrote, must stay readable (``docs/reference/events.md``:
"a newer version of an event only adds fields with defaults, so older logs stay readable") and a
process built with an older version must read what a newer producer writes once it learnt the
writer schema from the schema topic (``schemas.registry.SchemaRegistry``, ``schemas.codec.SchemaTopic``).
So for every two schemas of one record, ordered by version, the gate checks both directions:
``backward`` (the newer reads what the older wrote) and ``forward`` (the older reads the newer's).

The schemas of a record are the versions a ``SchemaRegistry`` loads plus the ones recorded in
``released/`` (standalone JSON, one file per fingerprint): a version edited in place after it was
released is then still checked against what it was. ``python -m tests.schemas.compat record``
adds the schemas of the current tree to ``released/``.

``fastavro_problems`` writes real records (one of every example event, encoded by the codec) with
the writer schema and reads them with the reader schema; the Java side is
``tests/interop/SchemaCompat.java`` (``org.apache.avro.SchemaCompatibility``).
"""

from __future__ import annotations

import io
import json
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fastavro

from schemas.codec import HEADER_LEN, Codec
from schemas.examples import example_events
from schemas.registry import AVSC_DIR, RegisteredSchema, SchemaRegistry, _fingerprint

RELEASED_DIR = Path(__file__).parent / "released"


@dataclass(frozen=True)
class Version:
    """One distinct schema of a record (a version, or a released state of it)."""

    name: str
    version: int
    fingerprint: str  # hex, as the single-object header carries it
    standalone_json: str
    origin: str  # "tree" or "released"

    @property
    def parsed(self) -> Any:
        return fastavro.parse_schema(json.loads(self.standalone_json), _write_hint=False)

    @property
    def label(self) -> str:
        return f"{self.name} v{self.version} ({self.fingerprint[:8]}, {self.origin})"


@dataclass(frozen=True)
class Pair:
    """Reader schema must read what writer schema wrote."""

    direction: str  # "backward": newer reader, older writer; "forward": the reverse
    reader: Version
    writer: Version

    @property
    def label(self) -> str:
        return f"{self.direction}: {self.reader.label} reads {self.writer.label}"


def _from_registered(reg: RegisteredSchema, origin: str) -> Version:
    return Version(reg.name, reg.version, reg.fingerprint.hex(), reg.standalone_json, origin)


def released(directory: Path = RELEASED_DIR) -> list[Version]:
    """The schemas recorded in ``directory`` (``<name>.v<version>.<fingerprint>.json``)."""
    out = []
    for f in sorted(directory.glob("*.json")):
        doc = json.loads(f.read_text())
        parsed = fastavro.parse_schema(json.loads(doc["schema"]), _write_hint=False)
        fp = _fingerprint(parsed).hex()
        assert f.name == f"{doc['name']}.v{doc['version']}.{fp}.json", f"{f.name}: name does not match its content"
        out.append(Version(doc["name"], int(doc["version"]), fp, doc["schema"], "released"))
    return out


def history(registry: SchemaRegistry | None = None,
            released_dir: Path | None = RELEASED_DIR) -> dict[str, list[Version]]:
    """Every distinct schema (by fingerprint) of every record, oldest version first."""
    registry = registry or SchemaRegistry()
    seen: dict[str, Version] = {}
    for v in [_from_registered(r, "tree") for r in registry.all()] + (released(released_dir) if released_dir else []):
        if v.name in set(registry.names()):
            seen.setdefault(v.fingerprint, v)
    by_name: dict[str, list[Version]] = {}
    for v in seen.values():
        by_name.setdefault(v.name, []).append(v)
    return {n: sorted(vs, key=lambda v: (v.version, v.origin != "released")) for n, vs in sorted(by_name.items())}


def pairs(hist: dict[str, list[Version]]) -> list[Pair]:
    """Both directions for every two schemas of one record."""
    out = []
    for versions in hist.values():
        for i, old in enumerate(versions):
            for new in versions[i + 1:]:
                out += [Pair("backward", new, old), Pair("forward", old, new)]
    return out


# -- fastavro: real records, written by one schema and read by the other -----------------------

def codec_datums(name: str) -> list[dict]:
    """Datums of the example events of record ``name`` exactly as the codec writes them."""
    codec = Codec(SchemaRegistry())
    out = []
    for ev in example_events():
        if type(ev).AVRO_NAME == name:
            data = codec.encode(ev)
            writer = codec.registry.by_fingerprint(data[2:HEADER_LEN])
            out.append(fastavro.schemaless_reader(io.BytesIO(data[HEADER_LEN:]), writer.parsed, None))
    assert out, f"no example event of {name}"
    return out


def _zero(schema: Any) -> Any:
    """A value of ``schema`` for a field the codec's datum lacks and that has no default."""
    if isinstance(schema, list):
        return _zero(schema[0])
    kind = schema["type"] if isinstance(schema, dict) else schema
    zeros = {"null": None, "boolean": False, "int": 0, "long": 0, "float": 0.0, "double": 0.0,
             "bytes": b"", "string": "", "array": [], "map": {}}
    if kind in zeros:
        return zeros[kind]
    if kind == "record":
        return {f["name"]: _zero(f["type"]) for f in schema["fields"]}
    raise ValueError(f"no zero value for {schema!r}")


def conform(value: Any, schema: Any) -> Any:
    """``value`` as a writer of ``schema`` holds it: its fields, the missing ones defaulted or zero."""
    if isinstance(schema, dict) and schema.get("type") == "record" and isinstance(value, dict):
        return {f["name"]: conform(value[f["name"]], f["type"]) if f["name"] in value
                else f["default"] if "default" in f else _zero(f["type"]) for f in schema["fields"]}
    return value


def _expected(value: Any, writer: Any, reader: Any) -> Any:
    """What Avro resolution must yield for ``value`` written with ``writer``, read with ``reader``."""
    if all(isinstance(s, dict) and s.get("type") == "record" for s in (writer, reader)):
        wf = {f["name"]: f["type"] for f in writer["fields"]}
        return {f["name"]: _expected(value[f["name"]], wf[f["name"]], f["type"]) if f["name"] in wf
                else f.get("default") for f in reader["fields"]}
    return value


def fastavro_problems(pair: Pair, datums: list[dict]) -> list[str]:
    """Why fastavro cannot resolve ``datums`` written with pair.writer as pair.reader (empty: it can)."""
    w, r = pair.writer.parsed, pair.reader.parsed
    problems = []
    for i, datum in enumerate(datums):
        written = conform(datum, w)
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, w, written)
        buf.seek(0)
        try:
            got = fastavro.schemaless_reader(buf, w, r)
        except Exception as e:  # SchemaResolutionError, or a type error deeper down
            problems.append(f"record {i}: {type(e).__name__}: {e}")
            continue
        if buf.tell() != len(buf.getvalue()):
            problems.append(f"record {i}: {len(buf.getvalue()) - buf.tell()} bytes left unread")
        elif got != _expected(written, w, r):
            problems.append(f"record {i}: read values differ from the written ones")
    return problems


# -- variants of the schema tree, for the tests that prove the gate catches a break -------------

def copy_tree(dest: Path, *dirs: Path) -> Path:
    """``dest`` holding the .avsc files of ``schemas/avsc`` (and of ``dirs``, later ones winning)."""
    dest.mkdir(parents=True, exist_ok=True)
    for d in (AVSC_DIR, *dirs):
        for f in d.glob("*.avsc"):
            shutil.copyfile(f, dest / f.name)
    return dest


def _newest_file(directory: Path, name: str) -> tuple[Path, int]:
    found = [(int(m["version"]), f) for f in directory.glob(f"{name}.v*.avsc")
             if (m := re.match(r".*\.v(?P<version>\d+)\.avsc$", f.name))]
    version, f = max(found)
    return f, version


def add_version(directory: Path, name: str, change: Callable[[dict], None]) -> int:
    """Write the next version of ``name``: its newest, changed by ``change``. Returns the version."""
    f, version = _newest_file(directory, name)
    raw = json.loads(f.read_text())
    change(raw)
    (directory / f"{name}.v{version + 1}.avsc").write_text(json.dumps(raw, indent=1))
    return version + 1


def edit_in_place(directory: Path, name: str, change: Callable[[dict], None]) -> int:
    """Change the newest version of ``name`` without a new version number (what must not be done)."""
    f, version = _newest_file(directory, name)
    raw = json.loads(f.read_text())
    change(raw)
    f.write_text(json.dumps(raw, indent=1))
    return version


def add_field(field: dict) -> Callable[[dict], None]:
    return lambda raw: raw["fields"].append(field)


def drop_field(name: str) -> Callable[[dict], None]:
    def change(raw: dict) -> None:
        raw["fields"] = [f for f in raw["fields"] if f["name"] != name]
    return change


def record(registry: SchemaRegistry | None = None, directory: Path = RELEASED_DIR) -> list[Path]:
    """Write every schema of ``registry`` to ``directory`` (existing files are kept)."""
    directory.mkdir(parents=True, exist_ok=True)
    added = []
    for reg in (registry or SchemaRegistry()).all():
        path = directory / f"{reg.name}.v{reg.version}.{reg.fingerprint.hex()}.json"
        if not path.exists():
            doc = {"name": reg.name, "version": reg.version, "schema": reg.standalone_json}
            path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
            added.append(path)
    return added


if __name__ == "__main__":
    if sys.argv[1:] != ["record"]:
        sys.exit("usage: python -m tests.schemas.compat record")
    for p in record():
        print(f"recorded {p}")
