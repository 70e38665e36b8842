"""``faust -A streams worker`` as a subprocess against a real Kafka broker.

Uses the ``rl_topics`` fixture of tests/conftest.py: the fixed topics of streams/topics.py,
emptied before and after the test, so nothing of another test is there. The worker follows
this test's own policy id (``RLSTREAM_POLICY_ID``); a version of another policy, numbered far
above ours, is published first and must be ignored.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from schemas.codec import Codec
from schemas.events import DeadLetter, PolicyVersion, PreparedBatch, SampleBatch, now_ms
from schemas.weights import encode_weights
from streams.topics import DEADLETTER, POLICY_VERSIONS, SAMPLES_PREPARED, SAMPLES_RAW, STREAMS_GROUP
from tests.support import free_port, http_json, wait_for
from tests.support.kafka import GroupGenerations, committed, end_offsets, handed_again_at_most, lag, leaders_ready

pytestmark = pytest.mark.kafka
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[2]
CODEC = Codec()
T, N, OBS, ACT = 8, 2, 3, 2


@pytest.fixture
def bootstrap(rl_topics) -> str:
    return rl_topics


def make_batch(actor: str, seq: int, version: int, batch_id: str | None = None) -> SampleBatch:
    rng = np.random.default_rng(seq)
    return SampleBatch(
        batch_id=batch_id or f"{actor}-{seq}", actor_id=actor, seq=seq, env_id="Test-v0",
        policy_version=version, created_at_ms=now_ms(),
        obs=rng.standard_normal((T, N, OBS)).astype(np.float32),
        actions=rng.standard_normal((T, N, ACT)).astype(np.float32),
        rewards=np.zeros((T, N), np.float32), terminated=np.zeros((T, N), bool),
        truncated=np.zeros((T, N), bool), behaviour_logp=np.full((T, N), -3.0, np.float32),
        last_obs=np.zeros((N, OBS), np.float32), final_obs_index=np.zeros((0,), np.int64),
        final_obs=np.zeros((0, OBS), np.float32),
    )


def policy_version(version: int, policy_id: str) -> PolicyVersion:
    from agents.networks import Policy

    torch.manual_seed(0)
    p = Policy(OBS, ACT, hidden=(8,))
    w = encode_weights(p.state_dict(), {"obs_dim": OBS, "act_dim": ACT, "hidden": [8]})
    return PolicyVersion(policy_id, version, now_ms(), "test", "ppo", weights=w)


def test_faust_worker_end_to_end(bootstrap, tmp_path):
    from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

    run = uuid.uuid4().hex[:10]
    actor = f"{run}-a"
    policy_id = f"test-{run}"
    version = 10
    port = free_port()

    # where the outputs start now (a topic just created has no leader for a moment)
    leaders_ready(bootstrap, [SAMPLES_PREPARED, DEADLETTER, POLICY_VERSIONS, SAMPLES_RAW])
    start = {t: end_offsets(bootstrap, t)[0] for t in (SAMPLES_PREPARED, DEADLETTER)}
    raw_start = sum(end_offsets(bootstrap, SAMPLES_RAW).values())
    generations = GroupGenerations(bootstrap, STREAMS_GROUP)  # the worker's group, from the broker

    env = {**os.environ, "KAFKA_BROKERS": bootstrap, "RLSTREAM_METRICS_PORT": str(port),
           "RLSTREAM_POLICY_ID": policy_id, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log_path = tmp_path / "faust.log"
    logf = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "faust", "-A", "streams", "--datadir", str(tmp_path / "data"),
                             "worker", "-l", "info", "--web-port", str(port)],
                            cwd=str(ROOT), env=env, stdout=logf, stderr=subprocess.STDOUT)
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})

    def send(topic, key, ev_or_bytes):
        if isinstance(ev_or_bytes, bytes):
            producer.produce(topic, ev_or_bytes, key=key)
        else:
            producer.produce(topic, CODEC.encode(ev_or_bytes), key=key,
                             headers=list(CODEC.headers_for(ev_or_bytes).items()))

    try:
        send(POLICY_VERSIONS, policy_id.encode(), policy_version(version, policy_id))
        send(POLICY_VERSIONS, b"other", policy_version(10**15, "someone-else"))  # not ours, after ours: read and ignored
        producer.flush(30)
        def follows_our_version() -> bool:  # ready once the worker follows our policy version
            assert proc.poll() is None, log_path.read_text()[-5000:]
            return http_json(f"http://127.0.0.1:{port}/healthz")["stats"]["latest_version"] == version

        wait_for(follows_our_version, 120, "the worker to see the policy version", every=0.5,
                 ignore=(OSError, ValueError, KeyError), on_timeout=lambda: log_path.read_text()[-5000:])
        ready = http_json(f"http://127.0.0.1:{port}/readyz")  # 503 (an error here) until caught up
        assert ready["ok"] and ready["checks"]["policies_caught_up"]

        for s in [0, 2, 1, 3, 4, 5]:  # 1 and 2 swapped
            send(SAMPLES_RAW, actor.encode(), make_batch(actor, s, version))
        send(SAMPLES_RAW, actor.encode(), make_batch(actor, 3, version))  # duplicate
        send(SAMPLES_RAW, actor.encode(), make_batch(actor, 6, version - 1))  # off-policy: IS computed
        send(SAMPLES_RAW, actor.encode(), make_batch(actor, 7, version - 10))  # stale by versions
        send(SAMPLES_RAW, f"{run}-g".encode(), b"\x00\x01 garbage")
        producer.flush(30)

        # "nothing more arrives": once the worker's group has committed every raw record (it acks
        # a record only after its output is delivered), the outputs end where they end now
        wait_for(lambda: lag(bootstrap, "rlstream-streams", SAMPLES_RAW) == 0, 120,
                 "the worker to commit every raw record", every=0.5, ignore=(KafkaException,),
                 on_timeout=lambda: log_path.read_text()[-5000:])
        ends = {t: end_offsets(bootstrap, t)[0] for t in start}
        c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{run}", "enable.auto.commit": False})
        c.assign([TopicPartition(t, 0, o) for t, o in start.items()])
        prepared, dead, seen = [], [], {t: start[t] for t in start}

        def read_to_the_ends() -> bool:
            while (m := c.poll(0.2)) is not None:
                if m.error():
                    continue
                seen[m.topic()] = m.offset() + 1
                if m.topic() == SAMPLES_PREPARED:
                    pb = CODEC.decode(m.value(), PreparedBatch)
                    if pb.sample.actor_id == actor:
                        prepared.append(pb)
                elif m.key() and m.key().startswith(run.encode()):
                    dead.append(CODEC.decode(m.value(), DeadLetter))
            return all(seen[t] >= ends[t] for t in ends)

        wait_for(read_to_the_ends, 60, f"the outputs up to their end offsets {ends}")
        c.close()

        log_tail = log_path.read_text()[-5000:]
        assert [p.sample.seq for p in prepared] == list(range(7)), log_tail
        # one dead letter per bad source record; a record handed to the worker again (at least
        # once: a starved worker is rebalanced out and back) is dead-lettered again, at its offset
        by_source = {(d.partition, d.offset): d.reason for d in dead}
        assert sorted(by_source.values()) == ["corrupt", "stale_versions"], log_tail
        assert all(by_source[(d.partition, d.offset)] == d.reason for d in dead)
        off = prepared[6]
        assert off.staleness_versions == 1 and off.current_version == version
        assert not np.allclose(off.is_rho, 1.0) and (off.is_rho <= 1.0).all()
        assert all((p.is_rho == 1.0).all() for p in prepared[:6])
        stats = http_json(f"http://127.0.0.1:{port}/healthz")["stats"]
        # a sample batch handed again is dropped as a duplicate (its seq is behind), and only so;
        # handed again only by a reassignment the broker recorded or a seek back the worker logged,
        # each at most once per record of ours on the topic (10, read from its end offsets)
        again = stats["received_batches"] - 9  # 0..7 and the duplicate of 3
        raw_records = sum(end_offsets(bootstrap, SAMPLES_RAW).values()) - raw_start
        moves = (generations.reassignments(), log_path.read_text().count("seeking back to"))
        assert raw_records == 10 and 0 <= again <= handed_again_at_most(*moves, raw_records), (again, moves)
        corrupt_copies = sum(d.reason == "corrupt" for d in dead)
        assert 1 <= corrupt_copies <= 1 + handed_again_at_most(*moves, 1), (corrupt_copies, moves)
        assert stats["drops"] == {"duplicate": 1 + again, "stale_versions": 1, "corrupt": corrupt_copies}
        assert stats["policy_ignored"] == 1 and stats["latest_version"] == version
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
        assert 'rlstream_drops_total{reason="duplicate",role="streams"}' in metrics
    finally:
        producer.flush(10)
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            pytest.fail("faust worker did not stop within 60 s of SIGTERM:\n" + log_path.read_text()[-5000:])
        finally:
            logf.close()
    assert rc == 0, log_path.read_text()[-5000:]
    assert "Traceback" not in log_path.read_text(), log_path.read_text()[-5000:]
    # every raw record was handled and acked, so the group committed up to the end (read with a
    # plain confluent_kafka Consumer of that group, not through our bus)
    assert committed(bootstrap, "rlstream-streams", SAMPLES_RAW) == end_offsets(bootstrap, SAMPLES_RAW)


def test_a_record_held_for_reordering_is_not_committed_past(kafka_bootstrap, tmp_path):
    """Actor a's seq 2 waits (its seq 1 is missing) at the head of the partition while the
    records after it are prepared and acked. Faust commits the first run of acked offsets
    above the committed one (off by one at its head), so without in-order acks a stopped
    worker committed past the held record and a new worker never saw it: a was lost from seq 2.
    Here the committed offset stays at the held record, and after a restart every record is
    prepared exactly once (a's seq 2 once its seq 1 arrives; b's records are duplicates)."""
    from tests.streams.shells import open_shell
    from tests.streams.test_shell_scenarios import make_batch as scenario_batch
    from tests.streams.test_shell_scenarios import policy_version as scenario_policy

    run = uuid.uuid4().hex[:8]
    pid = f"policy-{run}"
    env = {"RLSTREAM_ALGO": "ppo", "RLSTREAM_STALENESS_K": "1000000", "RLSTREAM_STALENESS_MS": "none",
           "RLSTREAM_POLICY_ID": pid, "RLSTREAM_REORDER_TIMEOUT_MS": "600000"}
    a, b = f"{run}-a", f"{run}-b"
    with open_shell("faust", env, tmp_path, lambda: kafka_bootstrap, raw_partitions=1) as shell:
        bus = shell.bus
        group, raw_topic = bus.ns.group(STREAMS_GROUP), bus.ns.topic(SAMPLES_RAW)
        bus.produce(POLICY_VERSIONS, CODEC.encode(scenario_policy(pid, 0)), key=pid.encode())
        bus.flush()
        first = shell.start()
        shell.follows(0)

        def produce(actor: str, seq: int) -> None:
            bus.produce(SAMPLES_RAW, CODEC.encode(scenario_batch(actor, seq, 0, now_ms())), key=actor.encode())
            bus.flush()

        for actor, seq in [(a, 0), (a, 2), (b, 0), (b, 1)]:  # offsets 0..3; offset 1 waits for a's seq 1
            produce(actor, seq)

        def prepared() -> list[str]:
            return [CODEC.decode(r.value, PreparedBatch).sample.batch_id for r in bus.read_all(SAMPLES_PREPARED)]

        wait_for(lambda: sorted(prepared()) == sorted([f"{a}-0", f"{b}-0", f"{b}-1"])
                 and shell.stats(0)["reorder"]["buffered"] == 1, 120,
                 "b's records prepared past a's held seq 2", every=0.2, on_timeout=shell.logs)
        first.stop(60)  # a graceful stop commits every offset acked
        assert committed(kafka_bootstrap, group, raw_topic) == {0: 1}, "committed past the held record"

        shell.start()
        shell.follows(0)
        produce(a, 1)
        shell.settle()
        wait_for(lambda: len(prepared()) >= 5, 60, "a's seq 1 and 2 prepared", every=0.2, on_timeout=shell.logs)
        assert sorted(prepared()) == sorted(f"{x}-{s}" for x, s in [(a, 0), (a, 1), (a, 2), (b, 0), (b, 1)])
        assert shell.stats(1)["drops"].get("duplicate", 0) >= 2  # b's records, known by the moved state
