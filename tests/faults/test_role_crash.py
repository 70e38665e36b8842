"""SIGKILL a learner or an actor process mid-run and start it again.

Learner: the resumed learner restores the newest snapshot and seeks to the input offsets it
recorded, so across both lives every committed SampleBatch is trained, and exactly these are
trained twice: the batches the first life trained AFTER that snapshot (their updates died
with the process; the snapshot does not contain them). Precisely, with ``S`` the snapshot the
second life restored (version ``v_S``, ``trained_batch_ids`` ``I_S``) and ``L1``/``L2`` the
batch ids of each life's GradientSteps:

* ``L1`` steps with ``to_version <= v_S`` trained exactly ``I_S``; call the rest ``A`` (after S);
* ``L2`` never retrains an id of ``I_S``, and ``L1 & L2 == A``: all of A is retrained, once;
* no id twice within a life; ``L1 | L2`` == every id in rl.samples.raw;
* versions strictly increase in the log; the second life's first version is the newest of the
  first life + 1, with parent ``v_S``.

Actor: a restarted actor reuses its actor_id and starts again at seq 0. The reorder stage
recognises the restart (``ReorderStats.restarts``) instead of rejecting the new seqs as late,
and training goes on with the new incarnation's batches. Then the stream processors crash
between publishing and committing: their replacement restores the per-actor state from the
changelog and drops the redelivered records as duplicates; one whose state had not reached the
changelog yet is prepared again and the learner skips that copy by batch_id (dead letter
``duplicate``): none is trained twice.
Every role is a process (``conftest.Rig``): the learner is frozen (SIGSTOP) once it has updates
past its newest snapshot and killed there, the Faust worker once it has published an output whose
input its group has not committed (read with a plain Kafka client).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from learner.snapshots.url import open_store
from schemas.codec import Codec
from streams.topics import LEARNER_STEPS, SAMPLES_PREPARED, SAMPLES_RAW

from .conftest import Ledger, TopicCounter, all_trained, check_acknowledged, check_trained_once, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
CODEC = Codec()


def resume_and_drain(rig, steps: TopicCounter, raw: TopicCounter, actor, streams, n1: int) -> tuple[dict, dict]:
    """Start the learner again with ``--resume`` (its first life made ``n1`` steps), wait for 3
    updates of it, stop the actor and wait until every produced batch is trained; stop the
    learner and the stream worker (which must have logged no error). The learner's summary and
    the actor's."""
    second = rig.learner(resume=True)
    wait_for(lambda: steps.poll() >= n1 + 3, 120, "3 updates of the resumed learner", on_timeout=rig.logs)
    actor_summary = actor.stop()
    wait_for(lambda: all_trained(raw, steps), 90, "every produced batch trained", on_timeout=rig.logs)
    summary = second.stop()
    assert not streams.errors, streams.errors
    streams.stop()
    return summary, actor_summary


def test_learner_sigkill_resumes_from_snapshot_and_offsets(private_kafka, rig):
    steps = TopicCounter(private_kafka.bootstrap, LEARNER_STEPS, CODEC.decode)
    raw = TopicCounter(private_kafka.bootstrap, SAMPLES_RAW, CODEC.decode)
    try:
        streams = rig.start_faust()
        first = rig.learner()
        actor = rig.actor(0)
        # snapshot_every=3. Freeze the learner (SIGSTOP) once it has published updates past its
        # newest snapshot; let it go on if not yet; SIGKILL it frozen: those updates die with it.
        store = open_store(rig.run_dir / "snapshots", keep_last=None)

        def frozen_past_a_snapshot() -> bool:
            if steps.poll() < 4:
                return False
            first.pause()
            steps.poll()
            if max(s.to_version for s in steps.items) > (store.latest() or 0) > 0:
                return True
            first.resume()
            return False

        wait_for(frozen_past_a_snapshot, 120, "updates of the first learner past a snapshot", every=0.3,
                 on_timeout=rig.logs)
        first.kill()
        life1 = Ledger.read(private_kafka.bootstrap)
        v_s = store.latest()
        assert v_s is not None, "the first learner left no snapshot"
        _, meta = store.load(v_s)
        snapshot_ids = set(meta["trained_batch_ids"])

        n1 = len(life1.steps)
        summary2, actor_summary = resume_and_drain(rig, steps, raw, actor, streams, n1)
    finally:
        steps.close()
        raw.close()

    ledger = Ledger.read(private_kafka.bootstrap)
    s1, s2 = ledger.steps[:n1], ledger.steps[n1:]
    assert [s.batch_ids for s in s1] == [s.batch_ids for s in life1.steps]
    ids1 = [i for s in s1 for i in s.batch_ids]
    ids2 = [i for s in s2 for i in s.batch_ids]
    assert len(ids1) == len(set(ids1)) and len(ids2) == len(set(ids2)), "an id trained twice within one life"
    covered = {i for s in s1 if s.to_version <= v_s for i in s.batch_ids}
    after = {i for s in s1 if s.to_version > v_s for i in s.batch_ids}
    assert covered == snapshot_ids, "the snapshot's trained ids are not what was trained up to it"
    assert not set(ids2) & snapshot_ids, "the resumed learner retrained batches its snapshot holds"
    assert after, "the learner was killed with no update past its snapshot"
    assert set(ids1) & set(ids2) == after, "exactly the batches trained after the snapshot are retrained"
    assert set(ids1) | set(ids2) == set(ledger.produced_ids)
    versions = [v.version for v in ledger.versions]
    assert versions == sorted(set(versions)), f"versions not strictly increasing: {versions}"
    v1_max = max(v.version for v in life1.versions)
    resumed = next(v for v in ledger.versions if v.version > v1_max)
    assert (resumed.version, resumed.parent_version) == (v1_max + 1, v_s)
    assert s2[0].from_version == v1_max + 1
    assert versions[-1] == summary2["final_version"]
    counts = {"produced": len(ledger.raw), "prepared": len(ledger.prepared), "trained_life1": len(ids1),
              "trained_life2": len(ids2), "snapshot_version": v_s, "snapshot_ids": len(snapshot_ids),
              "retrained_after_snapshot": len(after), "lost": len(set(ledger.produced_ids) - set(ids1) - set(ids2)),
              "duplicates_skipped": summary2.get("duplicates_skipped"), "versions": len(versions),
              "dead_letters": dict(ledger.dead_reasons()),
              # retrained after the snapshot: at least once, not exactly once
              "actors": check_acknowledged(ledger, [actor_summary], trained_once=False)}
    print("FAULT learner-sigkill counts:", json.dumps(counts, sort_keys=True))


def test_actor_sigkill_and_restart_with_the_same_id(private_kafka, rig):
    steps = TopicCounter(private_kafka.bootstrap, LEARNER_STEPS, CODEC.decode)
    raw = TopicCounter(private_kafka.bootstrap, SAMPLES_RAW, CODEC.decode)
    prepared = TopicCounter(private_kafka.bootstrap, SAMPLES_PREPARED, CODEC.decode)
    try:
        streams = rig.start_faust()
        learner = rig.learner()
        first = rig.actor(0)
        wait_for(lambda: steps.poll() >= 3, 120, "3 updates with the first actor", on_timeout=rig.logs)
        first.kill()
        n_before = raw.poll()
        second = rig.actor(0)  # same actor_id, seq from 0
        wait_for(lambda: raw.poll() >= n_before + 3 and steps.poll() >= n_before + 3, 120,
                 "3 batches of the restarted actor trained", on_timeout=rig.logs)
        wait_for(lambda: streams.stats()["reorder"]["restarts"] == 1, 60, "the processors to see the restart",
                 ignore=(OSError, ValueError, KeyError), on_timeout=rig.logs)
        first_stats = streams.stats()
        # the stream processors die too, after publishing and before committing: their
        # replacement must not let those records be trained twice
        streams.crash_between_publish_and_commit(prepared)
        n_steps = steps.poll()
        wait_for(lambda: steps.poll() >= n_steps + 2, 120, "2 updates after the streams restart",
                 on_timeout=rig.logs)
        second.stop()
        wait_for(lambda: all_trained(raw, steps), 90, "every produced batch trained", on_timeout=rig.logs)
        learner_summary = learner.stop()
        assert not streams.errors, streams.errors
        second_stats = streams.stop()
    finally:
        steps.close()
        raw.close()
        prepared.close()
    ledger = Ledger.read(private_kafka.bootstrap)
    counts = check_trained_once(ledger)
    seqs = [b.seq for b in ledger.raw]
    assert {b.actor_id for b in ledger.raw} == {"actor-0"}
    restart_at = next(i for i in range(1, len(seqs)) if seqs[i] < seqs[i - 1])
    assert seqs[:restart_at] == list(range(restart_at)) and seqs[restart_at:] == list(range(len(seqs) - restart_at))
    assert streams.crashes == 1 and len(streams.workers) == 2
    assert first_stats["drops"] == {}, first_stats  # nothing late, nothing lost
    assert set(second_stats["drops"]) <= {"duplicate"}, second_stats
    # each redelivered record was dropped by the replacement (the state it inherited) or, if its
    # state was not in the changelog yet, prepared again and skipped by the learner
    copies = counts["prepared"] - counts["prepared_unique"]
    assert copies + second_stats["drops"].get("duplicate", 0) >= 1
    assert counts["duplicates_skipped"] == copies == learner_summary["duplicates_skipped"]
    assert set(ledger.dead_reasons()) <= {"duplicate"}
    counts.update(streams=[first_stats["reorder"], second_stats["reorder"]], first_incarnation=restart_at,
                  second_incarnation=len(seqs) - restart_at, learner_duplicates_skipped=learner_summary.get("duplicates_skipped"))
    print("FAULT actor-sigkill counts:", json.dumps(counts, sort_keys=True))


def test_learner_preempted_sigterm_then_sigkill_resumes_without_training_twice(private_kafka, rig):
    """A spot preemption as Kubernetes delivers it to the learner pod of compose/k8s/learner.yaml:
    SIGTERM, then SIGKILL once terminationGracePeriodSeconds (25 s) has passed. The learner was
    started with ``--resume`` (as the manifest starts it; nothing to resume yet), writes its last
    snapshot on SIGTERM and exits within the grace; the SIGKILL finds it gone. The replacement,
    started the same way, restores that snapshot and its offsets: nothing is trained twice, every
    produced batch is trained, versions go on from the last one."""
    grace_s = 25.0  # learner.yaml's terminationGracePeriodSeconds
    steps = TopicCounter(private_kafka.bootstrap, LEARNER_STEPS, CODEC.decode)
    raw = TopicCounter(private_kafka.bootstrap, SAMPLES_RAW, CODEC.decode)
    store = open_store(rig.run_dir / "snapshots", keep_last=None)
    try:
        streams = rig.start_faust()
        first = rig.learner(resume=True)
        actor = rig.actor(0)
        # updates past the newest periodic snapshot (snapshot_every=3): SIGKILL alone would retrain them
        wait_for(lambda: steps.poll() >= 4 and steps.poll() % 3 != 0, 120, "updates past a snapshot",
                 every=0.2, on_timeout=rig.logs)
        first.ended_by_test = True
        os.killpg(first.proc.pid, signal.SIGTERM)
        try:
            first.proc.wait(grace_s)
            exited_in_grace = True
        except subprocess.TimeoutExpired:
            exited_in_grace = False
        first.kill()  # the kubelet's SIGKILL at the end of the grace period (a no-op if it is gone)
        assert exited_in_grace, f"the learner outlived its grace period:\n{first.tail()}"
        life1 = Ledger.read(private_kafka.bootstrap)
        n1 = len(life1.steps)
        v_last = store.latest()
        assert v_last == max(v.version for v in life1.versions), "no last snapshot of the newest version"
        _, meta = store.load(v_last)
        assert set(meta["trained_batch_ids"]) == {i for s in life1.steps for i in s.batch_ids}

        summary2, actor_summary = resume_and_drain(rig, steps, raw, actor, streams, n1)
    finally:
        steps.close()
        raw.close()

    ledger = Ledger.read(private_kafka.bootstrap)
    counts = check_trained_once(ledger)  # none twice, none lost, versions strictly increasing
    counts["actors"] = check_acknowledged(ledger, [actor_summary])
    resumed = next(v for v in ledger.versions if v.version > v_last)
    assert (resumed.version, resumed.parent_version) == (v_last + 1, v_last)
    assert ledger.steps[n1].from_version == v_last + 1
    assert [v.version for v in ledger.versions][-1] == summary2["final_version"]
    print("FAULT learner-preempted counts:", json.dumps({**counts, "snapshot_version": v_last,
                                                          "trained_life1": sum(len(s.batch_ids) for s in life1.steps)},
                                                         sort_keys=True))
