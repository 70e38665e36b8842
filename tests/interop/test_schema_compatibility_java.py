"""The schema compatibility gate, Java side: Apache Avro's ``SchemaCompatibility`` (the reference
implementation of the resolution rules) judges every pair of ``tests/schemas/compat.py`` --
the tree's, and those of the break variants -- and agrees with fastavro on each.

One JVM run (``SchemaCompat.java``, compiled and cached as ``AvroInterop.java`` is) judges all
cases. Without java/javac/mvn the tests skip, and fail under ``CI=true`` (``tests/interop/jvm.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.registry import SchemaRegistry
from tests.schemas.compat import (
    Pair,
    add_field,
    add_version,
    codec_datums,
    copy_tree,
    drop_field,
    edit_in_place,
    fastavro_problems,
    history,
    pairs,
)

from .jvm import JAVA_SRC, java_program
from .test_avro_java import AVRO, AVRO_VERSION

V2_DIR = Path(__file__).parents[1] / "schemas" / "avsc_v2"  # test-only SampleBatch v2 (a default)
NO_DEFAULT = {"name": "host", "type": "string"}


def cases(tmp: Path) -> dict[str, list[Pair]]:
    """The tree's pairs, and those of each variant that must (or must not) break."""
    def variant(label: str, name: str, make) -> list[Pair]:
        d = copy_tree(tmp / label)
        make(d, name)
        return pairs({name: history(SchemaRegistry([d]))[name]})

    return {
        "tree": pairs(history()),
        "added_no_default": variant("added", "rlstream.GradientStep",
                                    lambda d, n: add_version(d, n, add_field(NO_DEFAULT))),
        "dropped_no_default": variant("dropped", "rlstream.GradientStep",
                                      lambda d, n: add_version(d, n, drop_field("grad_norm"))),
        "added_with_default": variant("default", "rlstream.GradientStep",
                                      lambda d, n: add_version(d, n, add_field({**NO_DEFAULT, "default": ""}))),
        "edited_in_place": variant("edited", "rlstream.SampleBatch",
                                   lambda d, n: edit_in_place(d, n, add_field(NO_DEFAULT))),
        "embedded_v2": [p for name in ("rlstream.SampleBatch", "rlstream.PreparedBatch")
                        for p in pairs({name: history(SchemaRegistry([copy_tree(tmp / "v2", V2_DIR)]))[name]})],
    }


# (direction, reader version, writer version) that must be incompatible, per case
EXPECTED_BREAKS = {
    "tree": set(),
    "added_no_default": {("backward", 3, 1), ("backward", 3, 2)},
    "dropped_no_default": {("forward", 1, 3), ("forward", 2, 3)},
    "added_with_default": set(),
    "edited_in_place": {("backward", 2, 1), ("backward", 2, 2)},  # SampleBatch v2, the newest, edited
    "embedded_v2": set(),
}


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory) -> dict[str, list[tuple[Pair, str]]]:
    """Per case, each pair with Java's verdict line (``COMPATIBLE`` or ``INCOMPATIBLE ...``)."""
    run = java_program(JAVA_SRC / "SchemaCompat.java", AVRO, f"Apache Avro {AVRO_VERSION}",
                       expect=f"avro-{AVRO_VERSION}")
    tmp = tmp_path_factory.mktemp("compat")
    work = tmp / "pairs"
    work.mkdir()
    ids = {}
    for case, ps in cases(tmp).items():
        for i, p in enumerate(ps):
            pid = f"{case}.{i:03d}"
            (work / f"{pid}.reader.avsc").write_text(p.reader.standalone_json)
            (work / f"{pid}.writer.avsc").write_text(p.writer.standalone_json)
            ids[pid] = (case, p)
    lines = dict(line.split(" ", 1) for line in run(work).splitlines() if line.strip())
    assert set(lines) == set(ids), "Java judged other pairs than it was given"
    out: dict[str, list[tuple[Pair, str]]] = {}
    for pid, (case, p) in ids.items():
        out.setdefault(case, []).append((p, lines[pid]))
    return out


@pytest.mark.parametrize("case", sorted(EXPECTED_BREAKS))
def test_java_schema_compatibility_judges_each_pair_as_expected(verdicts, case):
    judged = verdicts[case]
    assert judged, case
    breaks = {(p.direction, p.reader.version, p.writer.version): v for p, v in judged if v != "COMPATIBLE"}
    assert set(breaks) == EXPECTED_BREAKS[case], f"{case}: {breaks}"
    for v in breaks.values():
        assert v.startswith("INCOMPATIBLE READER_FIELD_MISSING_DEFAULT"), v


def test_the_tree_is_compatible_both_ways_by_java(verdicts):
    judged = verdicts["tree"]
    assert {p.direction for p, _ in judged} == {"backward", "forward"}
    assert [p.label for p, v in judged if v != "COMPATIBLE"] == []


def test_java_and_fastavro_agree_on_every_pair(verdicts):
    for case, judged in verdicts.items():
        for p, v in judged:
            fast = fastavro_problems(p, codec_datums(p.reader.name))
            assert (v == "COMPATIBLE") == (not fast), f"{case}: {p.label}: Java {v!r}, fastavro {fast}"
