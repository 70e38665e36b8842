"""Fixtures for the operations layer tests (runtime/, learner ops pieces, compose/).

Redis: ``redis_url`` uses ``$REDIS_URL`` when it is set and answers PING;
otherwise it starts a throwaway ``redis-server`` on a free port (no
persistence) for the session and kills it afterwards; otherwise the test is
skipped, except when ``CI=true``, where a missing Redis fails the run.

S3: ``moto_s3`` is a real S3-compatible server, moto's server mode, started as its own process
on a free port for the session and killed afterwards (``testbed.s3.MotoServer``);
``s3_bucket`` a fresh bucket on it. Without moto or s3fs installed the test is skipped, except
when ``CI=true``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator

import pytest
import torch

from tests.support import free_port, wait_for
from testbed.s3 import MotoServer, moto_available

torch.set_num_threads(1)


def _ping(url: str) -> bool:
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=1.0, socket_timeout=1.0)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


def _unavailable(msg: str) -> None:
    if os.environ.get("CI", "").strip().lower() == "true":
        pytest.fail(f"Redis is required when CI=true: {msg}")
    pytest.skip(msg)


@pytest.fixture(scope="session")
def redis_server_url() -> Iterator[str]:
    url = os.environ.get("REDIS_URL", "").strip()
    if url and _ping(url):
        yield url
        return
    exe = shutil.which("redis-server")
    if exe is None:
        _unavailable(f"REDIS_URL {'unreachable' if url else 'unset'} and no redis-server on PATH")
    port = free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    local_url = f"redis://127.0.0.1:{port}/0"
    try:
        try:
            wait_for(lambda: proc.poll() is not None or _ping(local_url), 60, "redis-server", every=0.05)
        except AssertionError:
            pass
        if proc.poll() is not None or not _ping(local_url):
            _unavailable(f"redis-server on port {port} did not come up (rc={proc.poll()})")
        yield local_url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@pytest.fixture
def redis_url(redis_server_url: str) -> str:
    return redis_server_url


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A unique key prefix; its keys are deleted afterwards (never FLUSHDB a shared Redis)."""
    import redis

    prefix = f"rlstream-test:{uuid.uuid4().hex[:10]}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*"))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoServer]:
    if not moto_available():
        _unavailable("moto[server] or s3fs not installed (pip install -e '.[test]'): no S3 server")
    with MotoServer() as server:
        yield server


@pytest.fixture
def s3_bucket(moto_s3: MotoServer) -> str:
    """A new, empty bucket on the session's S3 server."""
    name = f"rlstream-test-{uuid.uuid4().hex[:12]}"
    moto_s3.make_bucket(name)
    return name
