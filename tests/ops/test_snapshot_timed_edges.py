"""Time-based snapshots at the edges left open by tests/ops/test_snapshots.py and
tests/learner/test_snapshot_schedule.py: ``keep_timed=0`` gives time-based snapshots no
retention of their own (an old one goes with ``keep_last``), and a restarted learner's cadence
is anchored at the *newest* time-based snapshot's save time."""

from __future__ import annotations

import types

import pytest
import torch

from learner.snapshots import format as snapshot_format
from learner.snapshots.schedule import SnapshotSchedule, newest_timed_ms
from learner.snapshots.url import open_store


def test_keep_timed_zero_keeps_no_old_time_based_snapshot(tmp_path):
    store = open_store(tmp_path / "s", keep_last=2, keep_timed=0)
    for v in range(1, 6):
        store.save(v, {"w": torch.full((1,), float(v))}, timed=v in (1, 3))
    assert store.versions() == [4, 5] and store.timed() == set()
    kept = open_store(tmp_path / "k", keep_last=2, keep_timed=1)
    for v in range(1, 6):
        kept.save(v, {"w": torch.full((1,), float(v))}, timed=v in (1, 3))
    assert kept.versions() == [3, 4, 5] and kept.timed() == {3}


def test_a_restart_keeps_the_cadence_of_the_newest_time_based_snapshot(tmp_path, monkeypatch: pytest.MonkeyPatch):
    wall = [1_000_000.0]
    monkeypatch.setattr(snapshot_format, "time", types.SimpleNamespace(time=lambda: wall[0]))
    store = open_store(tmp_path / "s", keep_last=10, keep_timed=5)
    assert newest_timed_ms(store) is None
    for v, at in ((1, 0.0), (2, 3600.0), (3, 86_400.0), (4, 90_000.0)):  # 1 and 3 are the daily ones
        wall[0] = 1_000_000.0 + at
        store.save(v, {"w": torch.zeros(1)}, timed=v in (1, 3))
    assert newest_timed_ms(store) == (1_000_000.0 + 86_400.0) * 1000
    clock = lambda: 1_000_000.0 + 86_400.0 + 86_399.0  # noqa: E731 (a day after 3, less a second)
    schedule = SnapshotSchedule(every=0, interval_s=86_400.0, clock=clock, last_timed_s=newest_timed_ms(store) / 1000)
    assert schedule.due(1) == (False, False)
