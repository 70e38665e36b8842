"""The host blob cache: one verified fetch of each claim-checked blob per host, shared by its
processes; a blob that does not match its claim check is never cached; a cache that cannot take
a blob costs the cache only; the learner leaves what it publishes there. Real Redis where a store
is involved; real processes where the sharing is across processes."""

from __future__ import annotations

import dataclasses
import hashlib
import multiprocessing as mp
import os
import threading
import uuid

import pytest
import torch

from schemas.events import ClaimCheck
from schemas.weights import decode_weights
from config.train import cache_dir_of, default_cache_dir
from streams.blobcache import BlobCacheError, CacheWriteError, HostBlobCache
from streams.policy.blobs import _RespReader
from streams.policies import (
    HostCachedStore,
    PolicyLoadError,
    RedisBlobStore,
    SharedWeights,
    load_policy,
    make_policy_version,
    open_blob_store,
)
from tests.ops.conftest import redis_server_url  # noqa: F401  (fixture)
from tests.streams.test_policies import policy, same
from tests.support import wait_for


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def streaming(data: bytes, calls: list | None = None, part: int = 3):
    """A ``stream`` that hands ``data`` over in parts of ``part`` bytes, counting its calls."""
    def stream(on_chunk):
        if calls is not None:
            calls.append(1)
        for i in range(0, len(data), part):
            on_chunk(memoryview(data)[i:i + part])
    return stream


def test_a_blob_is_fetched_once_and_then_mapped_from_the_host_copy(tmp_path):
    data, calls = os.urandom(1000), []
    a, b = HostBlobCache(str(tmp_path / "c")), HostBlobCache(str(tmp_path / "c"))  # two processes' views
    assert bytes(a.get(digest(data), len(data), streaming(data, calls))) == data
    assert bytes(b.get(digest(data), len(data), streaming(data, calls))) == data
    assert len(calls) == 1 and (a.fills, a.hits, b.fills, b.hits) == (1, 0, 0, 1)
    assert sorted(os.listdir(tmp_path / "c")) == [digest(data), digest(data) + ".lock"]
    assert oct(os.stat(tmp_path / "c").st_mode & 0o777) == "0o700"


def test_readers_racing_for_one_blob_wait_for_the_one_fetch(tmp_path):
    data, calls, gate = os.urandom(1 << 16), [], threading.Event()

    def slow(on_chunk):  # holds the lock until every reader has asked
        calls.append(1)
        gate.wait(10)
        on_chunk(memoryview(data))

    got: list[bytes] = []
    readers = [threading.Thread(target=lambda: got.append(bytes(HostBlobCache(str(tmp_path)).get(
        digest(data), len(data), slow)))) for _ in range(4)]
    for t in readers:
        t.start()
    try:  # the gate opens once one reader fetches and the other three wait on its lock
        wait_for(lambda: calls and blocked_flocks(str(tmp_path / digest(data)) + ".lock") == 3, 20,
                 "one reader fetching and three blocked on its lock", every=0.01)
    finally:
        gate.set()
    for t in readers:
        t.join(20)
    assert got == [data] * 4 and len(calls) == 1


def blocked_flocks(lock_path: str) -> int:
    """How many ``flock`` requests wait on ``lock_path`` (Linux ``/proc/locks``: ``-> FLOCK``)."""
    try:
        ino = os.stat(lock_path).st_ino
    except FileNotFoundError:
        return 0
    n = 0
    with open("/proc/locks") as f:
        for line in f:
            parts = line.split()
            if "->" in parts and "FLOCK" in parts:
                dev_ino = parts[parts.index("FLOCK") + 4]  # FLOCK ADVISORY WRITE pid maj:min:inode
                n += int(dev_ino.rsplit(":", 1)[1]) == ino
    return n


def _fetch_in_process(root: str, url: str, ref: ClaimCheck, out) -> None:
    store = HostCachedStore(RedisBlobStore(url), HostBlobCache(root))
    data = store.fetch_verified(ref)
    out.put((hashlib.sha256(data).hexdigest(), store.cache.fills, store.cache.hits))


def test_processes_of_one_host_fetch_a_claim_check_from_redis_once(tmp_path, redis_server_url):  # noqa: F811
    data = os.urandom(3 << 20)
    store = RedisBlobStore(redis_server_url)
    key = f"rlstream:test:{uuid.uuid4().hex}"
    store.put(key, data)
    ref = ClaimCheck(store=redis_server_url, key=key, sha256=digest(data), size=len(data))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_fetch_in_process, args=(str(tmp_path), redis_server_url, ref, out)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    assert {r[0] for r in results} == {digest(data)}
    assert sum(r[1] for r in results) == 1 and sum(r[2] for r in results) == 2  # one fill, two hits


def test_a_blob_that_does_not_match_its_claim_check_is_refused_and_never_cached(tmp_path):
    data, other = os.urandom(100), os.urandom(100)
    cache = HostBlobCache(str(tmp_path))
    for wrong in (other, data[:-1]):  # other bytes; the same bytes cut short
        with pytest.raises(BlobCacheError, match="does not match its claim check"):
            cache.get(digest(data), len(data), streaming(wrong))
        assert [n for n in os.listdir(tmp_path) if not n.endswith(".lock")] == []
    assert bytes(cache.get(digest(data), len(data), streaming(data))) == data  # the right bytes still fill


def test_an_empty_claim_check_is_refused(tmp_path):
    with pytest.raises(BlobCacheError, match="0 bytes"):
        HostBlobCache(str(tmp_path)).get(digest(b""), 0, streaming(b""))


@pytest.mark.parametrize("bad", ["../" + "0" * 61, "A" * 64, "0" * 63, ""])
def test_a_digest_from_an_event_must_be_64_hex_digits(tmp_path, bad):
    with pytest.raises(BlobCacheError, match="64 hex digits"):
        HostBlobCache(str(tmp_path)).get(bad, 1, streaming(b"x"))


def test_only_the_newest_blobs_stay(tmp_path):
    cache = HostBlobCache(str(tmp_path), keep=2)
    blobs = [os.urandom(10) for _ in range(4)]
    for i, b in enumerate(blobs):
        cache.get(digest(b), len(b), streaming(b))
        os.utime(tmp_path / digest(b), (i, i))  # mtime order: the fill order, whatever the clock
    cache._prune()
    assert sorted(n for n in os.listdir(tmp_path) if not n.endswith(".lock")) == sorted(digest(b) for b in blobs[2:])


def test_a_blob_that_would_not_fit_evicts_the_oldest_first_and_one_that_never_fits_is_not_written(tmp_path):
    cache = HostBlobCache(str(tmp_path), keep=8)
    old = [os.urandom(100) for _ in range(3)]
    for i, b in enumerate(old):
        cache.get(digest(b), len(b), streaming(b))
        os.utime(tmp_path / digest(b), (i, i))
    capacity = 250  # a small /dev/shm: what is free is what the cached blobs leave of it
    cache._free_bytes = lambda: capacity - 100 * len([n for n in os.listdir(tmp_path) if len(n) == 64])
    new = os.urandom(100)
    cache.get(digest(new), len(new), streaming(new))  # 150 - 100 = 50 free before: the oldest two go
    assert sorted(n for n in os.listdir(tmp_path) if len(n) == 64) == sorted([digest(old[2]), digest(new)])
    calls, huge = [], os.urandom(300)
    with pytest.raises(CacheWriteError, match="holds 250 bytes at most, the blob needs 300"):
        cache.get(digest(huge), len(huge), streaming(huge, calls))
    assert calls == []  # nothing fetched or written for it, and nothing evicted in vain:
    assert sorted(n for n in os.listdir(tmp_path) if len(n) == 64) == sorted([digest(old[2]), digest(new)])


def test_a_cache_directory_someone_else_can_write_is_refused(tmp_path):
    os.chmod(tmp_path, 0o777)
    with pytest.raises(PermissionError, match="0700"):
        HostBlobCache(str(tmp_path))


def test_the_cache_directory_comes_from_the_setting_or_dev_shm():
    assert cache_dir_of("off") is None
    assert cache_dir_of(" /x/y ") == "/x/y"
    assert cache_dir_of(None) == cache_dir_of("") == default_cache_dir()
    assert default_cache_dir().endswith(f"rlstream-blobs-{os.getuid()}")


@pytest.fixture
def cached(tmp_path, redis_server_url):  # noqa: F811
    return open_blob_store(redis_server_url, str(tmp_path / "cache"))


def test_a_claim_checked_version_loads_through_the_host_cache_and_the_learner_leaves_it_there(cached):
    p = policy(3)
    pv = make_policy_version(p, policy_id=f"p-{uuid.uuid4().hex[:6]}", version=1, parent_version=None,
                             learner_id="L", algo="ppo", blob_store=cached, claim_check_above=0)
    assert isinstance(cached, HostCachedStore) and pv.weights_ref is not None
    assert os.path.exists(cached.cache.path(pv.weights_ref.sha256))  # the publisher's write-through
    cached.store._r.delete(pv.weights_ref.key)  # gone from Redis: this host still has it
    assert same(load_policy(pv, cached), p) and same(load_policy(pv, cached, shared=SharedWeights()), p)


def test_a_reader_on_another_host_fills_its_cache_from_redis(cached, tmp_path, redis_server_url):  # noqa: F811
    p = policy(4)
    pv = make_policy_version(p, policy_id=f"p-{uuid.uuid4().hex[:6]}", version=2, parent_version=None,
                             learner_id="L", algo="ppo", blob_store=RedisBlobStore(redis_server_url), claim_check_above=0)
    assert not os.path.exists(cached.cache.path(pv.weights_ref.sha256))
    assert same(load_policy(pv, cached), p)
    assert cached.cache.fills == 1 and os.path.exists(cached.cache.path(pv.weights_ref.sha256))


def test_weights_mapped_from_the_cache_are_copy_on_write(cached):
    p = policy(5)
    pv = make_policy_version(p, policy_id=f"p-{uuid.uuid4().hex[:6]}", version=1, parent_version=None,
                             learner_id="L", algo="ppo", blob_store=cached, claim_check_above=0)
    state, _ = decode_weights(cached.fetch_verified(pv.weights_ref))
    name = next(iter(state))
    before = state[name].clone()
    state[name].add_(1.0)  # a stray write stays in this process
    again, _ = decode_weights(cached.fetch_verified(pv.weights_ref))
    assert torch.equal(again[name], before)


def test_a_blob_the_cache_cannot_take_is_still_fetched_and_checked(cached):
    p = policy(6)
    pv = make_policy_version(p, policy_id=f"p-{uuid.uuid4().hex[:6]}", version=1, parent_version=None,
                             learner_id="L", algo="ppo", blob_store=cached.store, claim_check_above=0)
    part = f"{cached.cache.path(pv.weights_ref.sha256)}.{os.getpid()}.{threading.get_ident()}.part"
    os.mkdir(part)  # where the fill would write: an OSError from the file system, as a full /dev/shm gives
    assert same(load_policy(pv, cached), p)
    assert cached.cache.write_errors == 1 and cached.cache.fills == 0
    tampered = ClaimCheck(store=pv.weights_ref.store, key=pv.weights_ref.key, sha256="0" * 64, size=pv.weights_ref.size)
    os.mkdir(f"{cached.cache.path('0' * 64)}.{os.getpid()}.{threading.get_ident()}.part")
    with pytest.raises(PolicyLoadError, match="size or sha256"):
        cached.fetch_verified(tampered)


@pytest.mark.parametrize("size", [0, 1, 6, 7, 8, 100])
def test_a_streamed_redis_value_arrives_whole_and_in_order(redis_server_url, monkeypatch, size):  # noqa: F811
    monkeypatch.setattr(_RespReader, "CHUNK", 7)
    store, key, data = RedisBlobStore(redis_server_url), f"rlstream:test:{uuid.uuid4().hex}", os.urandom(size)
    store.put(key, data)
    parts: list[bytes] = []
    store.stream(key, lambda c: parts.append(bytes(c)))
    assert b"".join(parts) == data and all(0 < len(c) <= 7 for c in parts)
    assert bytes(store.get(key)) == data
    with pytest.raises(PolicyLoadError, match="not found"):
        store.stream(key + "-gone", parts.append)


@pytest.mark.parametrize("digest_, size", [("../../etc/" + "0" * 54, 100), ("0" * 64, 0)])
def test_a_malformed_claim_check_in_an_event_is_a_policy_load_error(cached, digest_, size):
    """The digest and size come from the event: a bad one is a PolicyLoadError (a CodecError, so
    its record is dead-lettered once), and nothing is fetched or written."""
    p = policy(7)
    pv = make_policy_version(p, policy_id=f"p-{uuid.uuid4().hex[:6]}", version=1, parent_version=None,
                             learner_id="L", algo="ppo", blob_store=cached.store, claim_check_above=0)
    bad = dataclasses.replace(pv, weights_ref=ClaimCheck(store=pv.weights_ref.store, key=pv.weights_ref.key,
                                                         sha256=digest_, size=size))
    with pytest.raises(PolicyLoadError):
        load_policy(bad, cached)
    assert not os.path.exists(cached.cache.root) or not [n for n in os.listdir(cached.cache.root) if ".lock" not in n]
