"""The three processor shells are assembled in one place (``rlstream.wiring``) and so agree:
the in-process worker, ``python -m rlstream.entry worker`` and ``faust -A streams worker``, each
configured only through the environment, on a real broker and a real Redis.

One scenario: the policy versions go by claim check (weights in Redis, the record carries a
key and sha256), and after the shell has started a newer writer publishes SampleBatch v2
(``tests/schemas/avsc_v2``: a ``priority`` field the shells were not built with) on the schema
topic and writes with it. Every shell must weight the batches against the claim-checked policy
(no ``importance_unavailable``) and read the v2 records (no ``unknown_schema``), giving the same
prepared outputs as a bare ``Prepare`` fed the same batches.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

import schemas.codec as codec_mod
from agents.networks import Policy
from config import Environment, PrepareConfig
from schemas.codec import Codec, SchemaTopic
from schemas.events import DeadLetter, PreparedBatch, SampleBatch
from schemas.registry import SchemaRegistry
from streams.policies import PolicyLogpFn, RedisBlobStore, make_policy_version
from streams.processors.pipeline import Prepare
from streams.topics import DEADLETTER, POLICY_VERSIONS, SAMPLES_PREPARED, SAMPLES_RAW, SCHEMAS, STREAMS_GROUP
from tests.ops.conftest import redis_server_url  # noqa: F401  (fixture)
from tests.streams.test_shell_scenarios import essence, make_batch
from tests.support import Procs, free_port, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.redis]

ROOT = Path(__file__).resolve().parents[2]
V2_DIR = ROOT / "tests" / "schemas" / "avsc_v2"
OBS, ACT = 3, 2
SHELLS = ("inproc", "worker-process", "faust")


@dataclasses.dataclass(frozen=True)
class SampleBatchV2(SampleBatch):
    """A newer writer's SampleBatch (v2 adds ``priority``)."""

    priority: float = 0.0


def policy(version: int) -> Policy:
    torch.manual_seed(version)
    return Policy(OBS, ACT, hidden=(8,))


def scenario(run: str, store: RedisBlobStore):
    """(claim-checked policy versions 0..3, v1 raw batches, v2 raw batches) of policy ``p-<run>``."""
    pid = f"p-{run}"
    versions = [make_policy_version(policy(v), policy_id=pid, version=v, parent_version=v - 1 if v else None,
                                    learner_id="test", algo="ppo", blob_store=store, claim_check_above=0)
                for v in range(4)]
    assert all(pv.weights is None and pv.weights_ref is not None for pv in versions)  # by claim check
    t = versions[-1].created_at_ms
    a, b = f"{run}-a", f"{run}-b"
    v1 = [make_batch(a, 0, 3, t), make_batch(a, 1, 2, t), make_batch(b, 0, 3, t)]
    v2 = [SampleBatchV2(**{f.name: getattr(make_batch(b, s, 3, t), f.name) for f in dataclasses.fields(SampleBatch)},
                        priority=0.5 + s) for s in (1, 2)]
    return pid, versions, v1, v2


def reference(prepare_cfg: PrepareConfig, versions, batches) -> list[PreparedBatch]:
    """A bare ``Prepare`` over the same decoded inputs, the weights handed over directly."""
    logp = {pv.version: PolicyLogpFn(policy(pv.version)) for pv in versions}
    prepare = Prepare.from_config(prepare_cfg, lambda pv: logp[pv.version])
    for pv in versions[-(prepare_cfg.max_versions + 1):]:
        prepare.on_policy(pv)
    out = []
    for offset, batch in enumerate(batches):
        out += [o for o in prepare.push(batch, 0, offset) if isinstance(o, PreparedBatch)]
    return out


@pytest.mark.parametrize("shell", SHELLS)
def test_every_shell_weights_claim_checked_policies_and_reads_a_schema_added_after_start(
        shell, tmp_path, kafka_bootstrap, redis_server_url, monkeypatch):  # noqa: F811
    from rlstream.wiring import build_bus, build_streams_worker
    from config import BusConfig
    from streams.settings import StreamsSettings

    run = uuid.uuid4().hex[:8]
    store = RedisBlobStore(redis_server_url)
    pid, versions, v1, v2 = scenario(run, store)
    ns = f"parity{run}"
    env = {"KAFKA_BROKERS": kafka_bootstrap, "RLSTREAM_NAMESPACE": ns, "REDIS_URL": redis_server_url,
           "RLSTREAM_BLOB_CACHE": "off", "RLSTREAM_ALGO": "ppo", "RLSTREAM_STALENESS_K": "1",
           "RLSTREAM_STALENESS_MS": "none", "RLSTREAM_POLICY_ID": pid}
    settings = StreamsSettings.from_environment(Environment(env))
    assert settings.redis_url == redis_server_url and settings.prepare.policy_id == pid

    bus = build_bus(BusConfig(kind="kafka", bootstrap=kafka_bootstrap, namespace=ns))  # the test's view
    old = Codec()  # what the shells are built with: SampleBatch v1 only
    for pv in versions:  # before the shell starts: it reads K + 1 back from the end
        bus.produce(POLICY_VERSIONS, old.encode(pv), key=pid.encode())
    bus.flush()

    procs = Procs(tmp_path, {**os.environ, **env, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
                             "OMP_NUM_THREADS": "1", "BROKER_SESSION_TIMEOUT": "6"})
    worker = worker_bus = None
    try:
        if shell == "inproc":
            worker, worker_bus = build_streams_worker(settings)
            step = lambda: worker.step(0.1)  # noqa: E731
        elif shell == "worker-process":
            procs.start(shell, [sys.executable, "-m", "rlstream.entry", "worker"])
            step = lambda: None  # noqa: E731
        else:
            port = free_port()
            procs.start(shell, [sys.executable, "-m", "faust", "-A", "streams", "--datadir", str(tmp_path / "faust"),
                                "worker", "-l", "info", "--web-port", str(port)], {"RLSTREAM_METRICS_PORT": str(port)})
            step = lambda: None  # noqa: E731

        for batch in v1:
            bus.produce(SAMPLES_RAW, old.encode(batch), key=batch.actor_id.encode())
        bus.flush()
        # a newer writer arrives after the shell started: its schemas, then its records
        with monkeypatch.context() as mp:
            mp.setitem(codec_mod.EVENT_TYPES, SampleBatch.AVRO_NAME, SampleBatchV2)
            new = Codec(SchemaRegistry([ROOT / "schemas" / "avsc", V2_DIR]))
            SchemaTopic(bus, SCHEMAS).publish(new.registry)
            for batch in v2:
                bus.produce(SAMPLES_RAW, new.encode(batch), key=batch.actor_id.encode())
        bus.flush()

        total = len(v1) + len(v2)

        def handled() -> bool:
            step()
            assert not procs.dead(), procs.logs()
            return (bus.group_lag(STREAMS_GROUP, SAMPLES_RAW) == 0 and sum(bus.end_offsets(SAMPLES_RAW).values()) == total
                    and sum(bus.end_offsets(SAMPLES_PREPARED).values()) + sum(bus.end_offsets(DEADLETTER).values())
                    >= total)
        wait_for(handled, 240, f"the {shell} shell to handle and commit every raw record", every=0.2,
                 on_timeout=procs.logs)
        prepared = [old.decode(r.value, PreparedBatch) for r in bus.read_all(SAMPLES_PREPARED)]
        dead = [old.decode(r.value, DeadLetter) for r in bus.read_all(DEADLETTER)]
    finally:
        procs.close()
        if worker is not None:
            worker.close()
            worker_bus.close()
        bus.close()

    assert [(d.reason, d.detail[:120]) for d in dead] == []  # neither importance_unavailable nor unknown_schema
    base = [SampleBatch(**{f.name: getattr(b, f.name) for f in dataclasses.fields(SampleBatch)}) for b in v1 + v2]
    want = reference(settings.prepare, versions, base)
    assert len(want) == total
    assert [essence(p) for p in prepared] == [essence(p) for p in want]
    assert any(p.staleness_versions == 1 and not np.allclose(p.is_rho, 1.0) for p in prepared)  # IS against v3
