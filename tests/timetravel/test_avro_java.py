"""The v2 PolicyVersion and GradientStep records, as rlstream writes them, read by Apache
Avro's Java implementation (``BinaryMessageDecoder``, jars fetched with mvn as in
``tests/interop``): with the v2 reader schema, and with the v1 one, as an older reader resolves
them (the new fields dropped, the old ones intact), and the single-object header's fingerprint
found by Java's schema store."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.codec import Codec
from schemas.events import GradientStep, PolicyVersion
from tests.interop.jvm import java_program

AVRO = [("org.apache.avro", "avro", "1.12.1")]
JAVA_SRC = Path(__file__).parent / "java" / "DecodeEvents.java"


@pytest.fixture(scope="module")
def avro_java():
    """``run(*args) -> stdout``: DecodeEvents in a JVM with Apache Avro on the class path."""
    return java_program(JAVA_SRC, AVRO, "Apache Avro 1.12.1", expect="avro-1.12.1")


def java_decode(run, tmp: Path, event, reader_version: int, fields: list[str]) -> dict[str, str]:
    codec = Codec()
    writer = codec.writer_schema(type(event))
    reader = codec.registry.get(event.AVRO_NAME, reader_version)
    (tmp / "writer.avsc").write_text(writer.standalone_json)
    (tmp / "reader.avsc").write_text(reader.standalone_json)
    (tmp / "record.bin").write_bytes(codec.encode(event))
    out = run(tmp / "reader.avsc", tmp / "writer.avsc", tmp / "record.bin", *fields)
    return dict(line.split("=", 1) for line in out.splitlines())


PV = PolicyVersion(policy_id="pi", version=7, created_at_ms=1, learner_id="learner-0", algo="agro",
                   weights=b"\x00\x01", parent_version=6, state_sha256="ab" * 32,
                   provenance='{"run_id": "r1", "fork_of": {"run_id": "r0", "version": 3}}')


def test_apache_avro_java_reads_v2_records_with_v2_and_v1_readers(avro_java, tmp_path):
    pv = PV
    got = java_decode(avro_java, tmp_path, pv, 2, ["version", "parent_version", "state_sha256", "provenance"])
    got.pop("fingerprint_ok")
    assert got == {"version": "7", "parent_version": "6", "state_sha256": "ab" * 32,
                   "provenance": '{"run_id": "r1", "fork_of": {"run_id": "r0", "version": 3}}'}
    old = java_decode(avro_java, tmp_path, pv, 1, ["version", "algo", "state_sha256"])
    old.pop("fingerprint_ok")
    assert old == {"version": "7", "algo": "agro", "state_sha256": "<absent>"}
    gs = GradientStep(learner_id="learner-0", step=4, from_version=6, to_version=7, algo="agro", losses={},
                      grad_norm=0.5, batch_ids=["b1", "b2"], num_samples=512, started_at_ms=1, finished_at_ms=2,
                      batch_digests=["cd" * 32, "ef" * 32])
    got = java_decode(avro_java, tmp_path, gs, 2, ["to_version", "batch_ids", "batch_digests"])
    got.pop("fingerprint_ok")
    assert got == {"to_version": "7", "batch_ids": "[b1, b2]", "batch_digests": f"[{'cd' * 32}, {'ef' * 32}]"}
    assert java_decode(avro_java, tmp_path, gs, 1, ["batch_ids"])["batch_ids"] == "[b1, b2]"


def test_apache_avro_java_finds_the_writer_fingerprint_in_the_header(avro_java, tmp_path):
    assert java_decode(avro_java, tmp_path, PV, 2, [])["fingerprint_ok"] == "true"
