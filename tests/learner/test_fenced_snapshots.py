"""A fenced learner writes no snapshot: once a newer learner of its identity has fenced it
(``WriterFencedError`` from its commit), the snapshot store is the newer learner's, so neither a
snapshot it is asked for nor the last one of its close may reach it (a fenced learner's
snapshot on the way out once overwrote its successor's). The real process, fenced on Kafka:
``tests/faults/test_fenced_learner.py``."""

from __future__ import annotations

import pytest

from learner.snapshots.url import open_store
from streams.bus.base import WriterFencedError
from streams.topics import SAMPLES_PREPARED
from tests.learner.test_learner import events, prepared  # noqa: F401 (fixture)
from tests.learner.test_snapshot_schedule import learner


def test_a_fenced_learner_writes_no_snapshot(events, tmp_path, monkeypatch):  # noqa: F811
    store = open_store(tmp_path / "snaps", keep_last=None)
    lr = learner(events, store, clock=lambda: 0.0, every=1, interval=0.0)
    lr.start(resume=False)
    events.publish(SAMPLES_PREPARED, prepared(1), key="actor-0")
    assert lr.step(0) is not None and lr.step(0) is None  # an update, and its snapshot at the next step
    assert store.versions() == [1] and not lr.fenced

    def fenced(*a, **k):
        raise WriterFencedError("a newer writer with transactional id 'x' has started")

    monkeypatch.setattr(events, "flush", fenced)  # the commit of the next update's transaction
    events.publish(SAMPLES_PREPARED, prepared(2), key="actor-0")
    with pytest.raises(WriterFencedError):
        lr.step(0)
    assert lr.fenced
    lr.snapshot()  # asked for one (the harness's close does, after an update)
    lr.snapshot(timed=True)
    lr.close()
    assert store.versions() == [1], "a fenced learner wrote a snapshot"
