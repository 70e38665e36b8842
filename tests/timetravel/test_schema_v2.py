"""PolicyVersion v2 / GradientStep v2: logs written with v1 stay readable (the new fields take
their defaults) and a v1 run is reported as not replayable rather than mis-verified."""

from __future__ import annotations

import io

import fastavro

from logtools.timetravel.verify import MISSING, verify
from logtools.timetravel.record import Recorded
from schemas.codec import MAGIC, Codec
from schemas.events import GradientStep, PolicyVersion, to_datum
from streams.bus.base import Record


def encode_v1(codec: Codec, event) -> bytes:
    reg = codec.registry.get(event.AVRO_NAME, 1)
    datum = {k: v for k, v in to_datum(event).items() if k in {f["name"] for f in reg.parsed["fields"]}}
    buf = io.BytesIO()
    buf.write(MAGIC + reg.fingerprint)
    fastavro.schemaless_writer(buf, reg.parsed, datum)
    return buf.getvalue()


def test_v1_records_decode_with_the_v2_defaults_and_v2_round_trips():
    codec = Codec()
    assert codec.writer_schema(PolicyVersion).version == 2 and codec.writer_schema(GradientStep).version == 2
    pv = PolicyVersion(policy_id="p", version=3, created_at_ms=1, learner_id="l", algo="ppo", weights=b"w",
                       state_sha256="ab" * 32, provenance='{"run_id": "r"}')
    gs = GradientStep(learner_id="l", step=1, from_version=2, to_version=3, algo="ppo", losses={}, grad_norm=0.0,
                      batch_ids=["b"], num_samples=8, started_at_ms=1, finished_at_ms=2, batch_digests=["cd" * 32])
    old_pv, old_gs = codec.decode(encode_v1(codec, pv)), codec.decode(encode_v1(codec, gs))
    assert old_pv.state_sha256 is None and old_pv.provenance == "" and old_pv.weights == b"w"
    assert old_gs.batch_digests == [] and old_gs.batch_ids == ["b"]
    assert codec.decode(codec.encode(pv)) == pv and codec.decode(codec.encode(gs)) == gs


def test_a_v1_run_is_reported_as_not_replayable():
    codec = Codec()
    pv = PolicyVersion(policy_id="p", version=0, created_at_ms=1, learner_id="l", algo="ppo", weights=b"w")
    rec = Record("rl.policy.versions", 0, 0, b"p", encode_v1(codec, pv))
    run = Recorded(run_id="", policy_id="p", source="test", codec=codec, versions={0: (rec, codec.decode(rec.value))},
                   steps=[], prepared={}, prepared_order=[], raw={}, dead_letters=[])
    report = verify(run)
    assert not report.ok and report.divergence.reason == MISSING
    assert "no provenance" in report.divergence.detail
