"""Malformed records, fuzzed with hypothesis, against every processor entry point.

For each reader of a topic: interleave good events with surely-bad records (``malformed``), and
check that the reader keeps running, handles every good event, and dead-letters every bad
record, once, with a reason: ``dead letters == bad records``. On rl.policy.versions, which every
reader reads in full, only the learner dead-letters (``streams.topics.DEAD_LETTER_OWNERS``); the
other readers skip each bad record and count it: ``skipped == bad records``, no dead letter.

Entry points: the in-process stream processors (``PrepareWorker``: rl.samples.raw is fuzzed in
tests/streams; here its policy reader, and exact counts on raw samples), the learner
(rl.samples.prepared, and foreign versions on rl.policy.versions), the actor's
``PolicySubscriber``, ``rlstream serve``'s follower, ``logtools.subscribe.PolicyFeed``, and the
Faust app's sample agent and policy reader (broker-less ``test_context``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.codec import Codec
from schemas.errors import CodecError
from schemas.events import DeadLetter
from streams.bus.memory import MemoryBus
from streams.events import EventBus
from streams.topics import (
    DEADLETTER,
    POLICY_VERSIONS,
    SAMPLES_PREPARED,
    SAMPLES_RAW,
    all_topics,
)

from .malformed import (
    ACT,
    CODEC,
    OBS,
    N,
    T,
    bad_policy_records,
    bad_prepared,
    bad_samples,
    incompatible_prepared,
    plan,
    policy_version,
    prepared,
    sample_batch,
    unloadable_versions,
    with_one,
)

torch.set_num_threads(1)
FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def new_events() -> EventBus:
    bus = MemoryBus()
    bus.create_topics(all_topics())
    return EventBus(bus, Codec())


def dead_letters(events: EventBus, topic: str | None = None) -> list[DeadLetter]:
    out = [CODEC.decode(r.value, DeadLetter) for r in events.bus.read_all(DEADLETTER)]
    return [d for d in out if topic is None or d.topic == topic]


def check_dead_letters(dead: list[DeadLetter], bad: list[tuple[int, str]]) -> None:
    """One dead letter per bad record (by offset), each with a reason and the original bytes."""
    assert sorted(d.offset for d in dead) == sorted(o for o, _ in bad), (
        f"dead-lettered offsets {sorted(d.offset for d in dead)} != bad {bad}")
    assert all(d.reason and d.error_class for d in dead)


def check_skipped(events: EventBus, bad: list) -> None:
    """A reader that does not own rl.policy.versions' dead letters (the learner does) writes
    none: it skips each bad record and counts it, by reason."""
    assert dead_letters(events, POLICY_VERSIONS) == []
    assert set(t for t, _ in events.dead_letters.skipped) <= {POLICY_VERSIONS}
    assert sum(events.dead_letters.skipped.values()) == len(bad), (events.dead_letters.skipped, bad)


# --- stream processors: PrepareWorker --------------------------------------------------------

def _worker(events: EventBus):
    from config import PrepareConfig
    from streams.processors.pipeline import Prepare
    from streams.worker import PrepareWorker

    def factory(pv):
        return lambda obs, act: np.full(obs.shape[:2], -1.5, np.float32)

    prepare = Prepare.from_config(PrepareConfig(max_versions=1000, max_ms=None, reorder_timeout_ms=10), factory)
    return PrepareWorker(events, prepare)


@FUZZ
@given(plan(bad_samples()))
def test_prepare_worker_dead_letters_exactly_the_bad_raw_samples(steps):
    events = new_events()
    events.publish(POLICY_VERSIONS, policy_version(0), key="policy")
    worker = _worker(events)
    bad, seq = [], 0
    for i, (kind, b) in enumerate(steps):
        if kind == "good":
            events.publish(SAMPLES_RAW, sample_batch("a", seq), key="a")
            seq += 1
        else:
            events.bus.produce(SAMPLES_RAW, b[0], key=b"a")
            bad.append((i, b[1]))
        worker.step(0)
    while worker.step(0):
        pass
    check_dead_letters(dead_letters(events, SAMPLES_RAW), bad)
    assert worker.published == seq and worker.dead_lettered == len(bad)
    assert worker.samples.raw.committed() == {(SAMPLES_RAW, 0): len(steps)}
    worker.close()


@FUZZ
@given(plan(bad_policy_records()))
def test_prepare_worker_skips_bad_policy_records_and_follows_the_good(steps):
    events = new_events()
    bad, version = [], -1
    for i, (kind, b) in enumerate(steps):
        if kind == "good":
            version += 1
            events.publish(POLICY_VERSIONS, policy_version(version), key="policy")
        else:
            events.bus.produce(POLICY_VERSIONS, b[0], key=b"policy")
            bad.append((i, b[1]))
    worker = _worker(events)
    worker.policies = events.consumer(None, [POLICY_VERSIONS], stage="streams.prepare", start="earliest")
    worker.step(0)
    check_skipped(events, bad)
    assert worker.skipped == len(bad) and worker.dead_lettered == 0
    assert worker.prepare.stats.latest_version == (version if version >= 0 else None)
    events.publish(SAMPLES_RAW, sample_batch("a", 0, version=max(version, 0)), key="a")
    worker.step(0)
    assert worker.published == 1  # still working
    worker.close()


# --- the learner -----------------------------------------------------------------------------------

def _learner(events: EventBus):
    from agents.registry import make_algorithm
    from learner.learner import Learner, LearnerConfig

    algo = make_algorithm("ppo", OBS, ACT, {"num_minibatches": 1, "update_epochs": 1}, "cpu")
    lr = Learner(LearnerConfig(train_batch_size=T * N, snapshot_every=0), algo, events)
    lr.start()
    return lr


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan(st.one_of(bad_prepared(), incompatible_prepared())))
def test_learner_dead_letters_bad_prepared_batches_and_trains_the_good(steps):
    events = new_events()
    lr = _learner(events)
    bad, good = [], []
    for i, (kind, b) in enumerate(steps):
        if kind == "good":
            pb = prepared(sample_batch("a", i, batch_id=f"good-{i}"))
            good.append(pb.sample.batch_id)
            events.publish(SAMPLES_PREPARED, pb, key="a")
        else:
            events.bus.produce(SAMPLES_PREPARED, b[0], key=b"a")
            bad.append((i, b[1]))
        lr.step(0)
    for _ in range(3):
        lr.step(0)
    check_dead_letters(dead_letters(events, SAMPLES_PREPARED), bad)
    trained = [i for r in events.bus.read_all("rl.learner.steps") for i in CODEC.decode(r.value).batch_ids]
    assert trained == good
    lr.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(bad_policy_records().map(lambda b: ("record", b)),
                          unloadable_versions(st.integers(5, 50)).map(lambda b: ("version", b)),
                          unloadable_versions(st.just(0)).map(lambda b: ("old", b))),
                min_size=1, max_size=8))
def test_learner_dead_letters_foreign_versions_it_cannot_adopt(items):
    """The learner owns rl.policy.versions' dead letters: it checks every foreign version of its
    policy, also one not newer than its own (``old``) that it would not adopt anyway."""
    events = new_events()
    lr = _learner(events)
    start = events.bus.end_offsets(POLICY_VERSIONS)[0]
    bad = []
    for kind, (x, why) in items:
        offset = events.bus.end_offsets(POLICY_VERSIONS)[0]
        if kind == "record":
            events.bus.produce(POLICY_VERSIONS, x, key=b"policy")
        else:  # a "rollback" by another writer, newer than the learner's version (or not), that does not load
            version = lr.version + 1 + offset if kind == "version" else 0
            events.publish(POLICY_VERSIONS, type(x)(**{**x.__dict__, "learner_id": "rollback",
                                                        "version": version}), key="policy")
        bad.append((offset, why))
        lr.step(0)
    assert lr.version == 0 and lr.stats.adopted_versions == 0
    dead = dead_letters(events, POLICY_VERSIONS)
    check_dead_letters(dead, bad)
    assert all(d.offset >= start for d in dead)
    lr.close()


# --- the actor's policy subscriber --------------------------------------------------------------

def _one_at_a_time_policy_plan():
    """Good versions and bad records/unloadable versions, published and polled one by one (a
    version counts only if it is newer than the newest adopted, so bad ones get fresh numbers)."""
    bad = st.one_of(bad_policy_records().map(lambda b: ("record", b)),
                    unloadable_versions(st.just(0)).map(lambda b: ("version", b)))
    return with_one(st.one_of(st.just(("good", None)), bad), bad, max_size=10)


def _publish_step(events: EventBus, kind: str, item, version: int) -> tuple[int, str | None]:
    """Publish one step of the plan with version number ``version``; (offset, bad reason or None)."""
    offset = events.bus.end_offsets(POLICY_VERSIONS)[0]
    if kind == "good":
        events.publish(POLICY_VERSIONS, policy_version(version), key="policy")
        return offset, None
    x, why = item
    if kind == "record":
        events.bus.produce(POLICY_VERSIONS, x, key=b"policy")
    else:
        events.publish(POLICY_VERSIONS, type(x)(**{**x.__dict__, "version": version}), key="policy")
    return offset, why


@FUZZ
@given(_one_at_a_time_policy_plan())
def test_actor_policy_subscriber_skips_what_it_cannot_adopt(steps):
    from actor.policy_client import PolicySubscriber

    events = new_events()
    sub = PolicySubscriber(events, "policy", stage="actor-0", from_version=0)
    bad, newest_good = [], -1
    for version, (kind, item) in enumerate(steps):
        offset, why = _publish_step(events, kind, item, version)
        if why is None:
            newest_good = version
        else:
            bad.append((offset, why))
        sub.poll(0)
    check_skipped(events, bad)
    assert sub.version == newest_good and sub.adopted == sum(k == "good" for k, _ in steps)
    if newest_good >= 0:
        obs = torch.zeros(2, OBS)
        assert sub.policy.act(obs)[0].shape == (2, ACT)
    sub.close()


# --- rlstream serve's follower -------------------------------------------------------------------------

@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_one_at_a_time_policy_plan())
def test_serve_follower_skips_what_it_cannot_load_and_keeps_serving(steps):
    from logtools.serve import PolicyServer

    events = new_events()
    server = PolicyServer(events, "policy", host="127.0.0.1", port=0, poll_interval=0.05).start()
    try:
        bad, newest_good = [], None
        for version, (kind, item) in enumerate(steps):
            feed = server._feed
            seen = server.versions_loaded + server.load_failures + feed.undecodable + feed.skipped
            offset, why = _publish_step(events, kind, item, version)
            if why is None:
                newest_good = version
            else:
                bad.append((offset, why))
            deadline = time.monotonic() + 10
            while server.versions_loaded + server.load_failures + feed.undecodable + feed.skipped == seen:
                assert time.monotonic() < deadline, "the follower stopped following"
                time.sleep(0.01)
        assert server._thread.is_alive()
        check_skipped(events, bad)
        assert server.version == newest_good
        assert server.load_failures == sum(k == "version" for k, _ in steps)
    finally:
        server.stop()


# --- logtools.subscribe.PolicyFeed ----------------------------------------------------------------

@FUZZ
@given(_one_at_a_time_policy_plan())
def test_policy_feed_skips_undecodable_records_and_hands_out_the_rest(steps):
    from logtools.subscribe import PolicyFeed

    events = new_events()
    undecodable, handed = [], []
    for version, (kind, item) in enumerate(steps):
        offset, why = _publish_step(events, kind, item, version)
        if kind == "record":
            undecodable.append((offset, why))
        else:
            handed.append(version)
    feed = PolicyFeed(events, "policy", from_version=0)
    ups = feed.poll(0.5)
    check_skipped(events, undecodable)
    assert [u.version for u in ups] == handed and feed.undecodable == len(undecodable)
    # A version whose weights do not load says so with a CodecError (a consumer can dead-letter
    # it), never with anything else.
    for u, (kind, _) in zip(ups, [s for s in steps if s[0] != "record"]):
        if kind == "good":
            assert u.policy.obs_dim == OBS
        else:
            with pytest.raises(CodecError):
                _ = u.policy
    feed.close()


# --- the Faust app (broker-less) -----------------------------------------------------------------

@pytest.fixture(scope="module")
def streams_app():
    from config import PrepareConfig
    from streams.faust_app import StreamsApp, StreamsSettings
    from streams.processors.pipeline import Prepare

    prepare = Prepare.from_config(PrepareConfig(importance=False))  # each example sets its own
    return StreamsApp(StreamsSettings(app_id=f"fuzz-{uuid.uuid4().hex[:8]}"), prepare=prepare, metrics=None)


def _fresh_prepare(sa):
    from config import PrepareConfig
    from streams.processors.pipeline import Prepare

    def factory(pv):
        return lambda obs, act: np.full(obs.shape[:2], -1.5, np.float32)

    sa.prepare = Prepare.from_config(PrepareConfig(max_versions=1000, max_ms=None), factory)
    sa.core.ledger.clear()
    sa.acks.forget(range(64))  # each example's test channel numbers its offsets from 0 again
    sent: list[tuple[str, bytes | None, bytes]] = []

    async def send(topic, key, value, headers):
        sent.append((topic, key, value))

    sa.send = send
    return sent


@FUZZ
@given(steps=plan(bad_samples()))
def test_faust_sample_agent_dead_letters_exactly_the_bad_records(streams_app, steps):
    sa = streams_app
    sent = _fresh_prepare(sa)
    bad, seq = [], 0

    async def scenario():
        nonlocal seq
        async with sa.samples_agent.test_context() as agent:
            for i, (kind, b) in enumerate(steps):
                if kind == "good":
                    await agent.put(CODEC.encode(sample_batch("a", seq)), key=b"a")
                    seq += 1
                else:
                    await agent.put(b[0], key=b"a")
                    bad.append(b[1])

    asyncio.run(scenario())
    dead = [CODEC.decode(v, DeadLetter) for t, _, v in sent if t == DEADLETTER]
    assert len(dead) == len(bad) and all(d.reason and d.topic == SAMPLES_RAW for d in dead)
    assert sum(t == SAMPLES_PREPARED for t, _, _ in sent) == seq
    assert len(sa.core.ledger) == 0


@FUZZ
@given(steps=plan(bad_policy_records()))
def test_faust_policy_reader_skips_bad_records(streams_app, steps):
    sa = streams_app
    sent = _fresh_prepare(sa)
    bad, version = [], -1
    skipped, dead_lettered = sa.skipped, sa.dead_lettered  # the app lives across examples

    async def scenario():
        nonlocal version
        for i, (kind, b) in enumerate(steps):
            if kind == "good":
                version += 1
                value = CODEC.encode(policy_version(version))
            else:
                value = b[0]
                bad.append(i)
            msg = SimpleNamespace(topic=POLICY_VERSIONS, partition=0, offset=i, key=b"policy", value=value,
                                  headers=())
            await sa.on_policy_message(msg)

    asyncio.run(scenario())
    assert [t for t, _, _ in sent if t == DEADLETTER] == []  # the learner dead-letters them
    assert sa.skipped - skipped == len(bad) and sa.dead_lettered == dead_lettered
    assert sa.prepare.stats.latest_version == (version if version >= 0 else None)
