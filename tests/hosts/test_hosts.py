"""A decoupled run whose roles each run on a simulated host of their own (``conftest.py``):
the broker, the learner, the Faust worker and two actors, joined by one switch that loses
frames and delays packets, and the two network faults a cluster meets first.

* ``test_decoupled_run_across_lossy_hosts``: with loss on every link and delay on every host,
  the run trains to its budget and every role exits 0; the ledger (``tests/faults``) finds every
  produced batch trained once, nothing lost, versions increasing.
* ``test_actor_host_partition_heals``: one actor's host is cut off the switch for longer than the
  consumer session timeout (the Faust worker's and the learner's, 6 s) and healed: the learner
  keeps training the other actor's data meanwhile, the cut actor publishes nothing while cut and
  carries on after, and the ledger balances.
* ``test_learner_host_partition_actors_wait_and_resume``: the learner's host is cut off; the actors
  stall within their bound (``LearnerGate``: max-steps-ahead and max-backlog) instead of running
  on; the cut learner is SIGKILLed (a lost host), the cable comes back and a new learner starts
  there with ``--resume``: it restores its newest snapshot and the committed offsets, trains the
  rest of the budget, and no batch is lost or trained twice beyond the updates the lost learner
  made after its last snapshot.

Each prints its ledger (``HOSTS ... counts:``) and the impairments the switch applied.
"""

from __future__ import annotations

import json
import time

import pytest

from learner.snapshots.url import open_store
from schemas.codec import Codec
from streams.topics import LEARNER_STEPS, SAMPLES_RAW
from tests.faults.conftest import FRAGMENT, Ledger, TopicCounter, all_trained, check_trained_once
from tests.support import summary_of, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
CODEC = Codec()
LOSS_PCT = 2  # of the frames each way on every host's link
DELAY_MS = 3.0  # on every packet each host sends: ~6 ms round trip between two hosts


def _end(bootstrap: str, topic: str) -> int:
    """How many records ``topic`` holds now, from its end offsets (no consumer's lag in it)."""
    from streams.bus.kafka import KafkaBus

    with KafkaBus(bootstrap, client_id="hosts-ends") as bus:
        return sum(bus.end_offsets(topic).values())


def _caught_up(counter: TopicCounter, bootstrap: str, topic: str, logs) -> int:
    """``counter.poll()`` once it has read every record ``topic`` held when this was called."""
    end = _end(bootstrap, topic)
    wait_for(lambda: counter.poll() >= end, 60, f"the {topic} counter to read up to offset {end}", every=0.2,
             on_timeout=logs)
    return len(counter.items)


def _exited(role, timeout: float, logs) -> int:
    wait_for(lambda: not role.alive(), timeout, f"{role.name} to exit", every=0.5, on_timeout=logs)
    return role.proc.returncode


def _run_ends_cleanly(rig, learner, actors, streams) -> None:
    """The learner and every actor exit 0 within their deadlines; the stream worker logged no
    error, and is stopped."""
    assert _exited(learner, 150, rig.logs) == 0, rig.logs()
    for a in actors:
        assert _exited(a, 30, rig.logs) == 0, rig.logs()
    assert not streams.errors, streams.errors
    streams.stop()


def test_decoupled_run_across_lossy_hosts(hosts, tmp_path):
    budget = 2 * 20 * FRAGMENT  # two actors, 20 fragments each
    applied = hosts.impair(LOSS_PCT, DELAY_MS)
    rig = hosts.rig(tmp_path, total_steps=budget, num_actors=2)
    t0 = time.monotonic()
    try:
        streams = rig.start_faust()
        learner = rig.learner()
        actors = [rig.actor(i) for i in range(2)]
        _run_ends_cleanly(rig, learner, actors, streams)
    finally:
        rig.close()
    wall = time.monotonic() - t0
    ledger = Ledger.read(hosts.bootstrap)
    counts = check_trained_once(ledger)
    summary = summary_of(learner.log)
    assert sum(b.size for b in ledger.raw) == budget, "the actors did not publish exactly their budget"
    assert summary["samples_trained"] == budget
    assert counts["lost"] == 0 and counts["dead_letters"] == {}
    report = hosts.report()
    assert sum(h["loss"] for h in report.values()) > 0, f"the switch dropped nothing: {report}"
    if applied["delay_ms"] and applied["delay_method"] == "nfqueue":
        assert all(h["delayer"]["packets"] > 0 for h in report.values()), report
    print("HOSTS decoupled counts:", json.dumps({**counts, "wall_s": round(wall, 1), "hosts": report},
                                                sort_keys=True))


def test_actor_host_partition_heals(hosts, tmp_path):
    budget = 2 * 60 * FRAGMENT
    hosts.impair(LOSS_PCT, DELAY_MS)
    rig = hosts.rig(tmp_path, total_steps=budget, num_actors=2)
    steps = TopicCounter(hosts.bootstrap, LEARNER_STEPS, CODEC.decode)
    raw = TopicCounter(hosts.bootstrap, SAMPLES_RAW, CODEC.decode)
    cut = hosts["actor-1"]
    t0 = time.monotonic()

    def from_cut() -> int:
        raw.poll()
        return sum(b.actor_id == "actor-1" for b in raw.items)

    try:
        streams = rig.start_faust()
        learner = rig.learner()
        actors = [rig.actor(i) for i in range(2)]
        wait_for(lambda: steps.poll() >= 3 and from_cut() >= 2, 150, "3 updates with both actors", every=0.3,
                 on_timeout=rig.logs)
        cut.partition()
        cut_at, cut_ms = time.monotonic(), time.time() * 1000  # every frame from now on is dropped
        before = _end(hosts.bootstrap, LEARNER_STEPS)  # updates so far: end offsets, not a lagging counter
        # longer than the session timeout of the groups (6 s) and than librdkafka's socket timeouts
        while time.monotonic() - cut_at < 20:
            assert actors[1].alive() and learner.alive(), rig.logs()  # actor-0 may finish its budget
            time.sleep(0.5)
        during = (_end(hosts.bootstrap, LEARNER_STEPS), _caught_up(raw, hosts.bootstrap, SAMPLES_RAW, rig.logs))
        # a batch of the cut actor's that the broker holds, made after the cable went, came through it
        # (one made before may still land late: it was on the wire, or in the broker's queue)
        through = [b.seq for b in raw.items if b.actor_id == "actor-1" and b.created_at_ms > cut_ms + 1]
        cut_batches = from_cut()
        dropped = cut.heal()
        assert during[0] > before, "the learner stopped while one actor host was cut off"
        assert through == [], "the cut actor's batches reached the broker through the partition"
        assert dropped > 0
        wait_for(lambda: from_cut() > cut_batches, 90, "the healed actor to publish again", every=0.5,
                 on_timeout=rig.logs)
        _run_ends_cleanly(rig, learner, actors, streams)
    finally:
        rig.close()
        steps.close()
        raw.close()
    ledger = Ledger.read(hosts.bootstrap)
    counts = check_trained_once(ledger)
    assert sum(b.size for b in ledger.raw) == budget
    seqs = [b.seq for b in ledger.raw if b.actor_id == "actor-1"]
    assert seqs == list(range(len(seqs))), "the healed actor's batches are not one gap-free sequence"
    print("HOSTS actor-partition counts:", json.dumps(
        {**counts, "partition_s": 20, "partition_frames_dropped": dropped, "updates_before": before,
         "updates_during": during[0] - before, "cut_actor_batches": len(seqs),
         "wall_s": round(time.monotonic() - t0, 1), "hosts": hosts.report()}, sort_keys=True))


def test_learner_host_partition_actors_wait_and_resume(hosts, tmp_path):
    budget = 2 * 30 * FRAGMENT
    ahead, backlog = 2 * FRAGMENT, 2  # each actor: at most 2 fragments past the learner's version
    hosts.impair(LOSS_PCT, DELAY_MS)
    rig = hosts.rig(tmp_path, total_steps=budget, num_actors=2, snapshot_every=1,
                    args=("--max-steps-ahead", str(ahead), "--max-backlog", str(backlog), "--policy-wait", "3"))
    steps = TopicCounter(hosts.bootstrap, LEARNER_STEPS, CODEC.decode)
    raw = TopicCounter(hosts.bootstrap, SAMPLES_RAW, CODEC.decode)
    store = open_store(tmp_path / "snapshots", keep_last=None)
    cut = hosts["learner"]
    t0 = time.monotonic()
    try:
        streams = rig.start_faust()
        first = rig.learner()
        actors = [rig.actor(i) for i in range(2)]
        wait_for(lambda: steps.poll() >= 4 and (store.latest() or 0) > 0, 150, "4 updates and a snapshot",
                 every=0.3, on_timeout=rig.logs)
        cut.partition()
        raw_at_cut = _end(hosts.bootstrap, SAMPLES_RAW)  # end offsets: no counter's lag in the bound below
        # the actors stall: nothing new for 10 s on end, within 90 s
        last = [raw.poll(), time.monotonic()]

        def quiet_for_10s() -> bool:
            n = raw.poll()
            if n != last[0]:
                last[:] = [n, time.monotonic()]
            return time.monotonic() - last[1] >= 10

        wait_for(quiet_for_10s, 90, "the actors to stall while the learner is cut off", every=0.5,
                 on_timeout=rig.logs)
        ran_on = _end(hosts.bootstrap, SAMPLES_RAW) - raw_at_cut
        # each actor: its steps ahead, one fragment the policy wait lets through, the backlog bound
        bound = 2 * (ahead // FRAGMENT + 1 + backlog)
        assert ran_on <= bound, f"actors ran on {ran_on} fragments past the learner (bound {bound})"
        assert all(a.alive() for a in actors)
        first.kill()  # the host is lost with its learner
        killed_ms = int(time.time() * 1000)
        life1 = Ledger.read(hosts.bootstrap)
        n1 = len(life1.steps)
        cut_dropped = cut.heal()
        assert cut_dropped > 0, "the partition dropped nothing"
        v_s = store.latest()
        _, meta = store.load(v_s)
        snapshot_ids = set(meta["trained_batch_ids"])
        second = rig.learner(resume=True)
        assert _exited(second, 150, rig.logs) == 0, rig.logs()
        for a in actors:
            assert _exited(a, 60, rig.logs) == 0, rig.logs()
        wait_for(lambda: all_trained(raw, steps), 30, "every produced batch trained", on_timeout=rig.logs)
        assert not streams.errors, streams.errors
        streams.stop()
    finally:
        rig.close()
        steps.close()
        raw.close()
    ledger = Ledger.read(hosts.bootstrap)
    assert [s.batch_ids for s in ledger.steps[:n1]] == [s.batch_ids for s in life1.steps]
    ids1 = [i for s in ledger.steps[:n1] for i in s.batch_ids]
    ids2 = [i for s in ledger.steps[n1:] for i in s.batch_ids]
    assert len(ids1) == len(set(ids1)) and len(ids2) == len(set(ids2)), "an id trained twice within one life"
    after = {i for s in ledger.steps[:n1] if s.to_version > v_s for i in s.batch_ids}
    assert not set(ids2) & snapshot_ids, "the resumed learner retrained batches its snapshot holds"
    assert set(ids1) & set(ids2) == after, "only the batches trained after the snapshot are retrained"
    assert set(ids1) | set(ids2) == set(ledger.produced_ids), "a produced batch was never trained"
    assert sum(b.size for b in ledger.raw) == budget, "the actors ran past their budget"
    # A produce request the first life wrote while cut off sits in its socket's kernel buffer, and
    # the kernel still delivers it once the partition heals, though the process is gone. The
    # learner writes in transactions of its identity, which the resumed learner's start fenced,
    # and readers read committed only: no such late version may show (it once read 0..28, 5, 29..).
    versions = [v.version for v in ledger.versions]
    assert versions == sorted(set(versions)), f"versions not strictly increasing: {versions}"
    late = [v.version for v in ledger.versions[len(life1.versions):] if v.created_at_ms < killed_ms]
    resumed = next(v for v in ledger.versions if v.version > max(v.version for v in life1.versions))
    assert resumed.parent_version == v_s
    summary = summary_of(second.log)
    assert summary["samples_trained"] >= budget
    print("HOSTS learner-partition counts:", json.dumps(
        {"produced": len(ledger.raw), "trained_life1": len(ids1), "trained_life2": len(ids2),
         "snapshot_version": v_s, "retrained_after_snapshot": len(after), "ran_on_while_cut": ran_on,
         "ran_on_bound": bound, "partition_frames_dropped": cut_dropped, "lost": len(set(ledger.produced_ids) - set(ids1) - set(ids2)),
         "versions": len(versions), "late_versions_of_life1": late, "dead_letters": dict(ledger.dead_reasons()),
         "wall_s": round(time.monotonic() - t0, 1), "hosts": hosts.report()}, sort_keys=True))
