"""One run read back from its event log: the source of truth of verify, fork and lineage.

A source is a co-located run's log (``<run>/log`` on the memory bus) or Kafka; either is read
through the ``streams.bus`` interface, topic names from ``streams.topics``. A run is the line
of PolicyVersions whose provenance names its run id (default: the run of the newest version of
``policy_id``), with the GradientSteps that produced them and the batches they trained on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from learner.provenance import parse_provenance
from config import BusConfig
from schemas.codec import Codec, SchemaTopic
from schemas.errors import CodecError
from schemas.events import DeadLetter, GradientStep, PolicyVersion, PreparedBatch, SampleBatch
from streams.bus import Bus, make_bus
from streams.bus.base import Record
from streams.topics import DEADLETTER, LEARNER_STEPS, POLICY_VERSIONS, SAMPLES_PREPARED, SAMPLES_RAW, SCHEMAS, Namespace


class RunNotFound(ValueError):
    """The source holds no run that matches (no log, no versions, no provenance)."""


@dataclass
class Recorded:
    """The events of one run, in log order, with the raw records they came from."""

    run_id: str
    policy_id: str
    source: str
    codec: Codec
    versions: dict[int, tuple[Record, PolicyVersion]]
    steps: list[tuple[Record, GradientStep]]
    prepared: dict[str, list[Record]]  # batch_id -> every prepared record of it, in log order
    prepared_order: list[str]  # batch ids in log order (first occurrence)
    raw: dict[str, Record]  # batch_id -> first raw SampleBatch record
    dead_letters: list[tuple[Record, DeadLetter]]
    undecodable: list[tuple[str, Record, str]] = field(default_factory=list)  # (topic, record, why)

    def provenance(self, version: int) -> dict[str, Any]:
        return parse_provenance(self.versions[version][1].provenance)

    @property
    def first_version(self) -> int:
        return min(self.versions)

    @property
    def last_version(self) -> int:
        return max(self.versions)

    def prepared_batch(self, batch_id: str) -> tuple[Record, PreparedBatch] | None:
        """The first prepared record of ``batch_id`` that decodes, or None."""
        for rec in self.prepared.get(batch_id, []):
            try:
                return rec, self.codec.decode(rec.value, PreparedBatch)
            except CodecError:
                continue
        return None


def open_bus(run: str | Path | None, bus: BusConfig | None = None) -> tuple[Bus, str]:
    """The bus of a run directory (or its ``log``), else of ``bus`` (Kafka); and its name."""
    if run is not None:
        path = Path(run)
        log = path / "log" if (path / "log" / "_topics.json").exists() else path
        if not (log / "_topics.json").exists():
            raise RunNotFound(f"no event log at {path} (expected {path}/log/_topics.json)")
        return make_bus("memory", path=str(log)), str(path.resolve())  # a fork records it: absolute
    if bus is None or bus.kind != "kafka":
        raise RunNotFound("give a run directory, or --bus kafka for a decoupled run")
    kafka = make_bus("kafka", bootstrap=bus.bootstrap, config=dict(bus.security))
    if not bus.namespace:
        return kafka, f"kafka://{bus.bootstrap}"
    from streams.bus.namespaced import NamespacedBus

    return NamespacedBus(kafka, Namespace(bus.namespace)), f"kafka://{bus.bootstrap}/{bus.namespace}"


def _decode_all(bus: Bus, codec: Codec, topic: str, cls: type, bad: list) -> list[tuple[Record, Any]]:
    out = []
    for rec in bus.read_all(topic):
        try:
            out.append((rec, codec.decode(rec.value, cls)))
        except CodecError as e:
            bad.append((topic, rec, str(e)))
    return out


def _batch_id(codec: Codec, value: bytes) -> str | None:
    """The batch id inside an encoded SampleBatch/PreparedBatch (a dead letter's bytes), or None."""
    try:
        ev = codec.decode(value)
    except CodecError:
        return None
    if isinstance(ev, PreparedBatch):
        return ev.sample.batch_id
    return ev.batch_id if isinstance(ev, SampleBatch) else None


def load(run: str | Path | None = None, bus: BusConfig | None = None, run_id: str | None = None,
         policy_id: str = "policy") -> Recorded:
    """Read one run (see the module docstring); RunNotFound when there is none."""
    b, source = open_bus(run, bus)
    try:
        codec = Codec(resolver=SchemaTopic(b, SCHEMAS))
        bad: list = []
        pvs = [(r, pv) for r, pv in _decode_all(b, codec, POLICY_VERSIONS, PolicyVersion, bad)
               if pv.policy_id == policy_id]
        if not pvs:
            raise RunNotFound(f"no version of policy {policy_id!r} in {source}")
        if run_id is None:
            run_id = parse_provenance(pvs[-1][1].provenance).get("run_id", "")
        versions = {pv.version: (r, pv) for r, pv in pvs
                    if parse_provenance(pv.provenance).get("run_id", "") == run_id}
        if not versions:
            raise RunNotFound(f"no version of policy {policy_id!r} from run {run_id!r} in {source}")
        learners = {pv.learner_id for _, pv in versions.values()}
        steps = [(r, s) for r, s in _decode_all(b, codec, LEARNER_STEPS, GradientStep, bad)
                 if s.to_version in versions and s.learner_id in learners]
        prepared: dict[str, list[Record]] = {}
        order: list[str] = []
        for rec in b.read_all(SAMPLES_PREPARED):
            bid = _batch_id(codec, rec.value)
            if bid is None:
                bad.append((SAMPLES_PREPARED, rec, "not a decodable PreparedBatch"))
                continue
            if bid not in prepared:
                order.append(bid)
            prepared.setdefault(bid, []).append(rec)
        raw: dict[str, Record] = {}
        for rec in b.read_all(SAMPLES_RAW):
            bid = _batch_id(codec, rec.value)
            if bid is not None:
                raw.setdefault(bid, rec)
        dead = _decode_all(b, codec, DEADLETTER, DeadLetter, bad)
        return Recorded(run_id=run_id, policy_id=policy_id, source=source, codec=codec, versions=versions,
                        steps=steps, prepared=prepared, prepared_order=order, raw=raw, dead_letters=dead,
                        undecodable=bad)
    finally:
        b.close()


def dead_letter_batch_id(run: Recorded, dl: DeadLetter) -> str | None:
    """The batch a dead letter is about (its bytes decoded), or None."""
    return _batch_id(run.codec, dl.value)
