"""Redis with a password (``requirepass``), through the clients the project uses (issue 39.4): the
snapshot store (redis-py) and the claim-check blob store (redis-py for writes; its own streaming
``GET`` for reads, which sends ``AUTH`` first) work with ``redis://:PASSWORD@host:port/0``, never
show the password (in refs, claim checks on the bus, errors), and a wrong password is a clear
error: from the stores, and in one line with exit 2 from the real ``rlstream`` command, for a run
and for a role started alone. The server is this module's own, on a free port."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support import free_port, wait_for

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "r3dis-right"
WRONG = "not-the-redis-password"


@pytest.fixture(scope="module")
def redis_port() -> Iterator[int]:
    """A ``redis-server --requirepass PASSWORD`` of this module's own; skipped without one (failed
    under ``CI=true``), ended (and waited for) pass or fail."""
    exe = shutil.which("redis-server")
    if exe is None:
        if os.environ.get("CI", "").strip().lower() == "true":
            pytest.fail("redis-server is required when CI=true")
        pytest.skip("no redis-server on PATH")
    import redis

    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--requirepass", PASSWORD], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def up() -> bool:
            assert proc.poll() is None, f"redis-server exited {proc.returncode}"
            client = redis.Redis(host="127.0.0.1", port=port, password=PASSWORD, socket_connect_timeout=1)
            try:
                return bool(client.ping())
            finally:
                client.close()

        wait_for(up, 30, "redis-server --requirepass", every=0.05, ignore=(redis.exceptions.ConnectionError,))
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def url(port: int, password: str | None = PASSWORD, query: str = "") -> str:
    auth = f":{password}@" if password is not None else ""
    return f"redis://{auth}127.0.0.1:{port}/0{query}"


def test_the_snapshot_store_with_a_password(redis_port):
    from learner.snapshots.url import open_store

    store = open_store(url(redis_port, query="?prefix=pw-snaps&keep_last=2"))
    weights = {"w": torch.arange(6, dtype=torch.float32)}
    refs = [store.save(v, weights, {"algo": "ppo"}) for v in (1, 2, 3)]
    assert store.versions() == [2, 3] and store.latest() == 3  # kept the last 2
    got, meta = store.load(3)
    assert torch.equal(got["w"], weights["w"]) and meta["algo"] == "ppo"
    for text in (store.url, repr(store), *(r.store_url for r in refs), repr(refs[-1])):
        assert PASSWORD not in text, text
    assert store.url.startswith(f"redis://:***@127.0.0.1:{redis_port}/0")


def test_a_wrong_or_missing_redis_password_is_a_clear_error(redis_port):
    from learner.snapshots.format import SnapshotWriteError
    from learner.snapshots.url import open_store
    from rlstream.guide import check_redis

    for password in (WRONG, None):
        bad = open_store(url(redis_port, password, "?prefix=pw-bad"))
        with pytest.raises(SnapshotWriteError) as info:
            bad.save(1, {"w": torch.zeros(2)}, {"algo": "ppo"})
        assert "AuthenticationError" in str(info.value) and WRONG not in str(info.value), info.value
        # what rlstream train and the roles check before they start (roles: only the password)
        for unreachable_ok in (False, True):
            with pytest.raises(SystemExit) as refused:
                check_redis(url(redis_port, password), None, unreachable_ok=unreachable_ok)
            line = str(refused.value.code)
            assert "refused the credentials" in line and "redis://:PASSWORD@host:port/0" in line, line
            assert WRONG not in line and "\n" not in line
    check_redis(url(redis_port), url(redis_port))  # the right one passes
    check_redis(url(free_port()), None, unreachable_ok=True)  # nothing there: left to a role's retries


def test_the_claim_check_store_with_a_password(redis_port):
    from schemas.weights import sha256
    from streams.policy.blobs import FetchRetry, RedisBlobStore
    from streams.policy.errors import BlobWriteError

    store = RedisBlobStore(url(redis_port))
    data = os.urandom(3 << 20)  # three of the streaming reader's parts
    store.put("pw:blob", data)
    assert bytes(store.get("pw:blob")) == data  # the streaming GET, after AUTH
    parts: list[bytes] = []
    store.stream("pw:blob", lambda chunk: parts.append(bytes(chunk)))
    assert len(parts) >= 3 and sha256(b"".join(parts)) == sha256(data)
    assert store.url == f"redis://:***@127.0.0.1:{redis_port}/0" and PASSWORD not in repr(store)

    bad = RedisBlobStore(url(redis_port, WRONG), retry=FetchRetry(attempts=1))
    with pytest.raises(BlobWriteError) as info:
        bad.put("pw:other", b"x")
    with pytest.raises(ConnectionError) as read:
        bad.get("pw:blob")
    for e in (info.value, read.value):
        assert ("AuthenticationError" in str(e) or "WRONGPASS" in str(e)) and WRONG not in str(e), e


def test_a_claim_check_on_the_bus_never_carries_the_password(redis_port):
    from streams.policy.blobs import RedisBlobStore
    from streams.policy.publish import make_policy_version
    from tests.rlstream.conftest import make_policy

    pv = make_policy_version(make_policy(0), policy_id="p", version=1, parent_version=None, learner_id="l",
                             algo="ppo", blob_store=RedisBlobStore(url(redis_port)), claim_check_above=0,
                             inline_limit=0)
    assert pv.weights_ref is not None and PASSWORD not in pv.weights_ref.store, pv.weights_ref


def rlstream(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    env.pop("REDIS_URL", None)
    return subprocess.run([sys.executable, "-m", "rlstream.cli", *args], cwd=str(cwd), env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("argv", [
    ["train", "--env", "Pendulum-v1", "--learner.snapshot-store", "STORE"],
    ["learner", "--env", "Pendulum-v1", "--metrics-port", "-1", "--learner.snapshot-store", "STORE"],
    ["actor", "--env", "Pendulum-v1", "--metrics-port", "-1", "--deploy.redis-url", "STORE"],
])
def test_rlstream_refuses_a_wrong_redis_password_in_one_line(redis_port, tmp_path, argv):
    store = url(redis_port, WRONG)
    p = rlstream([store if a == "STORE" else a for a in argv], tmp_path)
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert lines[0].startswith(f"rlstream {argv[0]}: ") and "refused the credentials" in lines[0], lines[0]
    assert f"redis://127.0.0.1:{redis_port}/0" in lines[0] and WRONG not in p.stderr + p.stdout
