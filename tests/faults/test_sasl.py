"""SASL_PLAINTEXT/PLAIN against a real listener (the private broker's, ``conftest.SASL_USERS``).

The settings come from the environment, as in production (``RLSTREAM_KAFKA_*``): the
confluent-kafka bus (producer, consumer group, admin, group lag) and the Faust side (the
aiokafka arguments of ``streams.faust_app``: its policy reader's, and Faust's own mapping of
the app's ``broker_credentials``) all get through with the right password; with a wrong one the
bus's first call (``create_topics``, as in every role's ``build_bus``) fails fast with
``BusAuthenticationError`` saying what was refused (never the password), and aiokafka refuses
to start.
"""

from __future__ import annotations

from config import Environment

import asyncio
import time
import uuid

import pytest

from streams.bus.base import BusAuthenticationError
from streams.topics import TopicSpec

pytestmark = pytest.mark.kafka


def sasl_env(monkeypatch, user: str, password: str) -> None:
    for k in list(__import__("os").environ):
        if k.startswith("RLSTREAM_KAFKA_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("RLSTREAM_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    monkeypatch.setenv("RLSTREAM_KAFKA_SASL_MECHANISM", "PLAIN")
    monkeypatch.setenv("RLSTREAM_KAFKA_SASL_USERNAME", user)
    monkeypatch.setenv("RLSTREAM_KAFKA_SASL_PASSWORD", password)


def test_sasl_round_trip_and_a_clear_error_for_wrong_credentials(private_kafka, monkeypatch):
    from streams.bus.kafka import KafkaBus
    from streams.faust_app.clients import aiokafka_security, faust_credentials
    from streams.settings import StreamsSettings

    topic = f"sasl-{uuid.uuid4().hex[:8]}"
    # -- the right password: everything the roles do goes through the SASL listener
    sasl_env(monkeypatch, "svc", private_kafka.users["svc"])
    monkeypatch.setenv("KAFKA_BROKERS", private_kafka.sasl_bootstrap)  # what the entry points read
    with KafkaBus(private_kafka.sasl_bootstrap, client_id="sasl-test", config=Environment.read().kafka_security(),
                  consumer_config={"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}) as bus:
        assert bus.producer_config["security.protocol"] == "SASL_PLAINTEXT"
        bus.create_topics([TopicSpec(topic, key="k")])
        for i in range(3):
            bus.produce(topic, f"v{i}".encode(), key=b"k", headers={"h": b"1"})
        bus.flush()
        assert [r.value for r in bus.read_all(topic)] == [b"v0", b"v1", b"v2"]
        with bus.consumer("sasl-group", [topic]) as c:
            got, deadline = [], time.monotonic() + 30
            while len(got) < 3 and time.monotonic() < deadline:
                got += c.poll(0.5)
            c.commit(got)
        assert [r.value for r in got] == [b"v0", b"v1", b"v2"] and got[0].headers == {"h": b"1"}
        assert bus.group_lag("sasl-group", topic) == 0

    settings = StreamsSettings.from_environment(Environment.read())
    assert settings.client_config["sasl.username"] == "svc"

    async def aiokafka_round_trip(kwargs: dict) -> list[bytes]:
        from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

        producer = AIOKafkaProducer(bootstrap_servers=private_kafka.sasl_bootstrap, **kwargs)
        await producer.start()
        try:
            await producer.send_and_wait(topic, b"from-faust", key=b"k")
        finally:
            await producer.stop()
        consumer = AIOKafkaConsumer(topic, bootstrap_servers=private_kafka.sasl_bootstrap, group_id=None,
                                    auto_offset_reset="earliest", enable_auto_commit=False, **kwargs)
        await consumer.start()
        try:
            got: list[bytes] = []
            deadline = time.monotonic() + 20
            while b"from-faust" not in got and time.monotonic() < deadline:
                batches = await consumer.getmany(timeout_ms=200, max_records=10)
                got += [m.value for msgs in batches.values() for m in msgs]
            return got
        finally:
            await consumer.stop()

    from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

    # the policy reader's arguments, and what Faust makes of the app's broker_credentials
    for kwargs in (aiokafka_security(settings.client_config),
                   dict(credentials_to_aiokafka_auth(faust_credentials(settings.client_config)))):
        assert kwargs["security_protocol"] == "SASL_PLAINTEXT" and kwargs["sasl_plain_username"] == "svc"
        assert b"from-faust" in asyncio.run(aiokafka_round_trip(kwargs))

    # -- a wrong password: a clear error, quickly, not a timeout
    sasl_env(monkeypatch, "svc", "not-the-password")
    bus = KafkaBus(private_kafka.sasl_bootstrap, client_id="sasl-test-wrong", config=Environment.read().kafka_security())
    with pytest.raises(BusAuthenticationError) as info:  # the refusal itself, not a timeout error
        bus.create_topics([TopicSpec(f"{topic}-2", key="k")], timeout=30)
    msg = str(info.value)
    assert "refused the credentials" in msg and "sasl.username=svc" in msg and "SASL_PLAINTEXT" in msg
    assert "Authentication failed" in msg or "authentication" in msg.lower()
    assert "not-the-password" not in msg and "not-the-password" not in repr(bus)
    with pytest.raises(BusAuthenticationError) as again:  # it stays refused, and says so again
        bus.check_auth()
    assert "not-the-password" not in str(again.value)
    bus.close(timeout=1)

    wrong = StreamsSettings.from_environment(Environment.read())
    from aiokafka.errors import KafkaError as AIOKafkaError

    async def aiokafka_refused() -> None:
        from aiokafka import AIOKafkaProducer

        producer = AIOKafkaProducer(bootstrap_servers=private_kafka.sasl_bootstrap, request_timeout_ms=5000,
                                    **aiokafka_security(wrong.client_config))
        try:
            await producer.start()
        finally:
            await producer.stop()

    with pytest.raises(AIOKafkaError):
        asyncio.run(aiokafka_refused())
