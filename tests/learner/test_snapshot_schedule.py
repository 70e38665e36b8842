"""The learner's snapshot schedule: every N updates, and a time-based one (daily by default) on
an injected clock, kept by the store's own retention for time-based snapshots; a restarted
learner keeps the cadence from the store's newest time-based snapshot. No sleeps: the clock is
the test's."""

from __future__ import annotations

import time
from dataclasses import replace

from agents.registry import make_algorithm
from config import TrainConfig
from config.storage import ObjectStoreConfig
from learner.learner import Learner, LearnerConfig
from learner.snapshots.object_store import ObjectSnapshotStore
from learner.snapshots.schedule import SnapshotSchedule, newest_timed_ms
from learner.snapshots.url import open_store
from rlstream import wiring
from streams.topics import SAMPLES_PREPARED
from tests.learner.test_learner import ACT, N, OBS, T, events, prepared  # noqa: F401 (fixture)
from tests.ops.conftest import moto_s3, s3_bucket  # noqa: F401 (fixtures)


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def learner(events, store, clock, every=3, interval=100.0) -> Learner:  # noqa: F811
    algo = make_algorithm("ppo", OBS, ACT, {"num_minibatches": 1, "update_epochs": 1}, "cpu")
    cfg = LearnerConfig(train_batch_size=T * N, snapshot_every=every, snapshot_interval_s=interval)
    return Learner(cfg, algo, events, snapshots=store, clock=clock)


def update(lr: Learner, events, seq: int) -> None:  # noqa: F811
    """One update, then one idle step: a due snapshot is written at the step after the update."""
    events.publish(SAMPLES_PREPARED, prepared(seq), key="actor-0")
    assert lr.step(0) is not None
    assert lr.step(0) is None


def test_the_schedule_alone():
    clock = Clock(1000.0)
    s = SnapshotSchedule(every=10, interval_s=86_400.0, clock=clock)
    assert s.due(9) == (False, False) and s.due(10) == (True, False)
    clock.t += 86_399.0
    assert s.due(11) == (False, False)
    clock.t += 1.0
    assert s.due(11) == (False, True)
    s.taken(False)  # an update-based one does not reset the day
    assert s.due(12) == (False, True)
    s.taken(True)
    assert s.due(13) == (False, False)
    assert SnapshotSchedule(0, 0.0, clock=clock).due(10) == (False, False)  # both off
    assert SnapshotSchedule(1, 5.0, clock=clock, last_timed_s=clock.t - 5.0).due(1) == (True, True)


def test_time_based_snapshots_follow_the_clock_and_their_own_retention(events, tmp_path):  # noqa: F811
    clock = Clock(time.time())
    store = open_store(tmp_path / "snaps", keep_last=2, keep_timed=2)
    lr = learner(events, store, clock)
    lr.start(resume=False)
    timeline = {1: 0, 2: 0, 3: 100, 4: 50, 5: 50, 6: 0, 7: 100, 8: 0, 9: 0}  # update -> seconds before it
    saved = []
    for u, dt in timeline.items():
        clock.t += dt
        before = set(store.versions())
        update(lr, events, u)
        saved += [(v, v in store.timed()) for v in sorted(set(store.versions()) - before)]
    # by count: 3, 6, 9; by time: 3 (100 s), 5 (100 s after 3), 7 (100 s after 5)
    assert saved == [(3, True), (5, True), (6, False), (7, True), (9, False)]
    assert store.versions() == [5, 7, 9]  # newest 2 (7, 9) and newest 2 time-based (5, 7)
    assert store.timed() == {5, 7}
    assert store.meta(7)["updates"] == 7

    # A restart keeps the cadence: the next time-based one is due 100 s after the newest (7).
    lr.close()
    anchor = newest_timed_ms(store) / 1000
    clock2 = Clock(anchor + 60.0)
    lr2 = learner(events, store, clock2, every=0)
    lr2.start(resume=True)
    update(lr2, events, 10)
    assert store.versions() == [5, 7, 9]
    clock2.t += 40.0
    update(lr2, events, 11)
    new = lr2.model_version
    assert new > 9 and store.timed() == {7, new} and store.versions() == [7, 9, new]


def test_the_run_config_reaches_the_schedule_and_the_store(events, tmp_path, moto_s3, s3_bucket):  # noqa: F811
    """``--snapshot-interval-s`` and ``--snapshot-keep-timed`` and an ``s3://`` store with the
    endpoint of the run's environment, through the composition root."""
    cfg = TrainConfig(algo="ppo", env_id="Pendulum-v1", run_dir=tmp_path, snapshot_interval_s=3600.0,
                      snapshot_keep_timed=3, snapshot_store=f"s3://{s3_bucket}/run", object_store=moto_s3.config())
    lr = wiring.build_learner(cfg, events, None, wiring.build_algo(cfg, 3, 1))
    assert lr.config.snapshot_interval_s == 3600.0 and lr.config.snapshot_every == 10
    assert isinstance(lr.snapshots, ObjectSnapshotStore) and lr.snapshots.keep_timed == 3
    assert lr.snapshots.endpoint_url == moto_s3.endpoint_url
    lr.start(resume=False)
    lr.snapshot(timed=True)
    assert lr.snapshots.timed() == {0}
    d = cfg.to_dict()
    assert "object_store" not in d and TrainConfig.from_dict(d).object_store == ObjectStoreConfig()  # never in a file
    assert TrainConfig().snapshot_interval_s == 86_400.0 and TrainConfig().snapshot_keep_timed == 7
    assert replace(cfg, snapshot_interval_s=0.0).snapshot_interval_s == 0.0
