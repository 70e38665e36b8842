"""``rlstream fork RUN --from-version V``: a new run whose learner begins from version V's
exact state and trains first on the batches the parent recorded after V.

V's state is rebuilt by replaying the parent's log (and checked, version by version, as
``verify`` does), so a fork never starts from a state the log does not prove. The new run
directory gets its own event log: version V (the same weights, provenance naming the parent
run and version), a snapshot of V, and the parent's PreparedBatch records after V verbatim,
delivered to a real ``Learner`` (``--set`` overrides applied to the algorithm's config) one
recorded step at a time, then the ones still in flight when the parent stopped. With identical
settings its versions V+1, V+2 ... are the parent's, bit for bit. The fork ends with a
snapshot of its newest version.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from pathlib import Path
from typing import Any

from learner.learner import Learner, LearnerConfig
from learner.provenance import stamp
from learner.snapshots.url import open_store
from config import BusConfig
from streams.policies import arch_of, publish_policy_version
from logtools.timetravel.record import Recorded
from logtools.timetravel.verify import Replay, build_from_provenance, format_report, recorded_threads
from schemas.events import now_ms
from streams.bus import open_bus
from streams.events import event_bus
from streams.topics import SAMPLES_PREPARED


class ForkError(RuntimeError):
    """The fork cannot start (no such version, V not reproducible from the log, target in use)."""


def _records_after(parent: Recorded, version: int) -> list[list]:
    """Prepared records for the fork, in deliveries: one per parent step after ``version`` (its
    batches in step order), then one of the untrained ones (in flight when the parent stopped)."""
    trained_before = {bid for _, s in parent.steps if s.to_version <= version for bid in s.batch_ids}
    groups = [list(s.batch_ids) for _, s in parent.steps if s.from_version >= version]
    taken = {bid for g in groups for bid in g} | trained_before
    groups.append([bid for bid in parent.prepared_order if bid not in taken])
    return [[parent.prepared[bid][0] for bid in g if bid in parent.prepared] for g in groups]


def _deliver(bus, records: list) -> None:
    for rec in records:
        bus.produce(SAMPLES_PREPARED, rec.value, key=rec.key, headers=dict(rec.headers))
    bus.flush()


def _drain(learner: Learner, ends: dict[int, int]) -> None:
    """Step the learner until it has read up to ``ends`` and has no full batch left."""
    while True:
        trained = learner.step(0.0)
        caught_up = all((learner.consumer.ledger.upto((SAMPLES_PREPARED, p)) or 0) >= e for p, e in ends.items())
        if trained is None and caught_up:
            return


def fork(parent: Recorded, version: int, out: Path, *, overrides: dict[str, Any] | None = None,
         train_batch_size: int | None = None, run_id: str | None = None,
         parent_snapshots: str | Path | None = None, snapshot_every: int = 10) -> dict[str, Any]:
    """Create the fork in ``out`` and train it on the recorded batches; returns its summary."""
    if version not in parent.versions:
        raise ForkError(f"version {version} is not a version of run {parent.run_id!r} "
                        f"({parent.first_version}..{parent.last_version})")
    if (out / "log" / "_topics.json").exists():
        raise ForkError(f"{out} already holds a run's event log")
    replay = Replay(parent, parent_snapshots)
    report = replay.run_to(stop_after=version)
    if not report.ok or replay.version != version:
        raise ForkError(f"version {version} cannot be rebuilt exactly from the log:\n{format_report(report)}")
    prov = parent.provenance(version)
    algo = build_from_provenance(prov, overrides)
    algo.load_state_dict(replay.algo.state_dict())
    tbs = int(train_batch_size or prov.get("train_batch_size")
              or max((s.num_samples for _, s in parent.steps), default=2048))
    run_id = run_id or uuid.uuid4().hex[:12]
    fork_of = {"run_id": parent.run_id, "version": version, "source": parent.source}
    records = _records_after(parent, version)
    first = parent.prepared_batch(parent.prepared_order[0]) if parent.prepared_order else None
    env_id = first[1].sample.env_id if first else ""

    out.mkdir(parents=True, exist_ok=True)
    bus = open_bus(BusConfig(kind="memory", log_dir=str(out / "log")))
    events = event_bus(bus)
    store = open_store(str(out / "snapshots"))
    trained = [bid for _, s in parent.steps if s.to_version <= version for bid in s.batch_ids]
    meta = {"updates": len(report.checked) - 1, "algo": prov["algo"], "arch": arch_of(algo.policy),
            "env_id": env_id, "policy_id": parent.policy_id, "offsets": [], "trained_batch_ids": trained,
            "created_at_ms": now_ms(), "fork_of": fork_of}
    store.save(version, algo.policy.state_dict(), meta, state=algo.state_dict())
    pv = dataclasses.replace(parent.versions[version][1], created_at_ms=now_ms())
    publish_policy_version(events, stamp(pv, algo, run_id, fork_of, tbs))

    lcfg = LearnerConfig(learner_id=pv.learner_id, policy_id=parent.policy_id, algo=prov["algo"],
                         train_batch_size=tbs, snapshot_every=snapshot_every, env_id=env_id, run_id=run_id,
                         fork_of=fork_of)
    learner = Learner(lcfg, algo, events, snapshots=store, stream_ids=replay.stream_ids)
    learner.start(resume=False, from_version=version, publish=False)
    base = learner.stats.updates
    try:
        with recorded_threads(prov.get("determinism", {})):
            for group in records:  # delivered as the parent's learner received them, one step at a time
                _deliver(bus, group)
                _drain(learner, bus.end_offsets(SAMPLES_PREPARED))
        if learner.stats.updates > base:
            learner.snapshot()
    finally:
        learner.close()
        bus.close()
    summary = {"run_id": run_id, "fork_of": fork_of, "from_version": version, "overrides": overrides or {},
               "train_batch_size": tbs, "recorded_batches": sum(map(len, records)), "updates": learner.stats.updates - base,
               "final_policy_version": learner.version, "in_flight_transitions": learner.buffered,
               "duplicates_skipped": learner.stats.duplicates_skipped}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
