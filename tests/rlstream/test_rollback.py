"""rlstream rollback: snapshot K republished as version newest+1 (parent K), seen by a live
subscriber with K's weights; clear errors for a missing snapshot or store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from agents.networks import Policy
from learner.snapshots.url import open_store
from logtools.rollback import RollbackError, rollback
from logtools.subscribe import PolicyFeed
from config import BusConfig
from rlstream.wiring import build_bus, build_events
from schemas.codec import Codec
from schemas.events import PolicyVersion
from schemas.weights import decode_weights
from streams.policies import (
    RedisBlobStore,
    arch_of,
    make_policy_version,
    publish_policy_version,
    weights_bytes,
)
from streams.topics import POLICY_VERSIONS
from tests.ops.conftest import moto_s3, redis_server_url, s3_bucket  # noqa: F401  (fixtures)
from tests.support import free_port
from tests.timetravel.test_verify_colocated import ROOT


@pytest.fixture
def history(events, pv, tmp_path):
    """Versions 0..4 published with different weights, each snapshotted."""
    store = open_store(tmp_path / "snaps", keep_last=None)
    policies = {}
    for v in range(5):
        policies[v] = pv.publish(events, v)
        store.save(v, policies[v].state_dict(), {"algo": "ppo", "updates": v})
    return store, policies


def test_rollback_publishes_a_new_version_with_the_snapshot_weights(events, pv, history):
    store, policies = history
    with PolicyFeed(events) as feed:  # a live follower, at the newest (4)
        assert [u.version for u in feed.poll(1.0)] == [4]
        got = []
        t = threading.Thread(target=lambda: got.extend(feed.updates(count=1, idle_timeout=60.0)))
        t.start()
        result = rollback(events, str(store.path), 2)
        t.join(60)
    assert result["new_version"] == 5 and result["from_snapshot"] == 2 and result["parent_version"] == 2
    assert result["previous_version"] == 4 and result["arch_source"] == "version 4"
    (u,) = got
    assert u.version == 5 and u.parent_version == 2 and u.learner_id == "rollback"
    assert pv.same_weights(u.policy, policies[2])
    assert not pv.same_weights(u.policy, policies[4])
    assert u.metrics == {"rollback_from_snapshot": 2.0}
    assert store.pinned() == {2}  # kept: a learner pruning old snapshots never drops what it continues from
    # A second rollback stacks on top: versions only grow.
    assert rollback(events, store.url, 0)["new_version"] == 6
    assert store.pinned() == {0, 2}


def test_missing_snapshot_lists_what_exists(events, history):
    store, _ = history
    with pytest.raises(RollbackError, match=r"no snapshot of version 9 .*snapshots there: 0, 1, 2, 3, 4"):
        rollback(events, str(store.path), 9)


def test_missing_store_is_an_error_and_is_not_created(events, tmp_path):
    where = tmp_path / "nope"
    with pytest.raises(RollbackError, match="does not exist"):
        rollback(events, str(where), 0)
    assert not where.exists()


def test_without_published_versions_the_architecture_comes_from_the_shapes(events, pv, tmp_path):
    store = open_store(tmp_path / "s", keep_last=None)
    p = pv.make_policy(3, hidden=(16, 4))
    store.save(3, p.state_dict(), {"algo": "ppo"})
    result = rollback(events, str(store.path), 3)
    assert result["new_version"] == 4 and result["arch_source"].startswith("shapes")
    assert result["arch"]["hidden"] == [16, 4]
    with PolicyFeed(events, from_version=0) as feed:
        (u,) = feed.poll(1.0)
    assert u.version == 4 and pv.same_weights(u.policy, p)


def test_rollback_of_snapshots_a_learner_wrote(events, pv, tmp_path):
    import numpy as np

    from agents.registry import make_algorithm
    from learner.learner import Learner, LearnerConfig
    from schemas.events import PreparedBatch, SampleBatch, new_id, now_ms
    from streams.topics import SAMPLES_PREPARED

    T, N, OBS, ACT = 8, 2, 3, 1
    rng = np.random.default_rng(0)

    def prepared(seq):
        sb = SampleBatch(
            batch_id=new_id(), actor_id="actor-0", seq=seq, env_id="Toy-v0", policy_version=seq,
            created_at_ms=now_ms(), obs=rng.normal(size=(T, N, OBS)).astype(np.float32),
            actions=rng.normal(size=(T, N, ACT)).astype(np.float32), rewards=rng.normal(size=(T, N)).astype(np.float32),
            terminated=np.zeros((T, N), bool), truncated=np.zeros((T, N), bool),
            behaviour_logp=np.full((T, N), -1.0, np.float32), last_obs=np.zeros((N, OBS), np.float32),
            final_obs_index=np.zeros(0, np.int64), final_obs=np.zeros((0, OBS), np.float32))
        ones = np.ones((T, N), np.float32)
        return PreparedBatch(sb, seq, 0, 0, ones, ones, now_ms())

    store = open_store(tmp_path / "snaps", keep_last=None)
    algo = make_algorithm("ppo", OBS, ACT, {"num_minibatches": 1, "update_epochs": 1, "hidden": [8]}, "cpu")
    learner = Learner(LearnerConfig(train_batch_size=T * N, snapshot_every=1), algo, events, snapshots=store)
    learner.start(resume=False)
    for s in range(3):
        events.publish(SAMPLES_PREPARED, prepared(s), key="actor-0")
        assert learner.step(0.5) is not None
    learner.close()
    assert store.versions() == [1, 2, 3]
    weights1, _ = store.load(1)
    result = rollback(events, str(store.path), 1)
    assert result["new_version"] == 4 and result["arch"]["hidden"] == [8]
    with PolicyFeed(events) as feed:
        (u,) = feed.poll(1.0)
    assert u.version == 4 and u.parent_version == 1
    state = u.policy.state_dict()
    assert all(np.array_equal(state[k].numpy(), weights1[k].numpy()) for k in weights1)


@pytest.mark.redis
def test_the_rollback_command_reads_and_writes_claim_checked_weights(tmp_path, redis_server_url):  # noqa: F811
    """A run whose versions go by claim check (Redis): ``rlstream rollback`` takes the store from
    REDIS_URL, so it reads the fleet's architecture (relu, not the ppo default tanh) from the
    newest version's claim-checked weights, and publishes the new version by claim check too
    (weights over ``claim_check_above``)."""
    log = tmp_path / "log"
    bus = build_bus(BusConfig(kind="memory", log_dir=str(log)))
    blobs = RedisBlobStore(redis_server_url)
    store = open_store(tmp_path / "snaps", keep_last=None)
    policies, keys = {}, []
    for v in range(3):
        torch.manual_seed(v)
        policies[v] = Policy(3, 2, hidden=(512, 512), activation="relu")  # ~2 MB: over the 1 MiB claim-check size
        pv = make_policy_version(policies[v], policy_id="policy", version=v, parent_version=v - 1 if v else None,
                                 learner_id="L", algo="ppo", blob_store=blobs, claim_check_above=0)
        keys.append(pv.weights_ref.key)
        publish_policy_version(build_events(bus, None), pv)
        store.save(v, policies[v].state_dict(), {"algo": "ppo"})  # an old snapshot: no "arch" in it
    bus.close()
    try:
        _rollback_by_command(tmp_path, log, store, blobs, policies, keys, redis_server_url)
    finally:
        import redis

        redis.Redis.from_url(redis_server_url).delete(*keys)


def _rollback_by_command(tmp_path, log, store, blobs, policies, keys, redis_url):
    env = {**os.environ, "REDIS_URL": redis_url, "RLSTREAM_BLOB_CACHE": str(tmp_path / "blobs"),
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-m", "rlstream.cli", "rollback", "--log-dir", str(log), "--to", "1",
                        "--snapshot-store", str(store.path), "--metrics-port", "-1"],
                       cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["new_version"] == 3 and result["arch_source"] == "version 2", result
    assert result["arch"]["activation"] == "relu" and result["arch"]["hidden"] == [512, 512]
    bus = build_bus(BusConfig(kind="memory", log_dir=str(log)))
    try:
        records = list(bus.read_all(POLICY_VERSIONS))
    finally:
        bus.close()
    new = Codec().decode(records[-1].value, PolicyVersion)
    assert new.version == 3 and new.parent_version == 1
    assert new.weights is None and new.weights_ref is not None  # published by claim check
    keys.append(new.weights_ref.key)
    assert new.weights_ref.sha256 == result["weights_sha256"]
    state, arch = decode_weights(weights_bytes(new, blobs))
    assert arch["activation"] == "relu"
    assert all(torch.equal(state[k], t) for k, t in policies[1].state_dict().items())


def test_the_rollback_command_takes_an_s3_store_from_its_environment(tmp_path, moto_s3, s3_bucket):  # noqa: F811
    """``RLSTREAM_SNAPSHOT_STORE=s3://bucket/prefix`` and the AWS variables, no ``--snapshot-store``:
    ``rlstream rollback`` reads snapshot K from the S3 server (a real one, moto's server mode),
    publishes it as a new version and pins K there."""
    log = tmp_path / "log"
    bus = build_bus(BusConfig(kind="memory", log_dir=str(log)))
    url = f"s3://{s3_bucket}/runs/r1/snapshots"
    store = open_store(url, keep_last=None, object_store=moto_s3.config())
    policies = {}
    for v in range(3):
        torch.manual_seed(v)
        policies[v] = Policy(3, 2, hidden=(16, 16), activation="relu")
        pv = make_policy_version(policies[v], policy_id="policy", version=v, parent_version=v - 1 if v else None,
                                 learner_id="L", algo="ppo")
        publish_policy_version(build_events(bus, None), pv)
        store.save(v, policies[v].state_dict(), {"algo": "ppo", "arch": arch_of(policies[v])})
    bus.close()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("AWS_") and k not in ("REDIS_URL", "RLSTREAM_SNAPSHOT_STORE")}
    # AWS_ENDPOINT_URL_S3, a dead local port, is the endpoint the SDK would pick by itself (over
    # AWS_ENDPOINT_URL): the server is reached only if rlstream read AWS_ENDPOINT_URL and passed it
    # on (config.storage), and nothing ever leaves this machine.
    env.update(moto_s3.env(), RLSTREAM_SNAPSHOT_STORE=url, AWS_EC2_METADATA_DISABLED="true",
               AWS_ENDPOINT_URL_S3=f"http://127.0.0.1:{free_port()}",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cwd = tmp_path / "elsewhere"  # no runs/latest/snapshots here: the store can only come from the variable
    cwd.mkdir()
    p = subprocess.run([sys.executable, "-m", "rlstream.cli", "rollback", "--log-dir", str(log), "--to", "1",
                        "--metrics-port", "-1"], cwd=str(cwd), env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert (result["new_version"], result["from_snapshot"], result["previous_version"]) == (3, 1, 2)
    bus = build_bus(BusConfig(kind="memory", log_dir=str(log)))
    try:
        new = Codec().decode(list(bus.read_all(POLICY_VERSIONS))[-1].value, PolicyVersion)
    finally:
        bus.close()
    assert (new.version, new.parent_version) == (3, 1)
    state, _ = decode_weights(new.weights)
    assert all(torch.equal(state[k], t) for k, t in policies[1].state_dict().items())
    assert not all(torch.equal(state[k], t) for k, t in policies[2].state_dict().items())
    assert store.pinned() == {1}  # pinned in the S3 store the variable named
    p = subprocess.run([sys.executable, "-m", "rlstream.cli", "rollback", "--log-dir", str(log), "--to", "7",
                        "--metrics-port", "-1"], cwd=str(cwd), env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and f"no snapshot of version 7 in {url}; snapshots there: 0, 1, 2" in p.stderr
