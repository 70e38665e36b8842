"""Fragments of 16 different lengths (16..256 steps), as dynamic fragment sizes and early cuts
produce them, through the real roles on a real broker: the stream processors (``PrepareWorker``
under the Faust app's group, in-process) and ``rlstream learner`` (a process).

The test feeds one round at a time: fragments of mixed lengths until the round holds at least
``train_batch_size`` samples. Checked per round: the learner's next GradientStep trains exactly
that round (every record within one update of its arrival, none twice, none left behind).
Checked at the end, through plain confluent-kafka clients rather than our bus (the admin
client's ``list_consumer_group_offsets`` and a ``Consumer``'s ``committed()``): every group's
committed offset equals the log-end offset, also past a record the learner dead-lettered.
"""

from __future__ import annotations

import numpy as np
import pytest
from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient

from schemas.codec import Codec
from schemas.events import DeadLetter, SampleBatch, new_id, now_ms
from streams.bus.kafka import KafkaBus
from streams.events import EventBus
from streams.topics import DEADLETTER, LEARNER_STEPS, SAMPLES_PREPARED, SAMPLES_RAW

from .conftest import STREAMS_GROUP, Rig, TopicCounter, wait_for

pytestmark = pytest.mark.kafka
CODEC = Codec()
LENGTHS = [16, 256, 48, 112, 32, 200, 64, 144, 24, 96, 176, 40, 128, 232, 80, 160]  # 16 lengths
TRAIN_BATCH = 512
ROUNDS = 6
ACTOR = "actor-mixed"


def fragment(seq: int, steps: int, version: int, rng: np.random.Generator) -> SampleBatch:
    """A one-env Pendulum fragment of ``steps`` steps; some end an episode by termination or
    truncation (a truncation carries its final observation)."""
    term, trunc = np.zeros((steps, 1), bool), np.zeros((steps, 1), bool)
    if seq % 3 == 1:
        term[steps // 2, 0] = True
    elif seq % 3 == 2:
        trunc[steps - 1, 0] = True
    t_idx = np.nonzero(trunc[:, 0])[0]
    return SampleBatch(
        batch_id=new_id(), actor_id=ACTOR, seq=seq, env_id="Pendulum-v1", policy_version=version,
        created_at_ms=now_ms(), obs=rng.normal(size=(steps, 1, 3)).astype(np.float32),
        actions=rng.normal(size=(steps, 1, 1)).astype(np.float32),
        rewards=rng.normal(size=(steps, 1)).astype(np.float32), terminated=term, truncated=trunc,
        behaviour_logp=np.full((steps, 1), -1.0, np.float32), last_obs=rng.normal(size=(1, 3)).astype(np.float32),
        final_obs_index=t_idx.astype(np.int64), final_obs=rng.normal(size=(len(t_idx), 3)).astype(np.float32),
    )


def offsets(bootstrap: str, group: str, topic: str) -> dict[str, dict[int, int]]:
    """Per partition of ``topic``, read with plain clients: the group's offsets as the admin
    client lists them, as a consumer of the group sees them (``committed()``), and the log-end
    offsets (high watermarks)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    parts = sorted(admin.list_topics(topic, timeout=10).topics[topic].partitions)
    tps = [TopicPartition(topic, p) for p in parts]
    res = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group, tps)])[group].result(timeout=10)
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        return {"listed": {tp.partition: tp.offset for tp in res.topic_partitions},
                "committed": {tp.partition: tp.offset for tp in c.committed(tps, timeout=10)},
                "log_end": {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in parts}}
    finally:
        c.close()


def at_log_end(bootstrap: str, group: str, topic: str) -> bool:
    o = offsets(bootstrap, group, topic)
    return o["listed"] == o["committed"] == o["log_end"] and sum(o["log_end"].values()) > 0


def test_mixed_lengths_train_within_one_update_and_groups_commit_to_the_log_end(private_kafka, tmp_path):
    bootstrap = private_kafka.bootstrap
    rig = Rig(bootstrap, tmp_path, snapshot_every=2, train_batch_size=TRAIN_BATCH)
    steps = TopicCounter(bootstrap, LEARNER_STEPS, CODEC.decode)
    bus = KafkaBus(bootstrap, client_id="mixed-lengths-actor")
    events = EventBus(bus, CODEC)
    rng = np.random.default_rng(0)
    try:
        rig.start_faust()
        learner = rig.learner()
        seq, lengths_seen = 0, set()
        for k in range(ROUNDS):
            # version k is the learner's newest once update k is out (the processors allow any lag)
            sent, size = [], 0
            while size < TRAIN_BATCH:
                n = LENGTHS[seq % len(LENGTHS)]
                sb = fragment(seq, n, version=k, rng=rng)
                events.publish(SAMPLES_RAW, sb, key=ACTOR)
                sent.append(sb.batch_id)
                lengths_seen.add(n)
                size += n
                seq += 1
            events.flush()
            wait_for(lambda k=k: steps.poll() >= k + 1, 180, f"update {k + 1}", on_timeout=rig.logs)
            step = steps.items[k]
            assert sorted(step.batch_ids) == sorted(sent), f"update {k + 1} did not train exactly round {k}"
            assert step.num_samples == size >= TRAIN_BATCH
            assert len(steps.items) == k + 1, "an update ran on a partial round"
        assert lengths_seen == set(LENGTHS)
        trained = [b for s in steps.items for b in s.batch_ids]
        assert len(trained) == len(set(trained)) == seq
        # a bad record after the last update: the learner dead-letters it and commits past it
        bus.produce(SAMPLES_PREPARED, b"not an event", key=ACTOR.encode())
        bus.flush()
        for group, topic in (("learner", SAMPLES_PREPARED), (STREAMS_GROUP, SAMPLES_RAW)):
            wait_for(lambda g=group, t=topic: at_log_end(bootstrap, g, t), 120,
                     f"{group}'s committed offset on {topic} at the log end", on_timeout=rig.logs)
        summary = learner.stop()
        assert summary.get("updates") == ROUNDS, summary
        assert rig.streams.errors == []
        assert rig.streams.stop() != {}, rig.logs()  # a clean stop prints the processors' summary
        # after both roles stopped, the groups still stand at the log end
        for group, topic in (("learner", SAMPLES_PREPARED), (STREAMS_GROUP, SAMPLES_RAW)):
            o = offsets(bootstrap, group, topic)
            assert o["listed"] == o["committed"] == o["log_end"], f"{group} on {topic}: {o}"
        dead = [CODEC.decode(r.value) for r in bus.read_all(DEADLETTER)]
        assert [(d.topic, d.stage) for d in dead if isinstance(d, DeadLetter)] == [(SAMPLES_PREPARED, "learner")]
    finally:
        rig.close()
        steps.close()
        bus.close()
