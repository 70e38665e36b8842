"""The v2 PolicyVersion and GradientStep records, as rlstream writes them, read by Apache
Avro's Java implementation (jars fetched with mvn): with the v2 reader schema, and with the v1
one, as an older reader resolves them (the new fields dropped, the old ones intact).

The single-object header is checked apart: rlstream writes the CRC-64-AVRO fingerprint with
its bytes reversed relative to the Avro spec (``schemas.registry._fingerprint`` reverses the
little-endian hex fastavro returns), so Java's ``BinaryMessageDecoder`` finds no schema for any
rlstream record, v1 or v2. That test is a strict xfail until the registry is fixed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from rlstream.broker import DEPENDENCY_PLUGIN
from schemas.codec import Codec
from schemas.events import GradientStep, PolicyVersion

AVRO = ("org.apache.avro", "avro", "1.12.1")
JAVA_SRC = Path(__file__).parent / "java" / "DecodeEvents.java"


@pytest.fixture(scope="module")
def avro_classpath(tmp_path_factory) -> str:
    mvn, java = shutil.which("mvn"), shutil.which("java")
    if not (mvn and java):
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("mvn and java are needed for the Apache Avro Java check")
        pytest.skip("mvn or java not on the PATH")
    home = tmp_path_factory.mktemp("avro-java")
    g, a, v = AVRO
    (home / "pom.xml").write_text(
        '<project xmlns="http://maven.apache.org/POM/4.0.0"><modelVersion>4.0.0</modelVersion>'
        "<groupId>rlstream.local</groupId><artifactId>avro-check</artifactId><version>0</version>"
        f"<packaging>pom</packaging><dependencies><dependency><groupId>{g}</groupId><artifactId>{a}</artifactId>"
        f"<version>{v}</version></dependency></dependencies></project>")
    res = subprocess.run([mvn, "-B", "-q", "-f", str(home / "pom.xml"), f"{DEPENDENCY_PLUGIN}:copy-dependencies",
                          "-DincludeScope=runtime", f"-DoutputDirectory={home / 'lib'}"],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return str(home / "lib" / "*")


def java_decode(classpath: str, tmp: Path, event, reader_version: int, fields: list[str]) -> dict[str, str]:
    codec = Codec()
    writer = codec.writer_schema(type(event))
    reader = codec.registry.get(event.AVRO_NAME, reader_version)
    (tmp / "writer.avsc").write_text(writer.standalone_json)
    (tmp / "reader.avsc").write_text(reader.standalone_json)
    (tmp / "record.bin").write_bytes(codec.encode(event))
    res = subprocess.run(["java", "-cp", classpath, str(JAVA_SRC), str(tmp / "reader.avsc"), str(tmp / "writer.avsc"),
                          str(tmp / "record.bin"), *fields], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return dict(line.split("=", 1) for line in res.stdout.splitlines())


PV = PolicyVersion(policy_id="pi", version=7, created_at_ms=1, learner_id="learner-0", algo="agro",
                   weights=b"\x00\x01", parent_version=6, state_sha256="ab" * 32,
                   provenance='{"run_id": "r1", "fork_of": {"run_id": "r0", "version": 3}}')


def test_apache_avro_java_reads_v2_records_with_v2_and_v1_readers(avro_classpath, tmp_path):
    pv = PV
    got = java_decode(avro_classpath, tmp_path, pv, 2, ["version", "parent_version", "state_sha256", "provenance"])
    got.pop("fingerprint_ok")
    assert got == {"version": "7", "parent_version": "6", "state_sha256": "ab" * 32,
                   "provenance": '{"run_id": "r1", "fork_of": {"run_id": "r0", "version": 3}}'}
    old = java_decode(avro_classpath, tmp_path, pv, 1, ["version", "algo", "state_sha256"])
    old.pop("fingerprint_ok")
    assert old == {"version": "7", "algo": "agro", "state_sha256": "<absent>"}
    gs = GradientStep(learner_id="learner-0", step=4, from_version=6, to_version=7, algo="agro", losses={},
                      grad_norm=0.5, batch_ids=["b1", "b2"], num_samples=512, started_at_ms=1, finished_at_ms=2,
                      batch_digests=["cd" * 32, "ef" * 32])
    got = java_decode(avro_classpath, tmp_path, gs, 2, ["to_version", "batch_ids", "batch_digests"])
    got.pop("fingerprint_ok")
    assert got == {"to_version": "7", "batch_ids": "[b1, b2]", "batch_digests": f"[{'cd' * 32}, {'ef' * 32}]"}
    assert java_decode(avro_classpath, tmp_path, gs, 1, ["batch_ids"])["batch_ids"] == "[b1, b2]"


@pytest.mark.xfail(strict=True, reason="schemas.registry writes the single-object fingerprint byte-reversed")
def test_apache_avro_java_finds_the_writer_fingerprint_in_the_header(avro_classpath, tmp_path):
    assert java_decode(avro_classpath, tmp_path, PV, 2, [])["fingerprint_ok"] == "true"
