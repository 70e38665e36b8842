"""rlstream's Avro events against Apache Avro for Java (the reference implementation).

Java's ``BinaryMessageDecoder`` decodes one event of every type rlstream writes, and rlstream
decodes what Java's ``BinaryMessageEncoder`` writes; both sides use the ``.avsc`` files of
``schemas/avsc``. Values cross as Avro JSON datums (Java's JsonEncoder/JsonDecoder, fastavro's
json_writer/json_reader) and are compared field by field with the original event.
The Avro jars come from Maven Central as the Kafka jars do (``localkafka.fetch.fetch_maven``);
``AvroInterop.java`` is compiled once per source version into the same cache.
"""

from __future__ import annotations

import io

import fastavro
import pytest

from schemas.codec import HEADER_LEN, MAGIC, Codec
from schemas.events import EVENT_TYPES, from_datum, to_datum
from schemas.examples import events_equal, example_events
from schemas.registry import AVSC_DIR, SchemaRegistry

from .jvm import JAVA_SRC, java_program

AVRO_VERSION = "1.12.1"
AVRO = [("org.apache.avro", "avro", AVRO_VERSION)]


@pytest.fixture(scope="module")
def avro_java():
    """``run(mode, dir)``: AvroInterop in a JVM with Apache Avro on the class path."""
    run = java_program(JAVA_SRC / "AvroInterop.java", AVRO, f"Apache Avro {AVRO_VERSION}",
                       expect=f"avro-{AVRO_VERSION}")
    return lambda mode, where: run(AVSC_DIR, mode, where)


@pytest.fixture(scope="module")
def codec() -> Codec:
    return Codec(SchemaRegistry())


def one_of_each(codec):
    """One example event per registered event schema (every type rlstream writes)."""
    events = {}
    for ev in example_events():
        events.setdefault(type(ev).AVRO_NAME, ev)
    assert set(events) == set(codec.registry.names())
    return events


def test_java_decodes_every_event_type_written_by_rlstream(avro_java, codec, tmp_path):
    events = one_of_each(codec)
    for name, ev in events.items():
        (tmp_path / f"{name}.bin").write_bytes(codec.encode(ev))
    out = avro_java("decode", tmp_path)
    print(out)
    for name, ev in events.items():
        reg = codec.registry.latest(name)
        datum = next(fastavro.json_reader(io.StringIO((tmp_path / f"{name}.json").read_text()), reg.parsed))
        back = from_datum(EVENT_TYPES[name], datum)
        assert events_equal(ev, back), f"Java decoded {name} to different values"


def test_rlstream_decodes_every_event_type_written_by_java(avro_java, codec, tmp_path):
    events = one_of_each(codec)
    for name, ev in events.items():
        with open(tmp_path / f"{name}.json", "w") as f:
            fastavro.json_writer(f, codec.registry.latest(name).parsed, [to_datum(ev)])
    out = avro_java("encode", tmp_path)
    print(out)
    for name, ev in events.items():
        data = (tmp_path / f"{name}.bin").read_bytes()
        assert data[:2] == MAGIC and data[2:HEADER_LEN] == codec.registry.latest(name).fingerprint
        assert data == codec.encode(ev), f"{name}: Java's bytes differ from rlstream's"
        assert events_equal(ev, codec.decode(data)), name
