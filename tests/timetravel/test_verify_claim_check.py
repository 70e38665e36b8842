"""``rlstream verify`` on a run whose versions went by claim check (Redis): the recorded weights
are fetched from the store ``REDIS_URL`` names, and every version is still reproduced."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from logtools.timetravel.record import load
from logtools.timetravel.verify import MISSING, format_report, verify
from schemas.codec import Codec
from schemas.events import ClaimCheck, PolicyVersion
from schemas.weights import sha256
from streams.bus.filelog import encode_frame, read_partition
from streams.policies import RedisBlobStore
from streams.topics import POLICY_VERSIONS
from tests.ops.conftest import redis_server_url  # noqa: F401  (fixture)

from .recorded import UPDATES, copy_run
from .test_verify_colocated import cli

pytestmark = pytest.mark.redis

CODEC = Codec()


def claim_check_versions(run_dir: Path, store: RedisBlobStore, prefix: str) -> list[str]:
    """Rewrite the run's PolicyVersions as a learner with a claim-check store publishes them:
    weights in the store, a ``weights_ref`` in the event. Returns the keys written."""
    keys = []
    for path in sorted((run_dir / "log" / POLICY_VERSIONS).glob("*.log")):
        records = []
        for rec in read_partition(path, POLICY_VERSIONS, int(path.stem)):
            pv = CODEC.decode(rec.value, PolicyVersion)
            data = pv.weights
            key = f"{prefix}:{pv.policy_id}:{pv.version}"
            store.put(key, data)
            keys.append(key)
            ref = ClaimCheck(store=store.url, key=key, sha256=sha256(data), size=len(data))
            pv = replace(pv, weights=None, weights_ref=ref)
            records.append(replace(rec, value=CODEC.encode(pv), headers={**rec.headers, **CODEC.headers_for(pv)}))
        path.write_bytes(b"".join(encode_frame(r) for r in records))
    return keys


@pytest.fixture
def claim_checked_run(colocated_run, tmp_path, redis_server_url):  # noqa: F811
    import uuid

    import redis

    run_dir = copy_run(colocated_run[0], tmp_path / "cc")
    store = RedisBlobStore(redis_server_url)
    keys = claim_check_versions(run_dir, store, f"rlstream-test:{uuid.uuid4().hex[:10]}")
    assert len(keys) == UPDATES + 1
    try:
        yield run_dir, store
    finally:
        redis.Redis.from_url(redis_server_url).delete(*keys)


def test_verify_fetches_claim_checked_weights(claim_checked_run):
    run_dir, store = claim_checked_run
    run = load(run_dir)
    assert all(pv.weights is None and pv.weights_ref is not None for _, pv in run.versions.values())
    report = verify(run, run_dir / "snapshots", blobs=store)
    assert report.ok, format_report(report)
    assert report.checked == list(range(UPDATES + 1))
    # without the store the recorded weights cannot be read: said, not a crash
    report = verify(run, run_dir / "snapshots")
    assert not report.ok and report.divergence.reason == MISSING
    assert "no blob store" in report.divergence.detail


def test_the_verify_command_takes_the_store_from_redis_url(claim_checked_run, redis_server_url, monkeypatch, tmp_path):  # noqa: F811
    run_dir, _ = claim_checked_run
    monkeypatch.setenv("REDIS_URL", redis_server_url)
    monkeypatch.setenv("RLSTREAM_BLOB_CACHE", str(tmp_path / "blobs"))
    p = cli("verify", str(run_dir))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert f"{UPDATES + 1} versions reproduced bit for bit" in p.stdout
    assert len(os.listdir(tmp_path / "blobs")) >= 1  # fetched through the host cache
    monkeypatch.delenv("REDIS_URL")
    p = cli("verify", str(run_dir))
    assert p.returncode == 1 and "no blob store" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
