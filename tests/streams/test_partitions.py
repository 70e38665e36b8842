"""``--partitions N`` on a real broker: the sample topics are created with N partitions; a later
process asking for more gets ``FewerPartitionsError`` (Kafka cannot shrink, and growing moves
keys), one asking for fewer uses what exists; ``KafkaBus.add_partitions`` is the deliberate path.
Actor ids (``actor.identity``) registered concurrently are distinct."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from actor.identity import register
from config import BusConfig
from rlstream.wiring import build_bus
from streams.bus.kafka import FewerPartitionsError, KafkaBus
from streams.topics import ACTORS, SAMPLES_PREPARED, SAMPLES_RAW, Namespace

pytestmark = pytest.mark.kafka


def test_partitions_are_created_checked_and_added(kafka_bootstrap):
    ns = f"parts-{uuid.uuid4().hex[:8]}"
    cfg = BusConfig(kind="kafka", bootstrap=kafka_bootstrap, namespace=ns, partitions=3)
    with build_bus(cfg) as bus:
        assert len(bus.end_offsets(SAMPLES_RAW)) == len(bus.end_offsets(SAMPLES_PREPARED)) == 3
        assert len(bus.end_offsets(ACTORS)) == 1  # one partition: its offsets number the generations
    with build_bus(BusConfig(kind="kafka", bootstrap=kafka_bootstrap, namespace=ns)) as bus:
        assert len(bus.end_offsets(SAMPLES_RAW)) == 3  # asking for fewer uses what exists
    with pytest.raises(FewerPartitionsError) as err:
        build_bus(BusConfig(kind="kafka", bootstrap=kafka_bootstrap, namespace=ns, partitions=4))
    raw = Namespace(ns).topic(SAMPLES_RAW)
    assert (err.value.topic, err.value.have, err.value.want) == (raw, 3, 4)
    assert "--namespace" in str(err.value) and "per-actor order" in str(err.value)
    with KafkaBus(kafka_bootstrap) as admin:
        admin.add_partitions(raw, 4)
        admin.add_partitions(Namespace(ns).topic(SAMPLES_PREPARED), 4)
        assert admin.partitions(raw) == 4
    with build_bus(BusConfig(kind="kafka", bootstrap=kafka_bootstrap, namespace=ns, partitions=4)) as bus:
        assert len(bus.end_offsets(SAMPLES_RAW)) == 4


def test_concurrent_registrations_get_distinct_generations(kafka_bootstrap):
    cfg = BusConfig(kind="kafka", bootstrap=kafka_bootstrap, namespace=f"ids-{uuid.uuid4().hex[:8]}")
    buses = [build_bus(cfg) for _ in range(4)]
    try:
        with ThreadPoolExecutor(4) as pool:  # one producer each, as four actor processes would have
            ids = list(pool.map(lambda b: register(b, host="pod-a"), buses))
    finally:
        for b in buses:
            b.close()
    assert sorted(i.generation for i in ids) == [0, 1, 2, 3]
    assert {i.actor_id for i in ids} == {f"pod-a-{g}" for g in range(4)}
