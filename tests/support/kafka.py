"""Kafka seen through the plain confluent_kafka client, not through our KafkaBus: partition
leaders, end offsets and a group's committed offsets."""

from __future__ import annotations

from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from testbed.wait import wait_for


def leaders_ready(bootstrap: str, topics, timeout: float = 60.0) -> None:
    """Wait until every partition of ``topics`` has a leader that answers for it (after a create,
    a reset or a broker restart): metadata names one, and its offsets can be read from it."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    c = _consumer(bootstrap, "tests-support-leaders")

    def ready() -> bool:
        md = admin.list_topics(timeout=5)
        for t in topics:
            tm = md.topics.get(t)
            if tm is None or tm.error is not None or not tm.partitions:
                return False
            if any(p.leader < 0 or p.error is not None for p in tm.partitions.values()):
                return False
            for p in tm.partitions:  # the leader may not act as one yet: NOT_LEADER_FOR_PARTITION
                c.get_watermark_offsets(TopicPartition(t, p), timeout=5)
        return True

    try:
        wait_for(ready, timeout, f"partition leaders of {sorted(topics)}", every=0.2, ignore=(KafkaException,))
    finally:
        c.close()


def _consumer(bootstrap: str, group: str) -> Consumer:
    return Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})


def end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    """partition -> high watermark."""
    c = _consumer(bootstrap, "tests-support-offsets")
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        return {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in parts}
    finally:
        c.close()


def committed(bootstrap: str, group: str, topic: str) -> dict[int, int]:
    """partition -> the offset ``group`` committed (negative: none), read with a plain Consumer."""
    c = _consumer(bootstrap, group)
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        got = c.committed([TopicPartition(topic, p) for p in parts], timeout=30)
        return {tp.partition: tp.offset for tp in got}
    finally:
        c.close()


def lag(bootstrap: str, group: str, topic: str) -> int:
    """Records of ``topic`` that ``group`` has not committed yet (a group with no commit lags by all)."""
    ends, done = end_offsets(bootstrap, topic), committed(bootstrap, group, topic)
    return sum(end - max(done.get(p, 0), 0) for p, end in ends.items())
