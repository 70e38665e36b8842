"""One replication setting for every role (issue 24, part 1): ``RLSTREAM_REPLICATION_FACTOR`` and
``RLSTREAM_MIN_INSYNC_REPLICAS`` are read once (``config.Environment``), carried by ``BusConfig``
(and a run's config file) and ``StreamsSettings``, and used where topics are made: the KafkaBus
(replication factor, ``min.insync.replicas``) and the Faust app (``topic_replication_factor``,
producer ``acks=all``, bounded metadata age). A factor the cluster cannot hold is refused with
``ReplicationError`` before any topic is asked for. The same on a 3-broker cluster, with brokers
lost mid-run: ``tests/faults/test_cluster_faults.py`` (slow)."""

from __future__ import annotations

import dataclasses
import uuid

import pytest

from config import BusConfig, Environment, PrepareConfig, TrainConfig
from config.bus import Replication
from streams.settings import StreamsSettings

CLUSTER_ENV = {"RLSTREAM_REPLICATION_FACTOR": "3", "RLSTREAM_MIN_INSYNC_REPLICAS": "2"}


def test_the_setting_is_read_once_into_the_bus_config():
    assert Environment(CLUSTER_ENV).replication() == (3, 2)
    assert Environment({}).replication() == (None, None)  # unset: the broker's defaults
    assert BusConfig.from_environment(Environment(CLUSTER_ENV)).replication == Replication(3, 2)
    assert BusConfig.from_environment(Environment({})).replication == Replication()
    assert Replication(3, 2).topic_config() == {"min.insync.replicas": "2"} and Replication().topic_config() == {}


@pytest.mark.parametrize("env, message", [
    ({"RLSTREAM_REPLICATION_FACTOR": "three"}, "RLSTREAM_REPLICATION_FACTOR must be a positive integer, not 'three'"),
    ({"RLSTREAM_MIN_INSYNC_REPLICAS": "0"}, "RLSTREAM_MIN_INSYNC_REPLICAS must be a positive integer, not '0'"),
    ({"RLSTREAM_REPLICATION_FACTOR": "1", "RLSTREAM_MIN_INSYNC_REPLICAS": "2"},
     "RLSTREAM_MIN_INSYNC_REPLICAS=2 is more than RLSTREAM_REPLICATION_FACTOR=1"),
])
def test_a_bad_value_names_its_variable(env, message):
    with pytest.raises(ValueError, match=message):
        Environment(env).replication()
    with pytest.raises(SystemExit, match=message):
        BusConfig.from_environment(Environment(env))


def test_a_run_config_file_carries_it_to_every_child(tmp_path):
    cfg = TrainConfig(bus=BusConfig(kind="kafka", replication=Replication(3, 2)), run_dir=tmp_path)
    back = TrainConfig.from_dict(cfg.to_dict())
    assert back.bus.replication == Replication(3, 2)
    assert StreamsSettings.from_train_config(back).replication == Replication(3, 2)  # the Faust worker's
    old = cfg.to_dict()
    del old["bus"]["replication"]  # a file written before the setting existed: the broker's defaults
    assert TrainConfig.from_dict(old).bus.replication == Replication()


def test_the_faust_app_replicates_its_topics_acks_all_and_refreshes_metadata_often():
    """From the worker's environment to the Faust app's settings (nothing touches a broker)."""
    from streams.faust_app import StreamsApp
    from streams.faust_app.clients import METADATA_MAX_AGE_MS
    from streams.processors.pipeline import Prepare
    from streams.topics import SAMPLES_PREPARED

    settings = StreamsSettings.from_environment(Environment(CLUSTER_ENV))
    assert settings.replication == Replication(3, 2)
    settings = dataclasses.replace(settings, app_id=f"test-{uuid.uuid4().hex[:8]}")
    sa = StreamsApp(settings, prepare=Prepare.from_config(PrepareConfig(), lambda pv: None), metrics=None)
    conf = sa.app.conf
    assert conf.topic_replication_factor == 3 and conf.producer_acks == -1
    # aiokafka's default is 5 minutes: table recovery waited that long for a leader that had moved
    # away after a controlled broker shutdown. Bounded, and not so short that it floods the brokers.
    # A SIGKILLed leader: aiokafka's fetcher retries it until this age runs out (docs/deploy.md).
    for age in (conf.consumer_metadata_max_age_ms, conf.producer_metadata_max_age_ms):
        assert age == METADATA_MAX_AGE_MS and 1_000 <= age <= 5_000
    topic = sa.topics[SAMPLES_PREPARED]
    assert topic.replicas is None  # the app's topic_replication_factor applies
    assert topic.config["min.insync.replicas"] == "2"
    # unset: Faust's own default factor, and no topic override of min.insync.replicas
    plain = StreamsApp(dataclasses.replace(settings, replication=Replication()),
                       prepare=Prepare.from_config(PrepareConfig(), lambda pv: None), metrics=None)
    assert "min.insync.replicas" not in plain.topics[SAMPLES_PREPARED].config
    assert plain.app.conf.producer_acks == -1
    # one copy (a single broker, where no leader can move): aiokafka's default age is kept; a 15 s
    # age made tests/faults/test_broker_crash.py fail there (see streams.faust_app.clients.METADATA_MAX_AGE_MS)
    assert plain.app.conf.consumer_metadata_max_age_ms == 300_000


def test_the_streams_workers_bus_gets_the_setting_too():
    from rlstream.wiring import streams_bus

    bus = streams_bus(StreamsSettings(replication=Replication(3, 2)), "test")
    try:
        assert (bus.replication_factor, bus.min_insync_replicas) == (3, 2)
    finally:
        bus.close(timeout=1)


def test_replicated_clients_try_a_lost_leader_again_within_a_second():
    """librdkafka finds a partition's new leader on the metadata refresh that a failed reconnect
    to the dead one triggers: on a replicated cluster its backoff is capped at 1 s (10 s by
    default); a single broker keeps librdkafka's default; a user's own setting wins."""
    from rlstream.wiring import streams_bus
    from streams.bus.kafka import KafkaBus

    bus = streams_bus(StreamsSettings(replication=Replication(3, 2)), "test")
    single = KafkaBus("127.0.0.1:1", replication_factor=1)
    mine = KafkaBus("127.0.0.1:1", replication_factor=3, config={"reconnect.backoff.max.ms": 250})
    try:
        for conf in (bus.consumer_config, bus.producer_config, bus.admin_config):
            assert conf["reconnect.backoff.max.ms"] == 1000
        assert "reconnect.backoff.max.ms" not in single.consumer_config
        assert mine.producer_config["reconnect.backoff.max.ms"] == 250
    finally:
        for b in (bus, single, mine):
            b.close(timeout=1)


def test_producers_stay_idempotent_at_acks_all():
    from streams.bus.kafka.clients import PRODUCER_DEFAULTS

    assert PRODUCER_DEFAULTS["acks"] == "all" and PRODUCER_DEFAULTS["enable.idempotence"] is True


# -- against a real broker -------------------------------------------------------------------------

def _topic_names(bootstrap: str) -> set[str]:
    from confluent_kafka.admin import AdminClient

    return set(AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=30).topics)


@pytest.mark.kafka
def test_a_factor_the_cluster_cannot_hold_is_refused_before_the_broker_is_asked(kafka_bootstrap):
    from streams.bus import ReplicationError, open_bus

    ns = f"repl-{uuid.uuid4().hex[:8]}"
    cfg = BusConfig(kind="kafka", bootstrap=kafka_bootstrap, namespace=ns, replication=Replication(3, 2))
    with pytest.raises(ReplicationError) as err:
        open_bus(cfg)
    text = str(err.value)
    assert text.startswith("RLSTREAM_REPLICATION_FACTOR=3 asks for 3 copies of every topic, but the Kafka cluster at "
                           f"{kafka_bootstrap} has 1 broker alive: cannot create {ns}.rl."), text
    assert "rlstream broker start --nodes 3" in text and "RLSTREAM_REPLICATION_FACTOR=1" in text
    assert (err.value.factor, err.value.brokers) == (3, 1)
    assert not any(t.startswith(ns) for t in _topic_names(kafka_bootstrap)), "a topic was created anyway"


@pytest.mark.kafka
def test_created_topics_carry_the_settings_min_insync_replicas(kafka_bootstrap):
    """On the suite's single broker a factor of 1 is all it holds; min.insync.replicas comes from
    the setting (a topic override), not from the broker's default. The 3-broker case is checked
    on the cluster of ``tests/faults/test_cluster_faults.py``."""
    from confluent_kafka.admin import AdminClient, ConfigResource, ConfigSource, ResourceType

    from streams.bus import open_bus

    ns = f"repl-{uuid.uuid4().hex[:8]}"
    bus = open_bus(BusConfig(kind="kafka", bootstrap=kafka_bootstrap, namespace=ns, replication=Replication(1, 1)))
    try:
        made = sorted(t for t in _topic_names(kafka_bootstrap) if t.startswith(ns + "."))
        assert made, "no topic created"
        admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
        futures = admin.describe_configs([ConfigResource(ResourceType.TOPIC, t) for t in made])
        for res, fut in futures.items():
            entry = fut.result(timeout=30)["min.insync.replicas"]
            assert (entry.value, entry.source) == ("1", ConfigSource.DYNAMIC_TOPIC_CONFIG.value), res.name
        md = admin.list_topics(timeout=30)
        assert {len(p.replicas) for t in made for p in md.topics[t].partitions.values()} == {1}
    finally:
        bus.close()
    from streams.bus.kafka import KafkaBus

    with KafkaBus(kafka_bootstrap, client_id="rlstream-test", auto_create=False) as plain:
        plain.delete_topics(made)


def test_a_role_says_it_in_one_line_and_exits_2(monkeypatch, capsys):
    from rlstream import cli
    from streams.bus import ReplicationError

    def refused(a):
        raise ReplicationError(3, 1, "127.0.0.1:9092", ["rl.samples.raw"])

    monkeypatch.setattr(cli, "cmd_role", refused)
    assert cli.main(["learner", "--bus", "kafka"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlstream learner: error: RLSTREAM_REPLICATION_FACTOR=3 asks for 3 copies of every topic, "
                          "but the Kafka cluster at 127.0.0.1:9092 has 1 broker alive: cannot create rl.samples.raw.")
    assert "Traceback" not in err
