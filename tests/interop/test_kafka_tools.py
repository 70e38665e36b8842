"""Offsets committed through rlstream's KafkaBus, read back with Kafka's own
``kafka-consumer-groups --describe`` (ConsumerGroupCommand from the kafka-tools jar)."""

from __future__ import annotations

import time
import uuid

import pytest

from localkafka import kafka_tools
from streams.bus.kafka import KafkaBus
from streams.topics import TopicSpec

from .jvm import kafka_tools_ready

pytestmark = pytest.mark.kafka
FAST_GROUP = {"heartbeat.interval.ms": 500, "session.timeout.ms": 6000}  # notice rebalances fast


@pytest.fixture(scope="module")
def tools():
    return kafka_tools_ready()


def test_committed_offsets_read_back_with_consumer_group_command(tools, kafka_bootstrap):
    topic, group = f"t-kafka-tools-{uuid.uuid4().hex[:10]}", f"g-kafka-tools-{uuid.uuid4().hex[:8]}"
    with KafkaBus(kafka_bootstrap, client_id="rlstream-test", consumer_config=FAST_GROUP) as bus:
        bus.create_topics([TopicSpec(topic, key="test", partitions=2)])
        try:
            for p, n in ((0, 7), (1, 5)):
                for i in range(n):
                    bus.produce(topic, f"v{i}".encode(), key=b"k", partition=p)
            bus.flush()
            with bus.consumer(group, [topic]) as c:
                got: list = []
                deadline = time.monotonic() + 60
                while len(got) < 12 and time.monotonic() < deadline:
                    got += c.poll(1.0)
                assert len(got) == 12
                c.commit(offsets={(topic, 0): 7, (topic, 1): 2})
            rows = tools.describe_group(kafka_bootstrap, group)
            print(rows.text)
        finally:
            bus.delete_topics([topic])
    table = {r["PARTITION"]: r for r in rows if r["TOPIC"] == topic}
    assert set(table) == {0, 1}, rows.text
    assert (table[0]["CURRENT-OFFSET"], table[0]["LOG-END-OFFSET"], table[0]["LAG"]) == (7, 7, 0)
    assert (table[1]["CURRENT-OFFSET"], table[1]["LOG-END-OFFSET"], table[1]["LAG"]) == (2, 5, 3)
    assert all(r["GROUP"] == group for r in table.values())


def test_parse_table_reads_the_describe_layout():
    text = ("\nConsumer group 'g' has no active members.\n\n"
            "GROUP TOPIC PARTITION  CURRENT-OFFSET  LOG-END-OFFSET  LAG  CONSUMER-ID HOST CLIENT-ID\n"
            "g     t     0          -               4               -    -           -    -\n")
    assert kafka_tools.parse_table(text) == [{"GROUP": "g", "TOPIC": "t", "PARTITION": 0, "CURRENT-OFFSET": None,
                                              "LOG-END-OFFSET": 4, "LAG": None, "CONSUMER-ID": None,
                                              "HOST": None, "CLIENT-ID": None}]
