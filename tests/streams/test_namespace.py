"""Run namespaces: every topic and group of a namespace is distinct from every other run's, and
a bus seen through a namespace keeps runs apart while roles keep their logical names."""

from __future__ import annotations

from config import Environment

from dataclasses import replace

import pytest

from config import BusConfig
from rlstream.wiring import build_bus, build_faust_app
from streams.bus.memory import MemoryBus
from streams.bus.namespaced import NamespacedBus
from streams.faust_app import StreamsApp, StreamsSettings
from streams.topics import (LEARNER_GROUP, LEGACY, POLICY_VERSIONS, SAMPLES_PREPARED, SAMPLES_RAW, STREAMS_GROUP,
                            TOPICS, Namespace, all_topics)


def test_every_topic_and_group_of_a_namespace_is_distinct():
    names = {}
    for ns in (LEGACY, Namespace("run-a"), Namespace("run-b"), Namespace("run_a")):
        scoped = [t.name for t in ns.topics()] + ns.groups()
        assert len(set(scoped)) == len(scoped) == len(TOPICS) + 2
        for name in scoped:
            assert name not in names, f"{name} of {ns} is also {names[name]}'s"
            names[name] = ns
    a = Namespace("run-a")
    assert a.topic(SAMPLES_RAW) == "run-a.rl.samples.raw" and a.group(LEARNER_GROUP) == "run-a.learner"
    assert a.logical(a.topic(SAMPLES_PREPARED)) == SAMPLES_PREPARED
    assert [t.name for t in LEGACY.topics()] == [t.name for t in all_topics()]  # old data stays readable
    assert LEGACY.groups() == [STREAMS_GROUP, LEARNER_GROUP]
    assert {t.name: t.config for t in a.topics(4)} == {a.topic(t.name): t.config for t in all_topics(4)}


@pytest.mark.parametrize("bad", ["a.b", "a b", "x" * 101, "ü"])
def test_bad_namespaces_are_refused(bad):
    with pytest.raises(ValueError, match="namespace"):
        Namespace(bad)
    assert Namespace.derive(bad).name  # a run id is made valid, not refused


def test_two_namespaces_on_one_bus_never_see_each_other():
    inner = MemoryBus()
    a, b = NamespacedBus(inner, Namespace("a")), NamespacedBus(inner, Namespace("b"))
    for bus in (a, b):
        bus.create_topics(all_topics())
    a.produce(SAMPLES_RAW, b"from-a", key=b"actor-0")
    b.produce(SAMPLES_RAW, b"from-b", key=b"actor-0")
    b.produce(SAMPLES_RAW, b"from-b-2", key=b"actor-0")
    assert inner.end_offsets("a.rl.samples.raw") == {0: 1} and inner.end_offsets(SAMPLES_RAW) == {0: 0}
    ca = a.consumer(LEARNER_GROUP, [SAMPLES_RAW])
    recs = ca.poll(0.1)
    assert [(r.topic, r.value) for r in recs] == [(SAMPLES_RAW, b"from-a")]  # logical names come back
    ca.commit(recs)
    assert ca.committed() == {(SAMPLES_RAW, 0): 1} and ca.assignment() == [(SAMPLES_RAW, 0)]
    assert a.group_lag(LEARNER_GROUP, SAMPLES_RAW) == 0
    assert b.group_lag(LEARNER_GROUP, SAMPLES_RAW) == 2  # the same group name, another run's group
    cb = b.consumer(LEARNER_GROUP, [SAMPLES_RAW], start={SAMPLES_RAW: 1})
    assert [r.value for r in cb.poll(0.1)] == [b"from-b-2"]
    cb.commit(offsets={(SAMPLES_RAW, 0): 2})
    assert b.group_lag(LEARNER_GROUP, SAMPLES_RAW) == 0
    assert [r.value for r in b.read_all(SAMPLES_RAW)] == [b"from-b", b"from-b-2"]
    with pytest.raises(ValueError):
        NamespacedBus(inner, LEGACY)


def test_bus_config_reads_the_namespace_once(monkeypatch):
    monkeypatch.setenv("RLSTREAM_NAMESPACE", "from-env")
    env = Environment.read()
    assert BusConfig.from_environment(env, kind="memory").namespace == "from-env"
    assert BusConfig.from_environment(env, kind="memory", namespace="").namespace == ""  # an explicit legacy choice
    bus = build_bus(BusConfig(kind="memory", namespace="x1"))
    assert isinstance(bus, NamespacedBus) and bus.inner.end_offsets("x1." + POLICY_VERSIONS) == {0: 0}
    assert not isinstance(build_bus(BusConfig(kind="memory")), NamespacedBus)


def test_faust_worker_follows_the_namespace():
    settings = StreamsSettings.from_environment(Environment({"RLSTREAM_NAMESPACE": "exp7"}))
    assert settings.app_id == "exp7." + STREAMS_GROUP
    sa = build_faust_app(replace(settings, raw_partitions=1))
    assert {k: t.get_topic_name() for k, t in sa.topics.items()} == {
        k: "exp7." + k for k in sa.topics}
    assert StreamsSettings.from_environment(Environment({})).app_id == STREAMS_GROUP
