"""The schema compatibility gate, fastavro side: every two schemas of one record resolve both
ways (backward and forward, see ``tests/schemas/compat.py``) on real records the codec writes,
and the gate fails a field added without a default, a field removed that an older reader needs,
and a released version edited in place. Java's ``SchemaCompatibility`` gives its verdict on the
same pairs in ``tests/interop/test_schema_compatibility_java.py``.
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import fastavro
import pytest

from schemas.codec import MAGIC, Codec
from schemas.events import EVENT_TYPES, to_datum
from schemas.examples import example_events
from schemas.registry import AVSC_DIR, SchemaRegistry
from tests.schemas.compat import (
    RELEASED_DIR,
    add_field,
    add_version,
    codec_datums,
    conform,
    copy_tree,
    drop_field,
    edit_in_place,
    fastavro_problems,
    history,
    pairs,
    released,
)

V2_DIR = Path(__file__).parent / "avsc_v2"  # test-only SampleBatch v3 (adds priority, with a default)
HISTORY = history()
PAIRS = pairs(HISTORY)


def test_the_gate_sees_every_schema_and_version():
    """Every versioned .avsc and every released schema is in the gate, and every schema the tree
    writes is recorded in ``released/`` so that an edit in place is caught later."""
    names = set(EVENT_TYPES) - {"rlstream.ClaimCheck"}  # ClaimCheck only travels inside PolicyVersion
    assert set(HISTORY) == names
    files = {f.name for f in AVSC_DIR.glob("*.v*.avsc")}
    assert files == {f"{v.name}.v{v.version}.avsc" for vs in HISTORY.values() for v in vs if v.origin == "tree"}
    fps = {v.fingerprint for vs in HISTORY.values() for v in vs}
    assert {v.fingerprint for v in released()} <= fps
    unrecorded = [f"{r.name} v{r.version}" for r in SchemaRegistry().all()
                  if not (RELEASED_DIR / f"{r.name}.v{r.version}.{r.fingerprint.hex()}.json").exists()]
    assert not unrecorded, ("schemas not recorded in tests/schemas/released: run `python -m tests.schemas.compat "
                            f"record` and commit the files: {unrecorded}")
    versions = {n: [v.version for v in vs] for n, vs in HISTORY.items()}
    assert versions["rlstream.GradientStep"] == [1, 2] and versions["rlstream.PolicyVersion"] == [1, 2]
    assert {p.direction for p in PAIRS} == {"backward", "forward"}


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p.direction}-{p.reader.name.split('.')[-1]}"
                         f"-v{p.reader.version}-reads-v{p.writer.version}")
def test_every_pair_resolves_on_real_records(pair):
    assert fastavro_problems(pair, codec_datums(pair.reader.name)) == [], pair.label


def test_the_codec_reads_what_every_older_schema_wrote_as_the_newest_event():
    """Bytes an older rlstream wrote (single-object, the older fingerprint) decode to today's
    event: the old fields as written, the new ones at their defaults."""
    codec = Codec(SchemaRegistry())
    checked = 0
    for ev in example_events():
        name = type(ev).AVRO_NAME
        newest = codec.writer_schema(type(ev))
        for old in HISTORY[name]:
            if old.fingerprint == newest.fingerprint.hex():
                continue
            codec.registry.register_standalone(old.name, old.version, old.standalone_json)
            datum = conform(to_datum(ev), old.parsed)
            buf = io.BytesIO()
            buf.write(MAGIC + bytes.fromhex(old.fingerprint))
            fastavro.schemaless_writer(buf, old.parsed, datum)
            back = codec.decode(buf.getvalue(), type(ev))
            old_fields = {f["name"] for f in old.parsed["fields"]}
            for f in dataclasses.fields(ev):
                want = getattr(ev, f.name) if f.name in old_fields else _default(f)
                got = getattr(back, f.name)
                assert repr(got) == repr(want), f"{old.label}: {f.name}"
            checked += 1
    assert checked >= 2  # GradientStep v1 and PolicyVersion v1 at least


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


# -- the gate catches a break --------------------------------------------------------------------

def _failing(registry: SchemaRegistry, name: str) -> set[tuple[str, int, int]]:
    """(direction, reader version, writer version) of the pairs of ``name`` fastavro cannot resolve."""
    hist = history(registry)
    return {(p.direction, p.reader.version, p.writer.version) for p in pairs({name: hist[name]})
            if fastavro_problems(p, codec_datums(name))}


def test_a_new_version_adding_a_field_without_a_default_fails_backward(tmp_path):
    d = copy_tree(tmp_path / "avsc")
    v = add_version(d, "rlstream.GradientStep", add_field({"name": "host", "type": "string"}))
    assert v == 3
    assert _failing(SchemaRegistry([d]), "rlstream.GradientStep") == {("backward", 3, 1), ("backward", 3, 2)}


def test_a_new_version_dropping_a_field_old_readers_need_fails_forward(tmp_path):
    d = copy_tree(tmp_path / "avsc")
    add_version(d, "rlstream.GradientStep", drop_field("grad_norm"))  # no default in v1, v2
    assert _failing(SchemaRegistry([d]), "rlstream.GradientStep") == {("forward", 1, 3), ("forward", 2, 3)}


def test_a_field_added_with_a_default_passes_both_ways(tmp_path):
    d = copy_tree(tmp_path / "avsc")
    add_version(d, "rlstream.GradientStep", add_field({"name": "host", "type": "string", "default": ""}))
    assert _failing(SchemaRegistry([d]), "rlstream.GradientStep") == set()


def test_a_released_version_edited_in_place_fails_against_what_it_was(tmp_path):
    d = copy_tree(tmp_path / "avsc")
    edit_in_place(d, "rlstream.SampleBatch", add_field({"name": "host", "type": "string"}))
    hist = history(SchemaRegistry([d]))["rlstream.SampleBatch"]
    assert [(v.version, v.origin) for v in hist] == [(1, "tree"), (2, "released"), (2, "tree")]  # v2 edited
    assert _failing(SchemaRegistry([d]), "rlstream.SampleBatch") == {("backward", 2, 1), ("backward", 2, 2)}


def test_an_event_embedding_an_evolved_one_is_checked_too(tmp_path):
    """With the test-only SampleBatch v3, PreparedBatch v1 embeds it: a new schema under the same
    version number, which the gate checks against the released ones (compatible: a default)."""
    registry = SchemaRegistry([copy_tree(tmp_path / "avsc", V2_DIR)])
    hist = history(registry)
    assert sorted({v.version for v in hist["rlstream.SampleBatch"]}) == [1, 2, 3]
    prepared = [(v.version, v.origin) for v in hist["rlstream.PreparedBatch"]]
    assert prepared[-1] == (1, "tree") and set(prepared[:-1]) == {(1, "released")} and len(prepared) >= 3
    for name in ("rlstream.SampleBatch", "rlstream.PreparedBatch"):
        assert _failing(registry, name) == set()
