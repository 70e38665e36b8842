"""Shared fixtures: a Kafka broker for the session, and ``bus`` run over every backend.

``kafka_bootstrap`` finds a broker, in this order: env ``KAFKA_BROKERS``; a Kafka already
answering on 127.0.0.1:9092 (``rlstream broker start``); testcontainers' Kafka where a Docker
engine answers; a ``localkafka.broker.LocalKafka`` started on free ports for this session.
None of these -> the kafka tests fail when ``CI=true``, else they are skipped with the reasons.

``bus`` is parametrised over ``memory`` and ``kafka`` (marked ``kafka``): a contract test
takes ``bus`` and ``new_topic`` and runs against both. Topic names carry a uuid, so tests
never see each other's records on the shared broker.

Tests that need the fixed ``streams.topics`` names (the Faust worker, the decoupled roles)
take ``rl_topics``. They run on ``rl_kafka``, a broker of this session's own (a
``LocalKafka`` on free ports, started once, ~3 s), never on the shared one: other sessions
(and people's decoupled runs) use the same names there. ``rl_topics`` deletes every ``rl.*``
topic and the roles' consumer groups and creates the topics afresh, before the test and again
after it, so no test sees another's records, offsets or policy versions. Such tests also use
their own ``policy_id``, which the processors and the learner follow exclusively. Where no
private broker can start (no java), ``rl_kafka`` falls back to ``kafka_bootstrap`` -- the resets
then wipe the ``rl.*`` topics of that broker.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid

import pytest

from streams.topics import TopicSpec
from tests.support.ports import free_port_pair

# Group joins dominate Kafka test time: heartbeat often so a rebalance is noticed in ~0.5 s.
# 6000 ms is the broker's group.min.session.timeout.ms.
TEST_CONSUMER_CONFIG = {"heartbeat.interval.ms": 500, "session.timeout.ms": 6000}
# Every test topic allows 16 MiB records, also on a broker left at the 1 MiB default.
TEST_TOPIC_CONFIG = {"max.message.bytes": str(16 * 1024 * 1024)}


def _docker_kafka(reasons: list[str]):
    """A started testcontainers KafkaContainer, or None (reason appended)."""
    try:
        import docker
        from testcontainers.community.kafka import KafkaContainer
    except ImportError as e:
        reasons.append(f"testcontainers not installed ({e.name})")
        return None
    try:
        docker.from_env(timeout=3).ping()
    except Exception as e:  # docker raises several types when no engine answers
        reasons.append(f"no Docker engine ({type(e).__name__})")
        return None
    image = os.environ.get("RLSTREAM_TEST_KAFKA_IMAGE", "confluentinc/cp-kafka:7.9.0")  # Kafka 3.9
    try:
        container = KafkaContainer(image).with_kraft()
        for k, v in {"KAFKA_MESSAGE_MAX_BYTES": "16777216", "KAFKA_REPLICA_FETCH_MAX_BYTES": "16777216",
                     "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
                     "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1"}.items():
            container.with_env(k, v)
        return container.start(timeout=180)
    except Exception as e:
        reasons.append(f"testcontainers Kafka {image} did not start: {e}")
        return None


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory):
    """Bootstrap servers of a running Kafka for this session (see the module docstring)."""
    env = os.environ.get("KAFKA_BROKERS")
    if env:
        yield env
        return
    from localkafka.broker import BrokerError, LocalKafka, probe

    reasons = ["KAFKA_BROKERS unset"]
    p = probe("127.0.0.1", 9092, timeout=2.0)
    if p["ready"]:
        yield "127.0.0.1:9092"
        return
    reasons.append(f"no Kafka on 127.0.0.1:9092 ({p['error']})")
    container = _docker_kafka(reasons)
    if container is not None:
        try:
            yield container.get_bootstrap_server()
        finally:
            container.stop()
        return
    kafka = None
    try:
        kafka = LocalKafka(port=free_port_pair(), data_dir=tmp_path_factory.mktemp("kafka"), quiet=True)
        kafka.start(timeout=240)
    except (BrokerError, OSError, RuntimeError) as e:
        reasons.append(f"LocalKafka did not start: {str(e).splitlines()[0]}")
        if kafka is not None:
            with contextlib.suppress(Exception):
                kafka.stop()
        kafka = None
    if kafka is not None:
        try:
            yield kafka.bootstrap
        finally:
            kafka.stop()
        return
    msg = "no Kafka broker for the kafka tests: " + "; ".join(reasons)
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture(params=["memory", "memory-files", pytest.param("kafka", marks=pytest.mark.kafka)])
def bus(request):
    """A fresh bus of each backend (the Kafka one on the session broker; ``memory-files`` is the
    in-memory bus that also keeps its log in files, as co-located runs do)."""
    if request.param == "memory":
        from streams.bus.memory import MemoryBus

        b = MemoryBus()
    elif request.param == "memory-files":
        from streams.bus.memory import MemoryBus

        b = MemoryBus(path=request.getfixturevalue("tmp_path") / "log")
    else:
        from streams.bus.kafka import KafkaBus

        b = KafkaBus(request.getfixturevalue("kafka_bootstrap"), client_id="rlstream-test",
                     consumer_config=TEST_CONSUMER_CONFIG)
    yield b
    b.close()


@pytest.fixture
def new_topic(bus, request):
    """``new_topic(partitions=1, config=None, tag="t", create=True) -> name``: a topic unique to
    this test (``create=False``: only the name, deleted after the test like the others)."""
    stem = re.sub(r"[^a-zA-Z0-9]+", "-", request.node.originalname)[:60].strip("-")

    made: list[str] = []

    def make(partitions: int = 1, config: dict | None = None, tag: str = "t", create: bool = True) -> str:
        name = f"{tag}-{stem}-{uuid.uuid4().hex[:10]}"
        if create:
            bus.create_topics([TopicSpec(name, key="test", partitions=partitions,
                                         config={**TEST_TOPIC_CONFIG, **(config or {})})])
        made.append(name)
        return name

    yield make
    delete = getattr(bus, "delete_topics", None)  # keep the shared broker clean
    if delete is not None and made:
        from streams.bus.kafka import KafkaBus

        with KafkaBus(bus.bootstrap, client_id="rlstream-test-cleanup") as admin:
            admin.delete_topics(made)


#: Consumer groups of the roles on the fixed topics (the Faust worker / stream processors and
#: the learner), whose committed offsets ``rl_topics`` removes with the topics.
ROLE_GROUPS = ("rlstream-streams", "learner")


@pytest.fixture(scope="session")
def rl_kafka(request, tmp_path_factory):
    """Bootstrap servers of a broker private to this session, for the tests on the fixed topic
    names (see the module docstring)."""
    from localkafka.broker import BrokerError, LocalKafka

    kafka = None
    try:
        kafka = LocalKafka(port=free_port_pair(), data_dir=tmp_path_factory.mktemp("rl-kafka"), quiet=True,
                           heap=("-Xms128m", "-Xmx512m"))
        kafka.start(timeout=180)
    except (BrokerError, OSError, RuntimeError) as e:
        if kafka is not None:
            with contextlib.suppress(Exception):
                kafka.kill()
        import warnings

        warnings.warn(f"no private Kafka for the fixed-topic tests ({str(e).splitlines()[0]}); "
                      "using the session broker, whose rl.* topics they reset")
        yield request.getfixturevalue("kafka_bootstrap")
        return
    try:
        yield kafka.bootstrap
    finally:
        kafka.kill()  # its data dir is thrown away


@pytest.fixture
def rl_topics(rl_kafka):
    """Fresh, empty ``rl.*`` topics and no role group offsets on ``rl_kafka``, before and after
    the test (see the module docstring); yields the bootstrap servers."""
    from streams.bus.kafka import KafkaBus
    from streams.topics import all_topics

    def reset() -> None:
        with KafkaBus(rl_kafka, client_id="rlstream-test-reset") as admin:
            admin.reset_topics(all_topics(), groups=ROLE_GROUPS)

    reset()
    yield rl_kafka
    reset()
