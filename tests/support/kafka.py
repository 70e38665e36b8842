"""Kafka seen through the plain confluent_kafka client, not through our KafkaBus: partition
leaders, end offsets, a group's committed offsets and its generations."""

from __future__ import annotations

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
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


GROUP_METADATA_TOPIC = "__consumer_offsets"


def _group_metadata(value: bytes) -> tuple[int, int]:
    """(generation, members) of a ``GroupMetadataValue`` record (Kafka's group coordinator
    format): version int16, protocol type, generation int32, protocol, leader, the state's
    timestamp (int64, from version 2), members (an array). Strings and arrays carry an int16 /
    int32 length up to version 3 and an unsigned varint length + 1 from version 4 (flexible)."""
    version = int.from_bytes(value[0:2], "big", signed=True)
    flexible, at = version >= 4, 2

    def uvarint() -> int:
        nonlocal at
        n, shift = 0, 0
        while True:
            b = value[at]
            at += 1
            n |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return n

    def string() -> None:
        nonlocal at
        if flexible:
            at += max(uvarint() - 1, 0)
        else:
            n = int.from_bytes(value[at:at + 2], "big", signed=True)
            at += 2 + max(n, 0)

    string()  # protocol type
    generation = int.from_bytes(value[at:at + 4], "big", signed=True)
    at += 4
    string()  # protocol
    string()  # leader
    if version >= 2:
        at += 8  # current state timestamp
    if flexible:
        members = max(uvarint() - 1, 0)
    else:
        members = max(int.from_bytes(value[at:at + 4], "big", signed=True), 0)
    return generation, members


class GroupGenerations:
    """The generations a consumer group goes through from now on, as its coordinator records
    them in ``__consumer_offsets``: one record per completed rebalance (with its members), and
    one, with none, when the group empties. A record is handed to a member again (from the
    group's last commit) only by a new assignment, a generation with members after the first,
    or by an explicit seek. An independent count, read from the broker, not from the members'
    own counters."""

    def __init__(self, bootstrap: str, group: str) -> None:
        self.bootstrap, self.group = bootstrap, group
        self.start = end_offsets(bootstrap, GROUP_METADATA_TOPIC)

    def seen(self) -> list[tuple[int, int]]:
        """(generation, members) of each record since this was made, in the order of the log."""
        ends = end_offsets(self.bootstrap, GROUP_METADATA_TOPIC)
        c = Consumer({"bootstrap.servers": self.bootstrap, "group.id": "tests-support-generations",
                      "enable.auto.commit": False, "enable.partition.eof": True})
        todo = {p for p in ends if ends[p] > self.start.get(p, 0)}
        out: list[int] = []
        try:
            c.assign([TopicPartition(GROUP_METADATA_TOPIC, p, self.start.get(p, 0)) for p in todo])
            deadline_polls = 600  # 0.1 s each
            while todo and deadline_polls:
                deadline_polls -= 1
                m = c.poll(0.1)
                if m is None:
                    continue
                if m.error():
                    if m.error().code() == KafkaError._PARTITION_EOF:
                        todo.discard(m.partition())
                    continue
                if m.offset() + 1 >= ends[m.partition()]:
                    todo.discard(m.partition())
                key, value = m.key() or b"", m.value()
                if len(key) < 4 or int.from_bytes(key[0:2], "big") != 2 or value is None:
                    continue  # an offset commit (key versions 0 and 1), or a tombstone
                n = int.from_bytes(key[2:4], "big")
                if key[4:4 + n].decode(errors="replace") == self.group:
                    out.append(_group_metadata(value))
            if todo:
                raise AssertionError(f"{GROUP_METADATA_TOPIC} partitions {sorted(todo)} not read to their ends")
        finally:
            c.close()
        return out

    def reassignments(self) -> int:
        """Assignments after the first since this was made: generations with members, less one."""
        return max(len({g for g, members in self.seen() if members > 0}) - 1, 0)


def handed_again_at_most(reassignments: int, seeks: int, records: int) -> int:
    """The most copies of a partition's ``records`` its group's members can be handed a second
    time: each assignment after the first (``GroupGenerations.reassignments``) and each seek back
    re-hands at most every record once. Nothing of either: none."""
    return (reassignments + seeks) * records
