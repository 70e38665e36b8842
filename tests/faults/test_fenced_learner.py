"""A learner's late writes are fenced (issue 39): its bus writes in transactions under a stable
identity (run namespace, group, policy, rank), so once a newer learner of that identity has
started, nothing the older one sends reaches a reader: neither a write it had in flight (a killed
process's socket buffer, delivered later) nor one it makes afterwards, which also fails it with
``WriterFencedError``. Readers (``KafkaBus`` consumers, the policy tail) read committed only."""

from __future__ import annotations

import pytest
from confluent_kafka import Consumer, TopicPartition

from config import BusConfig
from schemas.codec import Codec
from schemas.events import PolicyVersion
from streams.bus import open_bus
from streams.bus.base import WriterFencedError
from streams.events import EventBus
from streams.policy.publish import publish_policy_version
from streams.policy.tail import newest_version
from streams.topics import LEARNER_STEPS, POLICY_VERSIONS, Namespace
from testbed.wait import wait_for

NS = "fence"
WRITER = "learner.policy.rank0"  # what rlstream.processes.run_learner names rank 0 of the default group


def _version(v: int, learner: str) -> PolicyVersion:
    return PolicyVersion(policy_id="policy", version=v, created_at_ms=v, learner_id=learner, algo="ppo",
                         weights=b"w" * 16)


def _log_uncommitted(bootstrap: str, topic: str, codec: Codec) -> list[tuple[int, str]]:
    """(version, learner) of every record the log holds, committed or not (read_uncommitted)."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "fence-probe", "enable.auto.commit": False,
                  "isolation.level": "read_uncommitted", "enable.partition.eof": True})
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        c.assign([TopicPartition(topic, p, 0) for p in parts])
        out, eof = [], set()
        while len(eof) < len(parts):
            m = c.poll(5.0)
            assert m is not None, "no end of the log within 5 s"
            if m.error():
                eof.add(m.partition())
                continue
            pv = codec.decode(m.value())
            out.append((pv.version, pv.learner_id))
        return out
    finally:
        c.close()


@pytest.mark.timeout(180)
def test_a_newer_learner_fences_the_older_ones_writes(private_kafka):
    codec = Codec()
    cfg = BusConfig(kind="kafka", bootstrap=private_kafka.bootstrap, namespace=NS)
    topic = Namespace(NS).topic(POLICY_VERSIONS)
    zombie = EventBus(open_bus(cfg, writer=WRITER), codec)
    newer = reader = None
    try:
        for v in (0, 1):
            publish_policy_version(zombie, _version(v, "zombie"))  # committed: every reader sees them
        # version 2 reaches the broker but its transaction is never committed (the first learner
        # is cut off and killed before its commit; its socket delivers the record after all)
        zombie.bus.produce(POLICY_VERSIONS, codec.encode(_version(2, "zombie")), key=b"policy")
        wait_for(lambda: (2, "zombie") in _log_uncommitted(private_kafka.bootstrap, topic, codec), 30,
                 "the zombie's version 2 in the log", every=0.2)

        newer = EventBus(open_bus(cfg, writer=WRITER), codec)  # the restarted learner: same identity
        for v in (2, 3):
            publish_policy_version(newer, _version(v, "newer"))
        newer.bus.produce(LEARNER_STEPS, b"step of 3", key=b"newer")  # its other topic
        newer.flush()

        # a write of the zombie after the newer learner started: refused, and the zombie told why
        with pytest.raises(WriterFencedError, match="newer writer"):
            publish_policy_version(zombie, _version(4, "zombie"))

        reader = EventBus(open_bus(BusConfig(kind="kafka", bootstrap=private_kafka.bootstrap, namespace=NS)), codec)
        seen = [(pv.version, pv.learner_id) for pv in map(codec.decode, (r.value for r in
                                                                        reader.bus.read_all(POLICY_VERSIONS)))]
        assert seen == [(0, "zombie"), (1, "zombie"), (2, "newer"), (3, "newer")]
        newest = newest_version(reader)  # the tail reader: back from the end, past the commit markers
        assert (newest.version, newest.learner_id) == (3, "newer")
        assert [r.value for r in reader.bus.read_all(LEARNER_STEPS)] == [b"step of 3"]
        # the zombie's version 2 is in the log (aborted), its version 4 never got there
        uncommitted = _log_uncommitted(private_kafka.bootstrap, topic, codec)
        assert (2, "zombie") in uncommitted and (4, "zombie") not in uncommitted
    finally:
        zombie.bus.close()  # fenced: nothing to flush, and no error
        for e in (newer, reader):
            if e is not None:
                e.bus.close()
