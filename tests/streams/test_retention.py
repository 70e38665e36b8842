"""Per-topic retention: documented defaults, overrides from ``RLSTREAM_RETENTION``, applied when
the topics are created (read back from the broker with the admin client's describe_configs)."""

from __future__ import annotations

import dataclasses
import uuid

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

from config import BusConfig, Environment
from config.bus import DAY_MS, Retention, parse_retention
from streams.bus.kafka import KafkaBus
from streams.topics import (
    DEADLETTER, LEARNER_STEPS, POLICY_VERSIONS, PREFERENCES, SAMPLES_PREPARED, SAMPLES_RAW, SCHEMAS, all_topics,
)


def test_parse_retention():
    got = parse_retention(" rl.samples.raw=7d , rl.samples.prepared=12h/50g,rl.preferences=forever,"
                          "rl.deadletter=90000ms/-1")
    assert got == {SAMPLES_RAW: Retention(7 * DAY_MS), SAMPLES_PREPARED: Retention(12 * 3600_000, 50 << 30),
                   PREFERENCES: Retention(-1), DEADLETTER: Retention(90_000)}
    assert parse_retention("") == {}
    for bad in ("rl.samples.raw", "nope=1d", "rl.samples.raw=7w", "rl.samples.raw=1d/3x"):
        with pytest.raises(ValueError, match="retention"):
            parse_retention(bad)
    with pytest.raises(ValueError, match=r"retention of \['rl.nope'\]"):  # a topic that takes none: refused
        all_topics(retention=parse_retention("rl.nope=1d"))  # where the topics are made (build_bus)


def test_bus_config_reads_the_environment(monkeypatch):
    monkeypatch.setenv("RLSTREAM_RETENTION", "rl.samples.raw=2d")
    assert BusConfig.from_environment(Environment.read()).retention == {SAMPLES_RAW: Retention(2 * DAY_MS)}
    monkeypatch.setenv("RLSTREAM_RETENTION", "rl.samples.raw=two days")
    with pytest.raises(SystemExit, match="RLSTREAM_RETENTION"):
        BusConfig.from_environment(Environment.read())


def _described(bootstrap: str, names: list[str]) -> dict[str, dict[str, str]]:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.describe_configs([ConfigResource(ResourceType.TOPIC, n) for n in names])
    return {res.name: {k: e.value for k, e in fut.result(timeout=30).items()} for res, fut in futures.items()}


@pytest.mark.kafka
def test_retention_is_applied_when_topics_are_created(kafka_bootstrap):
    """Every topic of ``all_topics`` (renamed, so the shared broker's rl.* topics stay as they are):
    the defaults, then overrides, as the broker reports them."""
    tag = uuid.uuid4().hex[:8]
    overrides = parse_retention("rl.samples.raw=7d/1g,rl.preferences=30d")
    with KafkaBus(kafka_bootstrap, client_id="rlstream-test") as bus:
        made = []
        try:
            for kind, retention in (("default", None), ("override", overrides)):
                specs = [dataclasses.replace(s, name=f"{s.name}-{kind}-{tag}") for s in all_topics(2, retention)]
                bus.create_topics(specs)
                made += [s.name for s in specs]
            conf = _described(kafka_bootstrap, made)
        finally:
            bus.delete_topics(made)

    def got(topic: str, kind: str) -> tuple[int, int]:
        c = conf[f"{topic}-{kind}-{tag}"]
        return int(c["retention.ms"]), int(c["retention.bytes"])

    for topic in (POLICY_VERSIONS, LEARNER_STEPS, PREFERENCES, DEADLETTER):
        assert got(topic, "default") == (-1, -1), topic
    for topic in (SAMPLES_RAW, SAMPLES_PREPARED):
        assert got(topic, "default") == (30 * DAY_MS, -1), topic
    assert conf[f"{SCHEMAS}-default-{tag}"]["cleanup.policy"] == "compact"
    assert got(SAMPLES_RAW, "override") == (7 * DAY_MS, 1 << 30)
    assert got(PREFERENCES, "override") == (30 * DAY_MS, -1)
    assert got(SAMPLES_PREPARED, "override") == (30 * DAY_MS, -1)
    assert got(POLICY_VERSIONS, "override") == (-1, -1)
