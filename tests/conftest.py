"""Shared fixtures: the suite's Kafka broker, and ``bus`` run over every backend.

Kafka: the suite never uses a broker it was not told to. ``suite_kafka`` is a broker this
session starts itself, on free ports (a ``localkafka.broker.LocalKafka``; where no java can run,
a testcontainers Kafka where a Docker engine answers), and stops at its end. ``kafka_bootstrap``
is that broker, unless ``RLSTREAM_TEST_KAFKA`` (``host:port``) names another one explicitly: the
tests on ``kafka_bootstrap`` only create topics named with a uuid and delete just those. A broker
on 9092 or ``KAFKA_BROKERS`` (a developer's own runs) is never used. No broker -> the kafka
tests fail when ``CI=true``, else they are skipped with the reasons.

``bus`` is parametrised over ``memory`` and ``kafka`` (marked ``kafka``): a contract test
takes ``bus`` and ``new_topic`` and runs against both. Topic names carry a uuid, so tests
never see each other's records.

Tests that need the fixed ``streams.topics`` names (the Faust worker, the decoupled roles)
take ``rl_topics``, on ``rl_kafka``: always ``suite_kafka``, never a named broker.
``rl_topics`` deletes the ``rl.*`` topics and the roles' consumer groups -- all of them made by
this session's tests on its own broker -- and creates the topics afresh, before the test and
again after it, so no test sees another's records, offsets or policy versions. Such tests also
use their own ``policy_id``, which the processors and the learner follow exclusively.

Plugins: ``tests.support.reaper`` ends every process a test starts, pass or fail, and fails a
test that left one running; ``tests.support.services`` gives the ``kafka``/``redis`` marks to the
tests using those fixtures and turns a skip for a missing service into a failure under
``CI=true``; ``tests.support.seeds`` makes one printed seed replay a run's random order and its
hypothesis examples.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid

import pytest

from streams.topics import TopicSpec
from testbed.ports import free_port_pair

pytest_plugins = ("tests.support.reaper", "tests.support.services", "tests.support.seeds")

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


def _unavailable(msg: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture(scope="session")
def suite_kafka(tmp_path_factory):
    """Bootstrap servers of a broker this session started (see the module docstring)."""
    from localkafka.broker import LocalKafka
    from localkafka.paths import BrokerError

    reasons = []
    kafka = None
    try:
        kafka = LocalKafka(port=free_port_pair(), data_dir=tmp_path_factory.mktemp("kafka"), quiet=True,
                           heap=("-Xms128m", "-Xmx768m"))
        kafka.start(timeout=240)
    except (BrokerError, OSError, RuntimeError) as e:
        reasons.append(f"LocalKafka did not start: {str(e).splitlines()[0]}")
        if kafka is not None:
            with contextlib.suppress(Exception):
                kafka.kill()
        kafka = None
    if kafka is not None:
        try:
            yield kafka.bootstrap
        finally:
            kafka.kill()  # its data dir is thrown away
        return
    container = _docker_kafka(reasons)
    if container is not None:
        try:
            yield container.get_bootstrap_server()
        finally:
            container.stop()
        return
    _unavailable("no Kafka broker for the kafka tests: " + "; ".join(reasons))


@pytest.fixture(scope="session")
def kafka_bootstrap(request):
    """``RLSTREAM_TEST_KAFKA`` when set, else ``suite_kafka`` (see the module docstring)."""
    named = os.environ.get("RLSTREAM_TEST_KAFKA", "").strip()
    return named or request.getfixturevalue("suite_kafka")


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
    delete = getattr(bus, "delete_topics", None)  # keep a named broker clean
    if delete is not None and made:
        from streams.bus.kafka import KafkaBus

        with KafkaBus(bus.bootstrap, client_id="rlstream-test-cleanup") as admin:
            admin.delete_topics(made)


#: Consumer groups of the roles on the fixed topics (the Faust worker / stream processors and
#: the learner), whose committed offsets ``rl_topics`` removes with the topics.
ROLE_GROUPS = ("rlstream-streams", "learner")


@pytest.fixture(scope="session")
def rl_kafka(suite_kafka):
    """Bootstrap servers of the broker for the tests on the fixed topic names: this session's
    own, never ``RLSTREAM_TEST_KAFKA`` (see the module docstring)."""
    return suite_kafka


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
