"""The scale test (issue 11, point 6): ``rlstream train --mode decoupled`` on a real broker with
4 partitions, 3 actors, 2 Faust workers and 2 learner ranks (gloo). One Faust worker is SIGKILLed
once prepared batches flow; the supervisor restarts it and the run ends normally (exit 0).

Afterwards every sample is accounted for from the run's topics, read with a plain bus:

    produced (SampleBatch records on rl.samples.raw)
      = trained (batch ids of the GradientSteps, across ranks)
      + dropped with a reason (the streams' and the learner's counters)
      + dead-lettered with a reason (rl.deadletter, other than copies of a batch already prepared)
      + left untrained: prepared records at or beyond the learner group's committed offset of
        their partition (the learner stopped at its budget, or the rest was short of a global batch:
        each rank's share of an update comes from its own partitions).

Nothing is trained twice and PolicyVersion versions are strictly increasing."""

from __future__ import annotations

import json
import os
import signal
from collections import Counter, defaultdict

import pytest

from schemas.codec import Codec
from schemas.events import DeadLetter, GradientStep, PolicyVersion, PreparedBatch, SampleBatch
from streams.bus.kafka import KafkaBus
from streams.topics import (
    DEADLETTER,
    LEARNER_GROUP,
    LEARNER_STEPS,
    POLICY_VERSIONS,
    SAMPLES_PREPARED,
    SAMPLES_RAW,
    Namespace,
)
from tests.support.kafka import committed

from .conftest import FRAGMENT, Ledger, TopicCounter, check_acknowledged, wait_for
from .test_supervision import child_pid, start_decoupled

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
CODEC = Codec()
NS = Namespace("scale")
ACTORS, PARTITIONS, WORKERS, RANKS = 3, 4, 2, 2


def read_topics(bootstrap: str) -> dict[str, list[tuple[int, int, object]]]:
    """logical topic -> [(partition, offset, event)] of the run's namespace."""
    out: dict[str, list] = {}
    with KafkaBus(bootstrap, client_id="scale-ledger", auto_create=False) as bus:
        for logical in (SAMPLES_RAW, SAMPLES_PREPARED, LEARNER_STEPS, POLICY_VERSIONS, DEADLETTER):
            out[logical] = [(r.partition, r.offset, CODEC.decode(r.value)) for r in bus.read_all(NS.topic(logical))]
    return out


def drop_counters(processes: dict) -> Counter:
    """reason -> samples the stream workers dropped (their summaries' ``dropped_samples``), less
    ``duplicate``: a second copy of a batch already prepared (a restarted worker re-reading records
    its predecessor had not committed), not a produced sample."""
    out = Counter()
    for name, summary in processes.items():
        if name.startswith("streams"):
            out.update(summary["dropped_samples"])
    out.pop("duplicate", None)
    return out


def test_four_partitions_three_actors_two_workers_two_ranks_account_for_every_sample(private_kafka, tmp_path):
    run_dir = tmp_path / "run"
    parent = start_decoupled(private_kafka.bootstrap, NS, run_dir, tmp_path / "parent.log",
                             "--num-actors", str(ACTORS), "--partitions", str(PARTITIONS),
                             "--stream-workers", str(WORKERS), "--learners", str(RANKS),
                             "--total-steps", str(12 * FRAGMENT), "--torch-threads", "1")
    prepared = None
    marker = str(run_dir / "streams-data")  # the first Faust worker's data dir

    def logs() -> str:
        return "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-3000:]}"
                         for p in [tmp_path / "parent.log", *sorted(run_dir.glob("*.log"))])
    def started() -> bool:  # the parent created the topics (a consumer of ours must not auto-create them)
        assert parent.poll() is None, logs()
        return "decoupled_started" in (tmp_path / "parent.log").read_text()
    try:
        wait_for(started, 120, "the run to create its topics", every=0.5, on_timeout=logs)
        prepared = TopicCounter(private_kafka.bootstrap, NS.topic(SAMPLES_PREPARED))
        wait_for(lambda: prepared.poll() >= 2 and child_pid(marker) is not None, 240,
                 "prepared batches before the kill", on_timeout=logs)
        first = child_pid(marker)
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: (child_pid(marker) or first) != first, 120, "a new Faust worker", on_timeout=logs)
        rc = parent.wait(timeout=400)
    finally:
        if prepared is not None:
            prepared.close()
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
            parent.wait()
    assert rc == 0, logs()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["restarts"] == {"streams": 1} and summary["ended"] in ("learner_done", "drained"), summary

    topics = read_topics(private_kafka.bootstrap)
    raw = [e for _, _, e in topics[SAMPLES_RAW] if isinstance(e, SampleBatch)]
    steps = [e for _, _, e in topics[LEARNER_STEPS] if isinstance(e, GradientStep)]
    versions = [e.version for _, _, e in topics[POLICY_VERSIONS] if isinstance(e, PolicyVersion)]
    dead = [e for _, _, e in topics[DEADLETTER] if isinstance(e, DeadLetter)]
    size = {b.batch_id: b.num_steps for b in raw}

    produced = [b.batch_id for b in raw]
    assert len(produced) == len(set(produced)), "an actor published a batch id twice"
    assert {b.actor_id for b in raw} == {f"actor-{i}" for i in range(ACTORS)}
    assert len({p for p, _, _ in topics[SAMPLES_RAW]}) > 1, "the actors' keys all hashed to one partition"
    trained = [b for s in steps for b in s.batch_ids]
    assert len(trained) == len(set(trained)), f"trained twice: {[b for b, n in Counter(trained).items() if n > 1]}"
    assert set(trained) <= set(produced), "trained on batches that are not in rl.samples.raw"
    assert sum(s.num_samples for s in steps) == sum(size[b] for b in trained)
    assert versions == sorted(set(versions)), f"versions not strictly increasing: {versions}"
    assert len(versions) == 1 + len(steps)  # the start, then one per update, from one rank

    # dead letters: the restarted worker's copies of batches it (or its predecessor) already
    # prepared are skipped as "duplicate"; any other reason would drop produced samples
    reasons = Counter(d.reason for d in dead)
    dead_lettered = {r: n for r, n in reasons.items() if r != "duplicate"}
    # left untrained: prepared at or beyond the learner group's commit on its partition
    commits = committed(private_kafka.bootstrap, NS.group(LEARNER_GROUP), NS.topic(SAMPLES_PREPARED))
    first_prepared: dict[str, tuple[int, int]] = {}
    for p, o, e in topics[SAMPLES_PREPARED]:
        if isinstance(e, PreparedBatch):
            first_prepared.setdefault(e.sample.batch_id, (p, o))
    untrained = set(produced) - set(trained)
    beyond = {b for b in untrained if b in first_prepared
              and first_prepared[b][1] >= max(commits.get(first_prepared[b][0], 0), 0)}
    behind = {b for b in untrained if b in first_prepared} - beyond
    assert behind == set(), f"prepared, committed by the learner group, yet never trained: {sorted(behind)}"
    procs = summary["processes"]
    # each Faust worker wrote its own summary (the restarted one too), none overwrote another's
    assert {"streams", "streams-1"} <= set(procs), sorted(procs)
    assert sum(procs[f"actor-{i}"]["steps"] for i in range(ACTORS)) == sum(size.values())  # the actors' own count
    assert procs["learner"]["samples_trained"] == sum(size[b] for b in trained)
    drops = drop_counters(procs)
    never_prepared = untrained - set(first_prepared)
    account = {"produced": len(produced), "trained": len(trained), "dropped": dict(drops),
               "dead_lettered": dead_lettered, "left_untrained": len(beyond),
               "duplicate_copies_skipped": reasons.get("duplicate", 0),
               "learner_duplicates_skipped": procs["learner"]["duplicates_skipped"], "updates": len(steps),
               "versions": len(versions), "commits": commits, "ended": summary["ended"]}
    # each actor's own account (the seqs the broker acknowledged) is what the topic holds; the
    # training side of it is the account above (some may be left untrained at the commit)
    account["actors"] = check_acknowledged(Ledger(raw=raw, steps=steps),
                                           [procs[f"actor-{i}"] for i in range(ACTORS)], trained_once=None)
    print("SCALE account:", json.dumps(account, sort_keys=True))
    # produced = trained + dropped + dead-lettered + left untrained (in batches)
    assert len(produced) == len(trained) + len(never_prepared) + len(beyond), account
    lost = sum(size[b] for b in never_prepared) - sum(drops.values()) - FRAGMENT * sum(dead_lettered.values())
    skipped = sum(p["reorder"]["skipped_seqs"] for n, p in procs.items() if n.startswith("streams"))
    # nothing lost: a raw record a worker held for reordering is never committed past (the Faust
    # shell acks in offset order, streams.shell.InOrderAcks), so a SIGKILL cannot lose it
    assert lost == 0, f"{lost} samples lost, {sorted(never_prepared)}, reorder skipped_seqs={skipped}: {account}"
    # What is left untrained is waiting at the head of the learner group's partitions, uncommitted,
    # so a resumed learner trains it: a global update takes train_batch_size / ranks samples from
    # every rank, and once the actors stop, a rank whose partitions ran dry holds back the others.
    per_partition = defaultdict(set)
    for p, _, e in topics[SAMPLES_PREPARED]:
        if isinstance(e, PreparedBatch) and e.sample.batch_id in set(trained):
            per_partition[p].add(e.sample.batch_id)
    assert len(per_partition) > 1, "the learner group trained from one partition only"
