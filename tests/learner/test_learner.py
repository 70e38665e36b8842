"""Learner shell: versions, GradientStep events, duplicates, snapshots + offsets resume, rollback."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agents.registry import make_algorithm
from learner.learner import Learner, LearnerConfig
from learner.snapshots.url import open_store
from streams.policies import load_policy
from schemas.codec import Codec
from schemas.events import GradientStep, PolicyVersion, PreparedBatch, SampleBatch, new_id, now_ms
from streams.bus.memory import MemoryBus
from streams.events import EventBus
from streams.topics import DEADLETTER, LEARNER_STEPS, POLICY_VERSIONS, SAMPLES_PREPARED, all_topics

torch.set_num_threads(1)
T, N, OBS, ACT = 16, 2, 3, 1


def prepared(seq: int, version: int = 0, batch_id: str | None = None, rng=np.random.default_rng(0)) -> PreparedBatch:
    sb = SampleBatch(
        batch_id=batch_id or new_id(), actor_id="actor-0", seq=seq, env_id="Pendulum-v1", policy_version=version,
        created_at_ms=now_ms(), obs=rng.normal(size=(T, N, OBS)).astype(np.float32),
        actions=rng.normal(size=(T, N, ACT)).astype(np.float32), rewards=rng.normal(size=(T, N)).astype(np.float32),
        terminated=np.zeros((T, N), bool), truncated=np.zeros((T, N), bool),
        behaviour_logp=np.full((T, N), -1.0, np.float32), last_obs=np.zeros((N, OBS), np.float32),
        final_obs_index=np.zeros(0, np.int64), final_obs=np.zeros((0, OBS), np.float32),
    )
    ones = np.ones((T, N), np.float32)
    return PreparedBatch(sb, version, 0, 0, ones, ones, now_ms())


def train(lr: Learner, events: EventBus, n: int) -> None:
    """Publish ``n`` prepared batches, stepping the learner after each (one update each)."""
    for s in range(n):
        events.publish(SAMPLES_PREPARED, prepared(s), key="actor-0")
        assert lr.step(0) is not None


def make(events: EventBus, store, train_batch=T * N, snapshot_every=1) -> Learner:
    algo = make_algorithm("ppo", OBS, ACT, {"num_minibatches": 2, "update_epochs": 1}, "cpu")
    cfg = LearnerConfig(train_batch_size=train_batch, snapshot_every=snapshot_every)
    return Learner(cfg, algo, events, snapshots=store)


@pytest.fixture
def events():
    bus = MemoryBus()
    bus.create_topics(all_topics())
    return EventBus(bus, Codec())


def versions(events: EventBus) -> list[PolicyVersion]:
    return [events.codec.decode(r.value) for r in events.bus.read_all(POLICY_VERSIONS)]


def test_updates_publish_versions_and_gradient_steps(events, tmp_path):
    lr = make(events, open_store(tmp_path))
    lr.start()
    assert [v.version for v in versions(events)] == [0]
    for s in range(3):
        events.publish(SAMPLES_PREPARED, prepared(s), key="actor-0")
        assert lr.step(0) is not None
    vs = versions(events)
    assert [v.version for v in vs] == [0, 1, 2, 3]
    assert [v.parent_version for v in vs[1:]] == [0, 1, 2]
    steps = [events.codec.decode(r.value) for r in events.bus.read_all(LEARNER_STEPS)]
    assert all(isinstance(s, GradientStep) for s in steps)
    assert [(s.from_version, s.to_version) for s in steps] == [(0, 1), (1, 2), (2, 3)]
    assert all(s.num_samples == T * N and len(s.batch_ids) == 1 for s in steps)
    assert "loss_policy" in steps[0].losses


def test_accumulates_fragments_until_train_batch_size(events, tmp_path):
    lr = make(events, open_store(tmp_path), train_batch=3 * T * N)
    lr.start()
    for s in range(2):
        events.publish(SAMPLES_PREPARED, prepared(s), key="actor-0")
        assert lr.step(0) is None
    events.publish(SAMPLES_PREPARED, prepared(2), key="actor-0")
    assert lr.step(0) is not None
    step = events.codec.decode(next(iter(events.bus.read_all(LEARNER_STEPS))).value)
    assert step.num_samples == 3 * T * N and len(step.batch_ids) == 3


def test_duplicate_batch_is_skipped_counted_and_dead_lettered(events, tmp_path):
    lr = make(events, open_store(tmp_path))
    lr.start()
    p = prepared(0)
    events.publish(SAMPLES_PREPARED, p, key="actor-0")
    lr.step(0)
    events.publish(SAMPLES_PREPARED, p, key="actor-0")
    assert lr.step(0) is None
    assert lr.stats.duplicates_skipped == 1 and lr.stats.updates == 1
    dls = [events.codec.decode(r.value) for r in events.bus.read_all(DEADLETTER)]
    assert [d.reason for d in dls] == ["duplicate"]


def test_a_redelivered_record_is_skipped_without_a_dead_letter(events, tmp_path):
    """Kafka redelivers from the last commit after a rebalance or a broker restart: the record the
    learner already trained, at the same offset, is skipped and counted, not dead-lettered."""
    lr = make(events, open_store(tmp_path))
    lr.start()
    events.publish(SAMPLES_PREPARED, prepared(0), key="actor-0")
    assert lr.step(0) is not None
    lr.consumer.raw.seek(SAMPLES_PREPARED, 0, 0)  # the rewind a redelivery is
    assert lr.step(0) is None
    assert (lr.stats.redelivered_skipped, lr.stats.duplicates_skipped, lr.stats.updates) == (1, 0, 1)
    assert list(events.bus.read_all(DEADLETTER)) == []


@pytest.mark.parametrize("budget", [None, 3 * T * N])
def test_the_remainder_of_the_budget_is_trained_as_a_last_smaller_update(events, tmp_path, budget):
    """Batches of two fragments, a budget of three: the third is trained alone, not waited on
    (a decoupled run's actors have stopped; nothing else will come). Without a budget it waits."""
    algo = make_algorithm("ppo", OBS, ACT, {"num_minibatches": 2, "update_epochs": 1}, "cpu")
    lr = Learner(LearnerConfig(train_batch_size=2 * T * N, snapshot_every=0, total_samples=budget), algo, events)
    lr.start()
    for s in range(3):
        events.publish(SAMPLES_PREPARED, prepared(s), key="actor-0")
        trained = lr.step(0) is not None
        assert trained == (s == 1 or (s == 2 and budget is not None)), s
    assert lr.stats.samples_trained == (3 if budget else 2) * T * N


def test_resume_restores_state_seeks_to_snapshot_offsets_and_keeps_versions_monotonic(events, tmp_path):
    store = open_store(tmp_path, keep_last=None)
    lr = make(events, store, snapshot_every=2)
    lr.start()
    batches = [prepared(s) for s in range(3)]
    for b in batches:
        events.publish(SAMPLES_PREPARED, b, key="actor-0")
        lr.step(0)
    # updates 1..3 published versions 1..3, the snapshot is at version 2 (after update 2):
    # the crash loses update 3, whose input offset was already committed
    assert store.latest() == 2
    snap_weights, _ = store.load(2)
    live_weights = {k: v.clone() for k, v in lr.algo.policy.state_dict().items()}
    assert not all(torch.equal(live_weights[k], snap_weights[k]) for k in snap_weights)
    lr.close()

    lr2 = make(events, store, snapshot_every=2)
    lr2.start(resume=True)
    # a NEW version (4) carries the restored snapshot-2 weights, parent 2
    v = versions(events)[-1]
    assert (v.version, v.parent_version) == (4, 2)
    assert (lr2.stats.updates, lr2.stats.samples_trained) == (2, 2 * T * N)  # the run's budget counts on
    # batch 3 (trained after the snapshot) is re-delivered and trained again; 1 and 2 are not
    assert lr2.step(0) is not None
    step = [events.codec.decode(r.value) for r in events.bus.read_all(LEARNER_STEPS)][-1]
    assert step.batch_ids == [batches[2].sample.batch_id]
    assert (step.from_version, step.to_version) == (4, 5)
    assert lr2.step(0) is None  # nothing else pending
    restored = load_policy(versions(events)[-2])
    for k, t in restored.state_dict().items():
        assert torch.equal(t, snap_weights[k])


def test_a_snapshot_newer_than_the_topic_is_never_renumbered(events, tmp_path, caplog):
    """Cut off from the broker, a learner snapshots versions whose publishes never land; the
    learner resumed from such a snapshot numbers on from it, not from the topic's newest, and
    says so in its log."""
    store = open_store(tmp_path, keep_last=None)
    lr = make(events, store)
    lr.start()
    train(lr, events, 3)
    lr.snapshot()
    assert store.latest() == 3
    lr.close()
    behind = EventBus(MemoryBus(), Codec())  # its newest version: 1 (2 and 3 never reached it)
    behind.bus.create_topics(all_topics())
    for v in versions(events)[:2]:
        behind.publish(POLICY_VERSIONS, v, key=v.policy_id)
    lr2 = make(behind, store)
    with caplog.at_level("WARNING", logger="learner.learner"):
        lr2.start(resume=True)
    assert [(v.version, v.parent_version) for v in versions(behind)][-1] == (4, 3)
    assert "reads 1, older than the restored snapshot's 3" in caplog.text


def test_resume_before_the_first_snapshot_retrains_from_the_log_start(events, tmp_path):
    """Killed after two committed updates but before any snapshot: the restarted learner starts
    from the initial weights, so it must train those batches again, not skip to the commit."""
    store = open_store(tmp_path, keep_last=None)
    lr = make(events, store, snapshot_every=10)
    lr.start()
    train(lr, events, 2)
    assert store.latest() is None
    lr.close()
    trained = [b for r in events.bus.read_all(LEARNER_STEPS) for b in events.codec.decode(r.value).batch_ids]

    lr2 = make(events, store, snapshot_every=10)
    lr2.start(resume=True)
    assert lr2.step(0) is not None
    step = [events.codec.decode(r.value) for r in events.bus.read_all(LEARNER_STEPS)][-1]
    assert len(trained) == 2 and step.batch_ids == trained
    assert versions(events)[-2].parent_version is None  # the restart began a new line from scratch


def test_running_learner_adopts_a_rollback_published_by_another_process(events, tmp_path):
    from logtools.rollback import rollback

    store = open_store(tmp_path, keep_last=None)
    lr = make(events, store)
    lr.start()
    train(lr, events, 3)
    assert lr.version == 3
    out = rollback(events, str(tmp_path), 1)
    assert out["new_version"] == 4
    events.publish(SAMPLES_PREPARED, prepared(3), key="actor-0")
    assert lr.step(0) is not None
    assert lr.stats.adopted_versions == 1
    vs = versions(events)
    # the learner continued from the rolled-back line: 4 (rollback of 1), then its own 5 from 4
    assert [(v.version, v.parent_version, v.learner_id) for v in vs[-2:]] == \
        [(4, 1, "rollback"), (5, 4, "learner-0")]
    assert len({v.version for v in vs}) == len(vs)  # no version number was published twice


def prepared_T(seq: int, steps: int) -> PreparedBatch:
    p = prepared(seq)
    rng = np.random.default_rng(seq)
    s = p.sample
    sb = SampleBatch(
        batch_id=new_id(), actor_id=s.actor_id, seq=seq, env_id=s.env_id, policy_version=0,
        created_at_ms=now_ms(), obs=rng.normal(size=(steps, N, OBS)).astype(np.float32),
        actions=rng.normal(size=(steps, N, ACT)).astype(np.float32),
        rewards=rng.normal(size=(steps, N)).astype(np.float32), terminated=np.zeros((steps, N), bool),
        truncated=np.zeros((steps, N), bool), behaviour_logp=np.full((steps, N), -1.0, np.float32),
        last_obs=np.zeros((N, OBS), np.float32), final_obs_index=np.zeros(0, np.int64),
        final_obs=np.zeros((0, OBS), np.float32))
    ones = np.ones((steps, N), np.float32)
    return PreparedBatch(sb, 0, 0, 0, ones, ones, now_ms())


def test_fragments_of_any_lengths_train_together_in_the_next_update_and_commits_track_them(events, tmp_path):
    # dynamic fragment lengths: 16-, 32- and 48-step fragments arrive interleaved
    lr = make(events, open_store(tmp_path), train_batch=4 * 16 * N)
    lr.start()
    for i, steps in enumerate([16, 32, 48]):  # 96 steps x 2 envs >= 64 x 2: one update on all three
        events.publish(SAMPLES_PREPARED, prepared_T(i, steps), key="actor-0")
    assert lr.step(0) is not None
    step = [events.codec.decode(r.value) for r in events.bus.read_all(LEARNER_STEPS)][-1]
    assert step.num_samples == 96 * N and len(step.batch_ids) == 3
    assert lr.buffered == 0 and lr.consumer.raw.committed() == {(SAMPLES_PREPARED, 0): 3}
    # a fragment waiting for the next update holds the commit back, so a crash redelivers it
    events.publish(SAMPLES_PREPARED, prepared_T(3, 16), key="actor-0")
    assert lr.step(0) is None and lr.buffered == 16 * N
    events.bus.produce(SAMPLES_PREPARED, b"not an event", key=b"actor-0")  # dead-lettered at offset 4
    assert lr.step(0) is None
    assert lr.consumer.raw.committed() == {(SAMPLES_PREPARED, 0): 3}
    events.publish(SAMPLES_PREPARED, prepared_T(5, 64), key="actor-0")
    assert lr.step(0) is not None
    step = [events.codec.decode(r.value) for r in events.bus.read_all(LEARNER_STEPS)][-1]
    assert step.num_samples == 80 * N and len(step.batch_ids) == 2
    assert lr.consumer.raw.committed() == {(SAMPLES_PREPARED, 0): 6}
    # bad records at the end of the log are committed past without an update
    events.bus.produce(SAMPLES_PREPARED, b"bad", key=b"actor-0")
    assert lr.step(0) is None and lr.consumer.raw.committed() == {(SAMPLES_PREPARED, 0): 7}
    assert len(list(events.bus.read_all(DEADLETTER))) == 2


def test_versions_continue_when_another_policy_published_last_on_the_shared_topic(events, tmp_path):
    from streams.policies import make_policy_version, publish_policy_version

    lr = make(events, open_store(tmp_path))
    lr.start()
    train(lr, events, 2)
    lr.close()
    other = make_policy_version(lr.algo.policy, policy_id="someone-else", version=99, parent_version=None,
                                learner_id="x", algo="ppo")
    publish_policy_version(events, other)  # the newest record is not ours
    lr2 = make(events, open_store(tmp_path / "second"))
    lr2.start(resume=False)
    ours = [v.version for v in versions(events) if v.policy_id == "policy"]
    assert ours == [0, 1, 2, 3]  # 3, not a second 0


def test_a_rank_that_does_not_publish_counts_versions_commits_its_share_and_saves_nothing(events, tmp_path):
    from learner.ranks import SingleRank

    class NotRankZero(SingleRank):  # the ranks' interface, as a rank > 0 of a group answers it
        publisher = False

    algo = make_algorithm("ppo", OBS, ACT, {"num_minibatches": 2, "update_epochs": 1}, "cpu")
    store = open_store(tmp_path)
    lr = Learner(LearnerConfig(train_batch_size=T * N, snapshot_every=1), algo, events, snapshots=store,
                 parallel=NotRankZero(algo))
    lr.start(resume=False)
    train(lr, events, 2)
    assert (lr.version, lr.model_version, lr.stats.updates) == (2, 2, 2)
    assert versions(events) == [] and list(events.bus.read_all(LEARNER_STEPS)) == []  # rank 0 writes them
    assert store.latest() is None  # and saves the snapshots
    assert lr.consumer.raw.committed() == {(SAMPLES_PREPARED, 0): 2}


def test_a_due_snapshot_waits_for_the_next_step_so_readers_of_the_version_do_not(events, tmp_path):
    """The update publishes its version and returns; the snapshot it is due for is written when
    the learner steps again (a co-located actor, stepped in between, adopts the version first),
    with the state and offsets of that update, before anything new is read or trained."""
    store = open_store(tmp_path, keep_last=None)
    lr = make(events, store, snapshot_every=1)
    lr.start()
    events.publish(SAMPLES_PREPARED, prepared(0), key="actor-0")
    assert lr.step(0) is not None
    assert [v.version for v in versions(events)] == [0, 1] and store.latest() is None
    trained = {k: v.clone() for k, v in lr.algo.policy.state_dict().items()}
    events.publish(SAMPLES_PREPARED, prepared(1), key="actor-0")  # waiting, not yet read
    assert lr.step(0) is not None  # the snapshot first, then the next update
    assert store.latest() == 1
    weights, meta = store.load(1)
    assert all(torch.equal(weights[k], trained[k]) for k in trained)
    assert meta["offsets"] == [[SAMPLES_PREPARED, 0, 1]] and meta["updates"] == 1
    lr.close()  # a due snapshot is not lost when the learner stops instead of stepping again
    assert store.latest() == 2


def test_a_dead_letter_is_flushed_before_the_offset_past_it_is_committed(events, tmp_path):
    """Between updates the learner flushes what it dead-lettered before it commits past the
    record: on Kafka that closes the dead letter's transaction, which must not stay open while the
    learner waits (the broker would abort it and fence the learner)."""
    said: list[str] = []
    flush = events.bus.flush
    events.bus.flush = lambda timeout=30.0: (said.append("flush"), flush(timeout))[1]
    lr = make(events, open_store(tmp_path))
    lr.start()
    c = lr.consumer.raw
    real_commit = c.commit
    c.commit = lambda *a, **k: (said.append("commit"), real_commit(*a, **k))[1]
    p = prepared(0)
    events.publish(SAMPLES_PREPARED, p, key="actor-0")
    lr.step(0)  # an update: its own flush, then its commit
    said.clear()
    events.publish(SAMPLES_PREPARED, p, key="actor-0")
    assert lr.step(0) is None and lr.stats.duplicates_skipped == 1
    assert said == ["flush", "commit"]
    said.clear()
    assert lr.step(0) is None and said == []  # nothing new: no flush, no commit
