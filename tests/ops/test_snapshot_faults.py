"""Snapshots that fail safely (issue 39, part 2), with a real learner on the memory bus and real
stores: a moto S3 server of the test's own (stopped mid-run, or SIGSTOPped: a store that holds
the connection and does not answer), a local store on a full tmpfs, and corrupt, truncated or
orphaned snapshot files on disk.

A save that fails never stops training: the failure is counted (``rlstream_snapshot_failures_total``),
logged once per ``SNAPSHOT_RETRY_S``, and the save is retried; the newest visible snapshot is
always a whole one. ``--resume`` falls back past unusable snapshots to the newest intact one, and
refuses, in one line, when none is intact or retention deleted the input a snapshot resumes at."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import uuid
from pathlib import Path

import pytest
import torch

import learner.learner as learner_mod
import learner.snapshots.object_store as object_store_mod
import testbed.s3 as s3_support
from learner.learner import Learner
from learner.snapshots.format import ResumeError
from learner.snapshots.local_dir import LocalDirSnapshotStore
from learner.snapshots.object_store import ObjectSnapshotStore
from learner.snapshots.url import open_store
from runtime.metrics import Metrics
from streams.topics import SAMPLES_PREPARED
from tests.learner.test_learner import make, prepared, versions
from tests.learner.test_learner import events  # noqa: F401  (fixture)
from testbed.s3 import MotoServer, moto_available

torch.set_num_threads(1)


class Clock:
    def __init__(self) -> None:
        self.t = 1_000.0

    def __call__(self) -> float:
        return self.t


def _learner(events, store, metrics: Metrics | None = None, clock: Clock | None = None) -> Learner:  # noqa: F811
    lr = make(events, store, snapshot_every=1)
    lr.clock = clock or Clock()
    if metrics is not None:
        lr.on_snapshot_failure = metrics.count_snapshot_failure
    return lr


def _update(lr: Learner, events, seq: int) -> None:  # noqa: F811
    """One batch in, one update out, and the snapshot it is due for (taken at the next step)."""
    events.publish(SAMPLES_PREPARED, prepared(seq), key="actor-0")
    assert lr.step(0) is not None, "training stopped"
    lr.step(0)  # the due snapshot


def _failures(m: Metrics) -> float:
    total = 0.0
    for line in m.render().decode().splitlines():
        if line.startswith("rlstream_snapshot_failures_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _failure_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("snapshot failed")]


# -- object store down, then back ------------------------------------------------------------------

@pytest.fixture
def moto():
    if not moto_available():
        pytest.skip("moto[server] or s3fs not installed: no S3 server")
    servers: list[MotoServer] = []

    def start(port: int | None = None) -> MotoServer:
        if port is None:
            s = MotoServer()
        else:  # the same endpoint again (a restarted store): MotoServer takes its port from free_port
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(s3_support, "free_port", lambda: port)
                s = MotoServer()
        servers.append(s)
        return s

    try:
        yield start
    finally:
        for s in servers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(s.proc.pid, signal.SIGCONT)
            s.stop()


def test_an_object_store_down_mid_run_is_counted_logged_once_and_retried(events, moto, caplog):  # noqa: F811
    caplog.set_level(logging.WARNING, logger="learner.learner")
    s3 = moto()
    bucket = f"snaps-{uuid.uuid4().hex[:8]}"
    s3.make_bucket(bucket)
    store = ObjectSnapshotStore(f"s3://{bucket}/run", object_store=s3.config())
    m, clock = Metrics(role="learner", gpu=False), Clock()
    lr = _learner(events, store, m, clock)
    lr.start()
    _update(lr, events, 0)
    assert store.versions() == [1]
    port = s3.port
    s3.stop()  # the object store is gone
    for seq in (1, 2, 3):
        _update(lr, events, seq)  # training goes on
    assert lr.stats.updates == 4
    assert lr.snapshot_failures == 3 and _failures(m) == 3
    lines = _failure_lines(caplog)
    assert len(lines) == 1, lines  # once per interval, however many fail
    assert f"v2 not saved to s3://{bucket}/run" in lines[0] and "retried in 30s" in lines[0]
    # back (empty, as a store restored from nothing): the next save past the retry time lands
    s3 = moto(port)
    s3.make_bucket(bucket)
    clock.t += learner_mod.SNAPSHOT_RETRY_S
    _update(lr, events, 4)
    assert store.versions() == [lr.model_version] == [5]
    assert store.load_state(5) is not None and lr.snapshot_failures == 3


def test_a_store_that_does_not_answer_bounds_the_save_and_training_goes_on(events, moto, monkeypatch):  # noqa: F811
    """SIGSTOP: the server holds the connection and never replies (a hung or very slow store)."""
    monkeypatch.setattr(object_store_mod, "S3_TIMEOUT_S", 1.0)
    s3 = moto()
    bucket = f"snaps-{uuid.uuid4().hex[:8]}"
    s3.make_bucket(bucket)
    store = ObjectSnapshotStore(f"s3://{bucket}/run", object_store=s3.config())
    lr = _learner(events, store)
    lr.start()
    _update(lr, events, 0)
    os.killpg(s3.proc.pid, signal.SIGSTOP)
    try:
        _update(lr, events, 1)  # the save times out; the update before it went through
        assert lr.snapshot_failures == 1 and lr.stats.updates == 2
    finally:
        os.killpg(s3.proc.pid, signal.SIGCONT)
    lr.clock.t += learner_mod.SNAPSHOT_RETRY_S
    _update(lr, events, 2)
    assert store.versions()[-1] == lr.model_version == 3
    assert store.load_state(3) is not None


# -- disk full ---------------------------------------------------------------------------------------

@pytest.fixture
def tmpfs(tmp_path):
    """A 1 MiB tmpfs (root and mount needed; skipped otherwise), unmounted at the end."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(path: Path, leave: int) -> None:
    """Write ``path`` until the filesystem has at most ``leave`` bytes free."""
    st = os.statvfs(path.parent)
    free = st.f_bavail * st.f_frsize
    with open(path, "wb") as f:
        with contextlib.suppress(OSError):
            f.write(b"\0" * max(0, free - leave))


def test_a_full_disk_fails_the_save_without_a_partial_newest_and_the_retry_lands(events, tmpfs, caplog):  # noqa: F811
    caplog.set_level(logging.WARNING, logger="learner.learner")
    store = LocalDirSnapshotStore(tmpfs / "snaps", keep_last=2)
    lr = _learner(events, store)
    lr.start()
    _update(lr, events, 0)
    weights = os.path.getsize(store._file(1, ".safetensors"))
    state = os.path.getsize(store._file(1, ".state.safetensors"))
    assert store.versions() == [1] and state > weights + 8192
    # room for the next weights blob, not for its state: a half-written v2 on disk
    _fill(tmpfs / "filler", leave=weights + 4096)
    _update(lr, events, 1)
    assert lr.snapshot_failures == 1 and lr.stats.updates == 2
    assert "No space left on device" in _failure_lines(caplog)[0]
    assert store._file(2, ".safetensors").exists()  # v2's weights were written, its state was not...
    assert store.versions() == [1] and store.latest() == 1  # ... and v2 is not visible
    assert store.load_state(1) is not None  # the newest is whole
    assert not [p.name for p in (tmpfs / "snaps").iterdir() if p.name.endswith(".tmp")]
    (tmpfs / "filler").unlink()
    lr.clock.t += learner_mod.SNAPSHOT_RETRY_S
    _update(lr, events, 2)
    assert store.versions() == [1, 3] or store.versions() == [2, 3]
    assert store.latest() == lr.model_version == 3 and store.load_state(3) is not None


# -- resume ------------------------------------------------------------------------------------------

def _three_snapshots(events, tmp_path) -> LocalDirSnapshotStore:  # noqa: F811
    store = open_store(tmp_path / "snaps", keep_last=None)
    lr = _learner(events, store)
    lr.start()
    for seq in range(3):
        _update(lr, events, seq)
    lr.close()
    assert store.versions() == [1, 2, 3]
    return store


@pytest.mark.parametrize("damage", ["flipped", "truncated", "no_state"])
def test_resume_falls_back_past_a_damaged_newest_snapshot_and_says_so(events, tmp_path, caplog, damage):  # noqa: F811
    store = _three_snapshots(events, tmp_path)
    f = store._file(3, ".state.safetensors")
    data = f.read_bytes()
    if damage == "flipped":
        f.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    elif damage == "truncated":
        f.write_bytes(data[: len(data) // 2])
    else:
        f.unlink()
    caplog.set_level(logging.WARNING, logger="learner.learner")
    lr = _learner(events, store)
    lr.start(resume=True)
    assert versions(events)[-1].parent_version == 2 and lr.stats.updates == 2  # v4, from snapshot 2
    warned = [r.getMessage() for r in caplog.records if "resume: skipped" in r.getMessage()]
    assert len(warned) == 1 and "v3 (" in warned[0] and "resuming from v2" in warned[0]
    # it trains on from snapshot 2's offsets: batch 2 again, then nothing
    assert lr.step(0) is not None and lr.step(0) is None


def test_resume_with_no_intact_snapshot_is_one_clear_line(events, tmp_path):  # noqa: F811
    store = _three_snapshots(events, tmp_path)
    for v in (1, 2, 3):
        store._file(v, ".safetensors").write_bytes(b"torn")
    with pytest.raises(ResumeError) as e:
        _learner(events, store).start(resume=True)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"no intact snapshot to resume from in {store.url}: v3 (")
    assert "v2 (" in msg and "v1 (" in msg and msg.endswith("start without --resume")
    assert isinstance(e.value, ValueError)  # the CLI prints it as one line, exit 2


def test_resume_after_retention_deleted_the_snapshots_input_is_refused(events, tmp_path):  # noqa: F811
    store = _three_snapshots(events, tmp_path)
    part = events.bus._topics[SAMPLES_PREPARED][0]
    assert store.meta(3)["offsets"] == [[SAMPLES_PREPARED, 0, 3]]
    for _ in range(3):  # three more batches, then retention deletes up to offset 5
        events.publish(SAMPLES_PREPARED, prepared(9), key="actor-0")
    del part.records[:5]
    part.base = 5
    with pytest.raises(ResumeError) as e:
        _learner(events, store).start(resume=True)
    assert str(e.value).startswith(f"snapshot v3 resumes {SAMPLES_PREPARED}[0] at offset 3, but retention has "
                                   "deleted the log up to 5: batches 3..4 would be skipped untrained")
    assert [v.version for v in versions(events)] == [0, 1, 2, 3]  # nothing published by the refused start


@pytest.mark.kafka
def test_resume_after_kafka_deleted_the_snapshots_input_is_refused(kafka_bootstrap, tmp_path):
    """The same on the real broker, in a namespace (the bus a decoupled learner has): the log start
    moved by ``DeleteRecords``, as retention moves it."""
    from confluent_kafka import TopicPartition

    from schemas.codec import Codec
    from streams.bus.kafka import KafkaBus
    from streams.bus.namespaced import NamespacedBus
    from streams.events import EventBus
    from streams.topics import Namespace
    from tests.conftest import TEST_CONSUMER_CONFIG
    from tests.support import wait_for

    inner = KafkaBus(kafka_bootstrap, client_id="rlstream-test", consumer_config=TEST_CONSUMER_CONFIG)
    ns = Namespace(f"ret-{uuid.uuid4().hex[:10]}")
    bus = NamespacedBus(inner, ns)
    try:
        bus.create_topics(Namespace().topics())
        ev = EventBus(bus, Codec())
        store = open_store(tmp_path / "snaps", keep_last=None)
        lr = _learner(ev, store)
        lr.start()
        for seq in range(2):
            ev.publish(SAMPLES_PREPARED, prepared(seq), key="actor-0")
            ev.flush()
            wait_for(lambda: lr.step(0.2) is not None, 60, f"update {seq + 1}")
        lr.step(0)  # the due snapshot
        lr.close()
        assert store.latest() == 2 and store.meta(2)["offsets"] == [[SAMPLES_PREPARED, 0, 2]]
        for seq in range(3):
            ev.publish(SAMPLES_PREPARED, prepared(10 + seq), key="actor-0")
        ev.flush()
        tp = TopicPartition(ns.topic(SAMPLES_PREPARED), 0, 4)
        inner._admin.delete_records([tp], request_timeout=30)[tp].result(timeout=30)
        assert bus.log_start(SAMPLES_PREPARED, 0) == 4
        with pytest.raises(ResumeError) as e:
            _learner(ev, store).start(resume=True)
        assert str(e.value).startswith(f"snapshot v2 resumes {SAMPLES_PREPARED}[0] at offset 2, but retention has "
                                       "deleted the log up to 4: batches 2..3 would be skipped untrained")
    finally:
        inner.delete_topics([t.name for t in ns.topics()])
        inner.close(timeout=10)
