"""KafkaBus settings: security passthrough from the environment, role defaults. No broker needed."""

from __future__ import annotations

import pytest

from config import BusConfig, Environment
from streams.bus.kafka import KafkaBus


def test_security_settings_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("RLSTREAM_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("RLSTREAM_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("RLSTREAM_KAFKA_SASL_USERNAME", "learner")
    monkeypatch.setenv("RLSTREAM_KAFKA_SSL_CA_LOCATION", "/etc/ca.pem")
    monkeypatch.setenv("RLSTREAM_KAFKA_VERSION", "3.9.1")  # the local broker's, not a client setting
    monkeypatch.setenv("RLSTREAM_KAFKA_JAVA_OPTS", "-Xmx2g")
    conf = Environment.read().kafka_security()
    assert conf == {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
                    "sasl.username": "learner", "ssl.ca.location": "/etc/ca.pem"}



def test_no_environment_no_settings(monkeypatch):
    for k in list(__import__("os").environ):
        if k.startswith("RLSTREAM_KAFKA_"):
            monkeypatch.delenv(k)
    assert Environment.read().kafka_security() == {}


@pytest.fixture
def offline_bus(monkeypatch):
    monkeypatch.setenv("RLSTREAM_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    monkeypatch.setenv("RLSTREAM_KAFKA_SASL_MECHANISM", "PLAIN")
    monkeypatch.setenv("KAFKA_BROKERS", "127.0.0.1:1")  # nothing listens: clients never connect here
    cfg = BusConfig.from_environment(Environment.read(), kind="kafka")  # as an entry point reads them
    bus = KafkaBus(cfg.bootstrap, config={**cfg.security, "sasl.username": "u", "sasl.password": "p"},
                   consumer_config={"fetch.wait.max.ms": 10}, producer_config={"linger.ms": 1})
    yield bus
    bus.close(timeout=0)  # nothing was produced: nothing to wait for


def test_every_client_gets_the_security_settings(offline_bus):
    b = offline_bus
    assert b.bootstrap == "127.0.0.1:1"
    for conf in (b.producer_config, b.consumer_config, b.admin_config):
        assert conf["security.protocol"] == "SASL_PLAINTEXT" and conf["sasl.mechanism"] == "PLAIN"
        assert conf["sasl.username"] == "u" and conf["bootstrap.servers"] == "127.0.0.1:1"


def test_role_defaults(offline_bus):
    p, c = offline_bus.producer_config, offline_bus.consumer_config
    assert p["enable.idempotence"] is True and p["acks"] == "all" and p["linger.ms"] == 1
    assert p["message.max.bytes"] == 16 * 1024 * 1024 and p["compression.type"] == "none"
    assert p["partitioner"] == "murmur2_random"
    assert c["enable.auto.commit"] is False and c["enable.partition.eof"] is False
    assert c["fetch.wait.max.ms"] == 10 and c["max.partition.fetch.bytes"] >= 16 * 1024 * 1024
    assert "linger.ms" not in c and "enable.auto.commit" not in p
