"""Contract tests run against every snapshot backend: a local directory, a real Redis, and
S3-compatible object storage on a real S3 server (moto's server mode, its own process)."""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from config.env import Environment
from config.storage import ObjectStoreConfig
from learner.snapshots.base import SnapshotStore
from learner.snapshots.format import (
    SnapshotCorruptError,
    SnapshotError,
    SnapshotNotFoundError,
    SnapshotPinnedError,
    flatten_state,
    unflatten_state,
)
from learner.snapshots.local_dir import LocalDirSnapshotStore
from learner.snapshots.object_store import S3_TIMEOUT_S, S3_TRIES, ObjectSnapshotStore, _s3_options
from learner.snapshots.redis_store import RedisSnapshotStore
from learner.snapshots.schedule import rollback
from learner.snapshots.url import open_store
from tests.support import free_port

BACKENDS = ("local", pytest.param("redis", marks=pytest.mark.redis), "s3")


def make_store(kind: str, tmp_path: Path, request: pytest.FixtureRequest, keep_last: int | None = 10,
               keep_timed: int | None = 7):
    if kind == "local":
        return LocalDirSnapshotStore(tmp_path / "snaps", keep_last=keep_last, fsync=False, keep_timed=keep_timed)
    if kind == "s3":
        s3 = request.getfixturevalue("moto_s3")
        bucket = request.getfixturevalue("s3_bucket")
        return ObjectSnapshotStore(f"s3://{bucket}/run/snaps", keep_last=keep_last, keep_timed=keep_timed,
                                   object_store=s3.config())
    url = request.getfixturevalue("redis_url")
    prefix = request.getfixturevalue("redis_prefix")
    return RedisSnapshotStore(url, prefix=prefix, keep_last=keep_last, keep_timed=keep_timed)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def store_factory(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Callable[..., SnapshotStore]:
    return lambda keep_last=10, keep_timed=7: make_store(backend, tmp_path, request, keep_last, keep_timed)


@pytest.fixture
def store(store_factory: Callable[..., SnapshotStore]) -> SnapshotStore:
    return store_factory()


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "pi.weight": torch.randn(8, 4, generator=g),
        "pi.bias": torch.randn(8, generator=g),
        "log_std": torch.randn(2, generator=g).to(torch.bfloat16),
        "counts": torch.arange(5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
    }


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


SUFFIX = {"weights": ".safetensors", "state": ".state.safetensors", "record": ".json"}


def raw_get(store: SnapshotStore, version: int, part: str) -> bytes:
    """The stored bytes of ``part`` (weights, state, record), read behind the store's back."""
    if isinstance(store, LocalDirSnapshotStore):
        return (store.path / f"v{version:08d}{SUFFIX[part]}").read_bytes()
    if isinstance(store, ObjectSnapshotStore):
        return store.fs.cat_file(f"{store.root}/v{version:08d}{SUFFIX[part]}")
    assert isinstance(store, RedisSnapshotStore)
    if part == "record":
        return store._r.hget(store._k("meta", version), "record")
    return store._r.get(store._k(part, version))


def raw_set(store: SnapshotStore, version: int, part: str, data: bytes | None) -> None:
    """Overwrite (``None``: delete) ``part`` of ``version`` behind the store's back."""
    if isinstance(store, LocalDirSnapshotStore):
        path = store.path / f"v{version:08d}{SUFFIX[part]}"
        path.unlink() if data is None else path.write_bytes(data)
    elif isinstance(store, ObjectSnapshotStore):
        path = f"{store.root}/v{version:08d}{SUFFIX[part]}"
        store.fs.rm_file(path) if data is None else store.fs.pipe_file(path, data)
    else:
        assert isinstance(store, RedisSnapshotStore)
        if part == "record":
            assert data is not None
            store._r.hset(store._k("meta", version), "record", data)
        elif data is None:
            store._r.delete(store._k(part, version))
        else:
            store._r.set(store._k(part, version), data)


def corrupt(store: SnapshotStore, version: int, part: str) -> None:
    """Flip one byte of ``part`` (weights, state, record) in the backend's storage."""
    data = bytearray(raw_get(store, version, part))
    data[len(data) // 2] ^= 0x01
    raw_set(store, version, part, bytes(data))


def test_weights_and_meta_round_trip(store: SnapshotStore) -> None:
    w = weights()
    meta = {"algo": "ppo", "step": 12, "losses": {"loss_pi": 0.25}, "tags": ["a", "b"]}
    ref = store.save(1, w, meta)
    assert isinstance(store, SnapshotStore)
    assert ref.version == 1 and len(ref.sha256) == 64 and ref.nbytes > 0 and not ref.has_state
    assert ref.created_at_ms <= int(time.time() * 1000)
    got, got_meta = store.load(1)
    assert_same(w, got)
    assert got_meta == meta
    assert store.ref(1) == ref
    assert store.meta(1) == meta
    assert store.load_state(1) is None


def test_blobs_are_safetensors_not_pickle(store: SnapshotStore) -> None:
    store.save(1, weights(), state={"step": 1, "t": torch.ones(2)})
    for blob in (raw_get(store, 1, "weights"), raw_get(store, 1, "state")):
        (header_len,) = struct.unpack("<Q", blob[:8])
        header = json.loads(blob[8 : 8 + header_len])  # safetensors: u64 length + JSON header
        assert isinstance(header, dict)
        assert not blob.startswith(b"\x80")  # no pickle protocol marker
        assert b"PK\x03\x04" not in blob[:64]  # not a torch.save zip either


def test_learner_state_round_trip_resumes_training(store: SnapshotStore) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(16, 4)
    for _ in range(3):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": 3,
        "rng": torch.get_rng_state(),
        "dtype": torch.float32,
        "shapes": (4, 8),
        "none": None,
    }
    ref = store.save(3, model.state_dict(), {"step": 3}, state=state)
    assert ref.has_state
    got = store.load_state(3)
    assert got["step"] == 3 and got["dtype"] is torch.float32 and got["shapes"] == (4, 8) and got["none"] is None
    assert torch.equal(got["rng"], state["rng"])
    assert set(got["optimizer"]["state"]) == {0, 1, 2, 3}  # int keys survive
    assert got["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)

    model2 = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    model2.load_state_dict(got["model"])
    opt2.load_state_dict(got["optimizer"])
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(x).pow(2).mean().backward()
        o.step()
    for p1, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p1, p2)  # resumed run continues bit-identically


def test_unstorable_state_and_meta_are_refused(store: SnapshotStore) -> None:
    with pytest.raises(TypeError, match="no pickle"):
        store.save(1, weights(), state={"fn": lambda: 1})
    with pytest.raises(TypeError):
        store.save(1, weights(), meta={"t": torch.ones(1)})
    with pytest.raises(TypeError):
        store.save(1, {"w": [1.0, 2.0]})  # type: ignore[dict-item]
    with pytest.raises(ValueError):
        store.save(-1, weights())
    assert store.versions() == []


@pytest.mark.parametrize("part", ["weights", "record", "state"])
def test_corruption_is_detected(store: SnapshotStore, part: str) -> None:
    store.save(1, weights(), {"a": 1}, state={"t": torch.randn(100)})
    corrupt(store, 1, part)
    with pytest.raises(SnapshotCorruptError):
        store.load(1) if part != "state" else store.load_state(1)


def test_truncated_or_missing_blob_is_corrupt(store: SnapshotStore) -> None:
    store.save(1, weights())
    raw_set(store, 1, "weights", raw_get(store, 1, "weights")[:-10])
    with pytest.raises(SnapshotCorruptError, match="bytes"):
        store.load(1)
    store.save(2, weights())
    raw_set(store, 2, "weights", None)
    with pytest.raises(SnapshotCorruptError, match="missing"):
        store.load(2)


def test_versions_latest_delete_not_found(store: SnapshotStore) -> None:
    assert store.versions() == [] and store.latest() is None
    for v in (5, 1, 12):
        store.save(v, weights(v))
    assert store.versions() == [1, 5, 12] and store.latest() == 12
    store.delete(5)
    assert store.versions() == [1, 12]
    with pytest.raises(SnapshotNotFoundError):
        store.load(5)
    with pytest.raises(SnapshotNotFoundError):
        store.delete(5)
    with pytest.raises(KeyError):  # SnapshotNotFoundError is a KeyError too
        store.load_state(99)


def test_resave_replaces(store: SnapshotStore) -> None:
    store.save(1, weights(1), {"try": 1}, state={"x": torch.ones(1)})
    store.save(1, weights(2), {"try": 2})
    got, meta = store.load(1)
    assert_same(got, weights(2))
    assert meta == {"try": 2} and store.load_state(1) is None


def test_retention_deletes_oldest_but_keeps_pinned(store_factory: Callable[..., SnapshotStore]) -> None:
    store = store_factory(keep_last=3)
    store.save(1, weights())
    store.save(2, weights())
    store.pin(2)
    for v in range(3, 8):
        store.save(v, weights())
    assert store.versions() == [2, 5, 6, 7]
    assert store.pinned() == {2}
    with pytest.raises(SnapshotPinnedError):
        store.delete(2)
    assert_same(store.load(2)[0], weights())
    # pins are stored with the snapshots: a second handle (another process) sees them
    other = store_factory(keep_last=1)
    assert other.pinned() == {2}
    assert other.prune() == [5, 6]
    assert other.versions() == [2, 7]
    other.unpin(2)
    assert other.prune() == [2]
    with pytest.raises(SnapshotNotFoundError):
        other.pin(2)


def test_time_based_snapshots_are_kept_by_their_own_retention(store_factory: Callable[..., SnapshotStore]) -> None:
    """The newest ``keep_last`` of all versions, plus the newest ``keep_timed`` of those saved as
    time-based, plus pins; the marks are stored with the snapshots (a second handle sees them)
    and go with the versions they mark."""
    store = store_factory(keep_last=3, keep_timed=2)
    for v in range(1, 11):
        store.save(v, {"w": torch.full((2,), float(v))}, timed=v in (2, 4, 6))
    assert store.versions() == [4, 6, 8, 9, 10]
    assert store.timed() == {4, 6}
    assert store._marks("timed") == {4, 6}  # the pruned 2's mark went with it
    assert torch.equal(store.load(4)[0]["w"], torch.full((2,), 4.0))
    store.save(11, {"w": torch.ones(2)}, timed=True)  # the third timed one pushes out the oldest
    assert store.versions() == [6, 9, 10, 11] and store.timed() == {6, 11}
    store.save(6, {"w": torch.zeros(2)})  # a resave keeps its mark
    assert store.timed() == {6, 11}
    other = store_factory(keep_last=3, keep_timed=1)
    assert other.timed() == {6, 11}
    assert other.prune() == [6]
    assert other.versions() == [9, 10, 11] and other.timed() == {11}
    assert store_factory(keep_last=1, keep_timed=0).prune() == [9, 10]  # 0: no extra retention
    other.delete(11)
    assert other.versions() == [] and other._marks("timed") == set()
    with pytest.raises(ValueError):
        store_factory(keep_timed=-1)

    store = store_factory(keep_last=None)
    for v in range(1, 15):
        store.save(v, {"w": torch.ones(1)})
    assert store.versions() == list(range(1, 15))
    with pytest.raises(ValueError):
        store_factory(keep_last=0)


def test_rollback_returns_verified_weights(store: SnapshotStore) -> None:
    for v in range(1, 4):
        store.save(v, weights(v), {"v": v}, state={"step": v})
    snap = rollback(store, 2)
    assert snap.version == 2 and snap.meta == {"v": 2} and snap.state is None
    assert_same(snap.weights, weights(2))
    assert store.pinned() == set()
    snap = rollback(store, 1, with_state=True, pin=True)
    assert snap.state == {"step": 1} and store.pinned() == {1}
    with pytest.raises(SnapshotNotFoundError):
        rollback(store, 42)
    corrupt(store, 3, "weights")
    with pytest.raises(SnapshotCorruptError):
        rollback(store, 3)


def test_shared_tensors_are_saved(store: SnapshotStore) -> None:
    w = torch.randn(4, 4)
    tied = {"embed.weight": w, "head.weight": w, "half": w[:2]}
    store.save(1, tied)
    got, _ = store.load(1)
    assert torch.equal(got["embed.weight"], w) and torch.equal(got["head.weight"], w)
    assert torch.equal(got["half"], w[:2])
    # in learner state the same tensor object comes back as one object
    store.save(2, {"x": torch.ones(1)}, state={"a": w, "b": w})
    st = store.load_state(2)
    assert st["a"] is st["b"] and torch.equal(st["a"], w)


def test_flatten_structure_is_json() -> None:
    tensors, structure = flatten_state({"state": {0: {"step": torch.tensor(1.0)}}, "groups": [{"lr": 1e-3}]})
    json.dumps(structure)
    assert list(tensors) == ["t0"]
    back = unflatten_state(tensors, structure)
    assert back["groups"] == [{"lr": 1e-3}] and torch.equal(back["state"][0]["step"], torch.tensor(1.0))
    with pytest.raises(TypeError):
        flatten_state({(1, 2): 3})


def test_local_writes_are_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalDirSnapshotStore(tmp_path, keep_last=5)
    store.save(1, weights())
    names = sorted(os.listdir(tmp_path))
    assert names == ["v00000001.json", "v00000001.safetensors"]

    real_replace = os.replace

    def crash_on_record(src, dst):
        if str(dst).endswith(".json"):
            raise OSError("disk full")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_record)
    with pytest.raises(OSError):
        store.save(2, weights(2))
    monkeypatch.undo()
    assert store.versions() == [1]  # the record is the commit point
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    (tmp_path / "garbage.txt").write_text("x")
    (tmp_path / ".v00000009.json.1.ab.tmp").write_text("{")
    assert store.versions() == [1]


def test_open_store_factory(tmp_path: Path) -> None:
    s1 = open_store(str(tmp_path / "a"))
    assert isinstance(s1, LocalDirSnapshotStore) and s1.keep_last == 10
    s2 = open_store((tmp_path / "b").as_uri() + "?keep_last=3")
    assert isinstance(s2, LocalDirSnapshotStore) and s2.keep_last == 3 and s2.path == tmp_path / "b"
    s2.save(1, {"w": torch.ones(1)})
    assert open_store(s2.url).versions() == [1]
    assert open_store(tmp_path / "c", keep_last=None).keep_last is None
    s3 = open_store("redis://user:secret@localhost:6399/2?prefix=run42&keep_last=0")
    assert isinstance(s3, RedisSnapshotStore)
    assert s3.prefix == "run42" and s3.keep_last is None
    assert "secret" not in s3.url and "prefix=run42" in s3.url
    assert s3.keep_timed == 7 and open_store(s2.url + "?keep_timed=2").keep_timed == 2
    s4 = open_store("s3://bucket/a/b/?keep_last=4&keep_timed=0", keep_timed=5)
    assert isinstance(s4, ObjectSnapshotStore)
    assert (s4.url, s4.root, s4.keep_last, s4.keep_timed) == ("s3://bucket/a/b", "bucket/a/b", 4, 0)
    assert open_store("s3://bucket", keep_timed=5).keep_timed == 5
    with pytest.raises(ValueError, match="unknown parameters"):
        open_store("s3://bucket/x?endpoint=http://x")
    with pytest.raises(ValueError):
        open_store("gs://bucket/x")


@pytest.mark.redis
def test_open_store_redis(redis_url: str, redis_prefix: str) -> None:
    store = open_store(f"{redis_url}?prefix={redis_prefix}&keep_last=2")
    for v in range(1, 5):
        store.save(v, {"w": torch.full((3,), float(v))})
    assert store.versions() == [3, 4]
    ref = store.ref(4)
    assert ref.key == f"{redis_prefix}:weights:4"
    assert isinstance(store, RedisSnapshotStore)
    keys = {k.decode() for k in store.iter_keys()}
    assert keys == {f"{redis_prefix}:{k}" for k in ("versions", "meta:3", "meta:4", "weights:3", "weights:4")}
    store.close()


def test_open_store_s3(moto_s3, s3_bucket: str) -> None:
    """An ``s3://bucket/prefix`` URL: objects laid out as files are, under the prefix; the
    claim-check key is the weights' object; a missing bucket reads as empty and is an error on
    write, naming the bucket."""
    store = open_store(f"s3://{s3_bucket}/runs/r1?keep_last=2&keep_timed=1", object_store=moto_s3.config())
    for v in range(1, 5):
        store.save(v, {"w": torch.full((3,), float(v))}, timed=v == 2)
    store.pin(3)
    assert store.versions() == [2, 3, 4] and store.timed() == {2} and store.pinned() == {3}
    assert store.ref(4).key == f"s3://{s3_bucket}/runs/r1/v00000004.safetensors"
    names = {n.rsplit("/", 1)[-1] for n in moto_s3.filesystem().ls(f"{s3_bucket}/runs/r1", detail=False)}
    assert names == {"pins.json", "timed.json"} | {f"v0000000{v}{x}" for v in (2, 3, 4) for x in (".json", ".safetensors")}
    again = open_store(store.url, keep_last=None, object_store=moto_s3.config())  # another process's view
    assert again.versions() == [2, 3, 4] and torch.equal(again.load(3)[0]["w"], torch.full((3,), 3.0))
    store.save(5, {"w": torch.ones(1)})
    assert again.versions() == [2, 3, 4, 5]  # listings are not cached (4, 5 newest; 2 timed; 3 pinned)
    missing = open_store("s3://no-such-bucket-here/x", object_store=moto_s3.config())
    assert missing.versions() == []
    with pytest.raises(SnapshotError, match="no-such-bucket-here"):
        missing.save(1, {"w": torch.ones(1)})


def test_the_s3_endpoint_and_credentials_come_from_the_environment_read_at_the_entry_point(
        moto_s3, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ObjectStoreConfig.from_environment`` maps the standard AWS variables; a store opened with
    it reaches the server they name, though this process's own environment names a dead one
    (so nothing falls back to the SDK reading ``os.environ`` behind rlstream's back)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    env = Environment({**moto_s3.env(), "AWS_SESSION_TOKEN": "tok", "AWS_REGION": "", "AWS_DEFAULT_REGION": "eu-west-2"})
    cfg = ObjectStoreConfig.from_environment(env)
    assert cfg == ObjectStoreConfig(moto_s3.endpoint_url, "eu-west-2", moto_s3.config().access_key_id,
                                    moto_s3.config().secret_access_key, "tok")
    assert "secret" not in repr(cfg) and "tok" not in repr(cfg)
    assert _s3_options(cfg) | {"use_listings_cache": 1} == {
        "endpoint_url": moto_s3.endpoint_url, "client_kwargs": {"region_name": "eu-west-2"},
        "key": cfg.access_key_id, "secret": cfg.secret_access_key, "token": "tok", "use_listings_cache": 1,
        "config_kwargs": {"connect_timeout": 10, "read_timeout": S3_TIMEOUT_S,
                          "retries": {"max_attempts": S3_TRIES, "mode": "standard"}}}
    cfg = ObjectStoreConfig.from_environment(Environment(moto_s3.env()))
    store = open_store(f"s3://{s3_bucket}/env", object_store=cfg)
    store.save(1, {"w": torch.ones(2)})
    assert open_store(f"s3://{s3_bucket}/env", object_store=moto_s3.config()).versions() == [1]


def _state_1m() -> tuple[dict[str, torch.Tensor], dict]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 700), nn.Tanh(), nn.Linear(700, 8))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    return model.state_dict(), {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}


def test_save_load_round_trips_1m_params(store: SnapshotStore) -> None:
    """A 1M-parameter policy with its optimizer state survives save and load bit for bit (its
    timings live in bench/, not here)."""
    w, state = _state_1m()
    n = sum(t.numel() for t in w.values())
    assert 900_000 <= n <= 1_200_000
    ref = store.save(1, w, {"n": n}, state=state)
    assert ref.nbytes >= 4 * n
    got, meta = store.load(1)
    assert_same(w, got)
    assert meta["n"] == n
    back = store.load_state(1)
    assert_same(state["model"], back["model"])
    assert back["step"] == 1 and back["optimizer"]["state"].keys() == state["optimizer"]["state"].keys()
