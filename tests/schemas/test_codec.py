"""The Avro codec: round trips, schema evolution, and every way bytes can be bad.

Evolution uses a test-only v3 of SampleBatch (``avsc_v2/``: adds ``priority`` with a default), a
version after the newest real one (the ``v2`` fixture: the newer process).
"""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass
from pathlib import Path

import fastavro
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import schemas.codec as codec_mod
from schemas.codec import HEADER_LEN, MAGIC, SCHEMA_HEADER, Codec, SchemaTopic
from schemas.errors import (
    CodecError,
    CorruptEventError,
    InvalidEventError,
    SchemaMismatchError,
    UnknownSchemaError,
)
from schemas.events import EVENT_TYPES, SampleBatch, to_datum
from schemas.examples import events_equal, example_events, sample_batch
from schemas.registry import AVSC_DIR, SchemaRegistry
from streams.bus.memory import MemoryBus
from streams.topics import SCHEMAS

V2_DIR = Path(__file__).parent / "avsc_v2"


@pytest.fixture(scope="module")
def codec() -> Codec:
    return Codec(SchemaRegistry())


def raw_encode(reg, datum: dict) -> bytes:
    """Single-object encode ``datum`` with a registered schema, bypassing the dataclasses."""
    buf = io.BytesIO()
    buf.write(MAGIC + reg.fingerprint)
    fastavro.schemaless_writer(buf, reg.parsed, datum)
    return buf.getvalue()


# -- round trips ---------------------------------------------------------------------------------

def test_every_event_type_round_trips(codec):
    events = example_events()
    assert {type(e).AVRO_NAME for e in events} == set(EVENT_TYPES) - {"rlstream.ClaimCheck"}
    for ev in events:
        data = codec.encode(ev)
        assert data[:2] == MAGIC and data[2:HEADER_LEN] == codec.writer_schema(type(ev)).fingerprint
        back = codec.decode(data)
        assert events_equal(ev, back), type(ev).__name__
        typed = codec.decode(data, type(ev))
        assert type(typed) is type(ev) and events_equal(ev, typed)
        assert codec.headers_for(ev)[SCHEMA_HEADER] == f"{type(ev).AVRO_NAME}/{codec.writer_schema(type(ev)).version}".encode()
    pv = codec.decode(codec.encode(events[4]))
    assert pv.weights is None and pv.weights_ref.size == 123456789


def test_decoded_arrays_keep_dtype_shape_and_are_read_only(codec):
    sb = sample_batch(T=3, N=2)
    back = codec.decode(codec.encode(sb))
    assert back.obs.dtype == np.float32 and back.obs.shape == (3, 2, 17)
    assert back.terminated.dtype == np.bool_ and back.final_obs_index.dtype == np.int64
    with pytest.raises(ValueError):
        back.obs[0, 0, 0] = 1.0
    back.validate()


def test_decode_expected_type_mismatch(codec):
    data = codec.encode(example_events()[5])  # GradientStep
    with pytest.raises(SchemaMismatchError):
        codec.decode(data, SampleBatch)


# -- evolution -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class SampleBatchV2(SampleBatch):
    """What a newer reader/writer is built with: the dataclass of the test-only SampleBatch v3."""

    priority: float = 0.0


@pytest.fixture
def v2(monkeypatch):
    """A codec built with the test-only SampleBatch v3 (its registry has v1 to v3; its class has priority)."""
    monkeypatch.setitem(codec_mod.EVENT_TYPES, SampleBatch.AVRO_NAME, SampleBatchV2)
    return Codec(SchemaRegistry([AVSC_DIR, V2_DIR]))


def test_v2_registry_resolves_to_v2_with_a_new_fingerprint(v2, codec):
    new, old = v2.writer_schema(SampleBatch), codec.writer_schema(SampleBatch)
    assert (new.version, old.version) == (3, 2)
    assert new.fingerprint != old.fingerprint


def test_new_reader_reads_old_event_with_the_default(v2, codec):
    old_bytes = codec.encode(sample_batch(seq=4))
    back = v2.decode(old_bytes)
    assert isinstance(back, SampleBatchV2) and back.priority == 0.0 and back.seq == 4
    assert events_equal(sample_batch(seq=4), SampleBatch(**{f.name: getattr(back, f.name)
                                                           for f in dataclasses.fields(SampleBatch)}))


def test_old_reader_reads_new_event_once_it_learnt_the_writer_schema(v2):
    new_event = SampleBatchV2(**{f.name: getattr(sample_batch(seq=5), f.name)
                                 for f in dataclasses.fields(SampleBatch)}, priority=0.75)
    data = v2.encode(new_event)
    assert data[2:HEADER_LEN] == v2.writer_schema(SampleBatch).fingerprint
    assert v2.decode(data).priority == 0.75

    old_registry = SchemaRegistry()  # built without v3
    with pytest.raises(UnknownSchemaError) as e:
        Codec(old_registry).decode(data)
    assert e.value.fingerprint == data[2:HEADER_LEN] and e.value.reason == "unknown_schema"

    bus = MemoryBus()
    topic = SchemaTopic(bus, SCHEMAS)
    topic.publish(v2.registry)  # the new writer publishes its schemas on the bus
    bus.produce(SCHEMAS, b"{not json", key=b"junk")  # a broken record does not stop the others
    old = Codec(old_registry, resolver=topic)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(codec_mod.EVENT_TYPES, SampleBatch.AVRO_NAME, SampleBatch)  # the old process's class
        back = old.decode(data)
    assert type(back) is SampleBatch and back.seq == 5 and not hasattr(back, "priority")
    # Learning v3 does not make it the old process's own schema: it still writes v2.
    assert old.writer_schema(SampleBatch).version == 2
    assert old.encode(sample_batch())[2:HEADER_LEN] == SchemaRegistry().latest(SampleBatch.AVRO_NAME).fingerprint
    assert topic.refresh(old_registry) == 0  # nothing new the second time


# -- bad bytes -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good(codec) -> bytes:
    return codec.encode(sample_batch())


@pytest.mark.parametrize("mutate", [
    pytest.param(lambda b: b"\x00\x01" + b[2:], id="bad-magic"),
    pytest.param(lambda b: b[:5], id="shorter-than-header"),
    pytest.param(lambda b: b"", id="empty"),
    pytest.param(lambda b: b[: len(b) // 2], id="truncated"),
    pytest.param(lambda b: b[:-1], id="last-byte-missing"),
    pytest.param(lambda b: b[:HEADER_LEN] + b"\xff" * 40, id="garbage-after-header"),
    pytest.param(lambda b: b + b"\x00", id="trailing-byte"),
    pytest.param(lambda b: b + b[HEADER_LEN:], id="two-datums"),
])
def test_corrupt_bytes(codec, good, mutate):
    with pytest.raises(CorruptEventError) as e:
        codec.decode(mutate(good))
    assert e.value.reason == "corrupt"


# -- fingerprint byte order ------------------------------------------------------------------------

def _spec_fingerprint64(data: bytes) -> int:
    """The Avro spec's CRC-64-AVRO (``fingerprint64``), written out from the spec."""
    empty, mask = 0xC15D213AA4D7A795, (1 << 64) - 1
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (empty & (-(fp & 1) & mask))
        table.append(fp)
    fp = empty
    for b in data:
        fp = (fp >> 8) ^ table[(fp ^ b) & 0xFF]
    return fp


def test_header_fingerprint_is_little_endian_as_the_spec_says(codec):
    from fastavro.schema import to_parsing_canonical_form

    for ev in example_events():
        reg = codec.writer_schema(type(ev))
        value = _spec_fingerprint64(to_parsing_canonical_form(reg.parsed).encode())
        assert codec.encode(ev)[2:HEADER_LEN] == value.to_bytes(8, "little"), reg.name


def test_old_byte_order_is_still_read_with_one_warning_per_schema(codec, caplog):
    import schemas.registry as registry_mod

    events = example_events()
    old = [MAGIC + codec.encode(ev)[2:HEADER_LEN][::-1] + codec.encode(ev)[HEADER_LEN:] for ev in events]
    with pytest.MonkeyPatch.context() as mp, caplog.at_level("WARNING", logger="schemas.registry"):
        mp.setattr(registry_mod, "_warned_legacy", set())
        for _ in range(3):
            for ev, data in zip(events, old):
                assert events_equal(ev, codec.decode(data)), type(ev).__name__
    warned = [r.getMessage() for r in caplog.records if "pre-spec fingerprint" in r.getMessage()]
    assert sorted(w.split()[1] for w in warned) == sorted({type(e).AVRO_NAME for e in events})


def test_schema_topic_entries_keyed_by_the_old_byte_order_stay_readable(v2):
    """A schema topic written by an older rlstream (keys in the old order) still teaches a
    reader the writer schema, whichever order the records use."""
    new_event = SampleBatchV2(**{f.name: getattr(sample_batch(seq=6), f.name)
                                 for f in dataclasses.fields(SampleBatch)}, priority=0.5)
    data = v2.encode(new_event)
    bus = MemoryBus()
    for reg in v2.registry.all():  # what the old SchemaTopic.publish wrote
        doc = {"name": reg.name, "version": reg.version, "schema": reg.standalone_json}
        bus.produce(SCHEMAS, codec_mod.json.dumps(doc).encode(), key=reg.legacy_fingerprint)
    reader = Codec(SchemaRegistry(), resolver=SchemaTopic(bus, SCHEMAS))
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(codec_mod.EVENT_TYPES, SampleBatch.AVRO_NAME, SampleBatch)
        assert reader.decode(data).seq == 6
        assert reader.decode(MAGIC + data[2:HEADER_LEN][::-1] + data[HEADER_LEN:]).seq == 6


def test_not_bytes_is_corrupt(codec):
    with pytest.raises(CorruptEventError):
        codec.decode("a string")  # type: ignore[arg-type]


def test_unknown_fingerprint(codec, good):
    with pytest.raises(UnknownSchemaError):
        codec.decode(MAGIC + bytes(8) + good[HEADER_LEN:])


def _sample_datum(**tensor_overrides) -> dict:
    d = to_datum(sample_batch())
    for name, change in tensor_overrides.items():
        d[name] = {**d[name], **change}
    return d


@pytest.mark.parametrize("override", [
    pytest.param({"obs": {"data": b"\x00" * 7}}, id="wrong-byte-count"),
    pytest.param({"rewards": {"dtype": "complex64"}}, id="bad-dtype"),
    pytest.param({"rewards": {"dtype": "object"}}, id="object-dtype"),
    pytest.param({"rewards": {"shape": [-1, 4]}}, id="negative-dim"),
    pytest.param({"rewards": {"shape": [2 ** 62, 2 ** 3], "data": b""}}, id="overflowing-shape"),
    pytest.param({"rewards": {"shape": [2 ** 32, 2 ** 32, 4], "data": b""}}, id="wrapping-shape"),
])
def test_invalid_tensor(codec, override):
    data = raw_encode(codec.writer_schema(SampleBatch), _sample_datum(**override))
    with pytest.raises(InvalidEventError) as e:
        codec.decode(data)
    assert e.value.reason == "invalid"


def test_unsupported_dtype_is_refused_on_encode(codec):
    sb = dataclasses.replace(sample_batch(), rewards=np.zeros((8, 4), dtype=np.float16))
    with pytest.raises(InvalidEventError):
        codec.encode(sb)


@pytest.mark.parametrize("field,value", [("rewards", np.nan), ("obs", np.inf), ("behaviour_logp", -np.inf)])
def test_non_finite_sample_batch_is_invalid(codec, field, value):
    sb = sample_batch()
    arr = getattr(sb, field).copy()
    arr.flat[3] = value
    back = codec.decode(codec.encode(dataclasses.replace(sb, **{field: arr})))  # decodes ...
    with pytest.raises(InvalidEventError, match=field):
        back.validate()  # ... but is not valid
    pb = example_events()[2]
    with pytest.raises(InvalidEventError):
        dataclasses.replace(pb, sample=back).validate()


def test_shape_mismatch_is_invalid(codec):
    sb = dataclasses.replace(sample_batch(), behaviour_logp=np.zeros((8, 3), dtype=np.float32))
    with pytest.raises(InvalidEventError, match="behaviour_logp"):
        codec.decode(codec.encode(sb)).validate()


# -- fuzz ----------------------------------------------------------------------------------------

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                derandomize=True)
_CODEC = Codec(SchemaRegistry())
_VALID = [_CODEC.encode(e) for e in example_events()] + [_CODEC.encode(sample_batch(T=2, N=2))]


def _decode_only_codec_errors(data: bytes) -> None:
    try:
        ev = _CODEC.decode(data)
    except CodecError:
        return
    validate = getattr(ev, "validate", None)
    if validate is not None:
        try:
            validate()
        except CodecError:
            pass


@FUZZ
@given(st.binary(max_size=512))
def test_fuzz_random_bytes(data):
    _decode_only_codec_errors(data)


@FUZZ
@given(st.sampled_from(_VALID), st.binary(min_size=1, max_size=8))
def test_fuzz_random_bytes_after_a_valid_header(valid, tail):
    _decode_only_codec_errors(valid[:HEADER_LEN] + tail)


@FUZZ
@given(st.sampled_from(_VALID), st.lists(st.tuples(st.integers(0, 10 ** 6), st.integers(0, 255)),
                                         min_size=1, max_size=8),
       st.integers(0, 10 ** 6), st.binary(max_size=16))
def test_fuzz_mutated_valid_events(valid, flips, cut, insert):
    data = bytearray(valid)
    for pos, byte in flips:
        data[HEADER_LEN + pos % (len(data) - HEADER_LEN)] = byte  # keep the header: reach the datum
    data = bytes(data)
    at = HEADER_LEN + cut % (len(data) - HEADER_LEN + 1)
    _decode_only_codec_errors(data)
    _decode_only_codec_errors(data[:at])
    _decode_only_codec_errors(data[:at] + insert + data[at:])
