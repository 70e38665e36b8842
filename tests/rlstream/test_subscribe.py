"""PolicyFeed / follow: replay from a version then follow live, newest-first start, lazy
weights, count/idle stops, dead-lettering, group resume; one run on the real Kafka broker."""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest

from logtools.subscribe import PolicyFeed, follow, newest_version
from streams.topics import DEADLETTER, POLICY_VERSIONS


def take_then_publish(feed, n_before, publish, count, idle_timeout=30.0):
    """``n_before`` updates from the feed, then ``publish()`` (the feed is positioned by now, so
    the new version is live, whatever the timing), then the rest up to ``count``; the feed ends
    there (``count``), and ``idle_timeout`` only bounds a wait for something missing."""
    it = feed.updates(count=count, idle_timeout=idle_timeout)
    got = [next(it) for _ in range(n_before)]
    publish()
    got.extend(it)
    return got


def test_from_version_replays_then_follows_live(events, pv):
    published = {v: pv.publish(events, v) for v in range(6)}
    with PolicyFeed(events, from_version=3) as feed:
        got = take_then_publish(feed, 3, lambda: pv.publish(events, 6), count=4)
    assert [u.version for u in got] == [3, 4, 5, 6]
    assert [u.parent_version for u in got] == [2, 3, 4, 5]
    assert got[0].metrics == {"loss": 3.0} and got[0].algo == "ppo"
    assert got[3].latency_s() is not None and got[3].latency_s() >= 0.0
    for u in got[:3]:
        assert pv.same_weights(u.policy, published[u.version])
    assert not pv.same_weights(got[0].policy, got[1].policy)


def test_default_starts_at_the_newest(events, pv):
    for v in range(6):
        pv.publish(events, v)
    pv.publish(events, 0, policy_id="other")  # another policy after ours: still finds 5
    with PolicyFeed(events) as feed:
        got = [u.version for u in take_then_publish(feed, 1, lambda: pv.publish(events, 6), count=2)]
    assert got == [5, 6]
    assert newest_version(events).version == 6


def test_policy_is_loaded_lazily_and_once(events, pv):
    pv.publish(events, 0)
    with PolicyFeed(events, from_version=0) as feed:
        (u,) = feed.poll(1.0)
    assert "policy" not in u._cache
    assert u.policy is u.policy
    assert u.weights_size == len(u.event.weights) and len(u.weights_sha256) == 64


def test_idle_timeout_and_stop_end_the_feed(events, pv):
    pv.publish(events, 0)
    with PolicyFeed(events, from_version=0) as feed:
        t0 = time.monotonic()
        assert [u.version for u in feed.updates(idle_timeout=0.5)] == [0]
        assert time.monotonic() - t0 >= 0.5  # it waited out the idle time (a busy machine only adds)
        pv.publish(events, 1)
        stop, seen = threading.Event(), []
        # no idle timeout: only the stop the callback sets ends this run
        assert feed.run(lambda u: (seen.append(u.version), stop.set()), stop=stop) == 1 and seen == [1]
        pv.publish(events, 2)
        assert feed.run(seen.append, stop=stop) == 0 and seen == [1]  # a set stop: nothing more
        stop.clear()
        assert [u.version for u in feed.updates(idle_timeout=0.3)] == [2]


def test_versions_never_go_backwards_and_junk_is_skipped(events, pv):
    pv.publish(events, 0)
    pv.publish(events, 1)
    events.bus.produce(POLICY_VERSIONS, b"not an event", key=b"policy")
    pv.publish(events, 1)  # a duplicate
    pv.publish(events, 2)
    with PolicyFeed(events, from_version=0) as feed:
        got = [u.version for u in feed.updates(idle_timeout=0.3)]
        assert got == [0, 1, 2]
        assert feed.skipped == 1 and feed.undecodable == 1
    assert list(events.bus.read_all(DEADLETTER)) == []  # the learner dead-letters policy records
    assert events.dead_letters.skipped == {(POLICY_VERSIONS, "corrupt"): 1}


def test_group_resumes_after_the_last_handled_update(events, pv):
    for v in range(5):
        pv.publish(events, v)
    with PolicyFeed(events, from_version=1, group="eval") as feed:
        assert feed.run(lambda u: None, count=2) == 2  # handles 1, 2
    with PolicyFeed(events, from_version=1, group="eval") as feed:
        assert [u.version for u in feed.updates(idle_timeout=0.3)] == [3, 4]
    # A new group with from_version=None starts at the newest; an old one resumes.
    pv.publish(events, 5)
    with PolicyFeed(events, group="fresh") as feed:
        assert [u.version for u in feed.updates(idle_timeout=0.3)] == [5]
    with PolicyFeed(events, group="eval") as feed:
        assert [u.version for u in feed.updates(idle_timeout=0.3)] == [5]


def test_follow_yields_json_lines_without_weights(events, pv):
    for v in range(6):
        pv.publish(events, v)
    events.bus.produce(POLICY_VERSIONS, b"\xc3\x01garbage!", key=b"policy")
    pv.publish(events, 6)
    lines = list(follow(events.bus, "policies", from_version=3, count=5, idle_timeout=30.0))
    assert [ln.get("version") for ln in lines] == [3, 4, 5, None, 6]
    assert lines[3]["event"] == "undecodable" and lines[3]["reason"] == "unknown_schema"
    text = json.dumps(lines)
    assert "weights\": {" in text and len(text) < 20_000  # sizes and hashes, never the bytes
    assert lines[0]["weights"]["bytes"] > 1000 and len(lines[0]["weights"]["sha256"]) == 64
    # idle timeout stops it, and dead letters come from the beginning
    assert [ln["version"] for ln in follow(events.bus, "policies", idle_timeout=0.3)] == [6]
    dls = list(follow(events.bus, "deadletters", idle_timeout=0.3))
    assert dls == []  # follow reports, it does not dead-letter
    with pytest.raises(ValueError):
        next(follow(events.bus, "nonsense"))


@pytest.mark.kafka
def test_from_version_on_kafka(kafka_bootstrap, pv):
    from schemas.codec import Codec
    from streams.bus.kafka import KafkaBus
    from streams.events import EventBus
    from streams.topics import TopicSpec

    bus = KafkaBus(kafka_bootstrap, client_id="rlstream-test-subscribe",
                   consumer_config={"heartbeat.interval.ms": 500, "session.timeout.ms": 6000})
    topic = f"t-subscribe-{uuid.uuid4().hex[:10]}"
    bus.create_topics([TopicSpec(topic, key="policy_id", config={"max.message.bytes": str(16 << 20)})])
    events = EventBus(bus, Codec())
    try:
        for v in range(6):
            pv.publish(events, v, topic=topic)
        with PolicyFeed(events, from_version=3, topic=topic) as feed:
            got = take_then_publish(feed, 3, lambda: pv.publish(events, 6, topic=topic), count=4, idle_timeout=60.0)
        assert [u.version for u in got] == [3, 4, 5, 6]
        with PolicyFeed(events, topic=topic) as feed:
            assert [u.version for u in feed.updates(count=1, idle_timeout=15.0)] == [6]
        group = f"g-{uuid.uuid4().hex[:8]}"
        with PolicyFeed(events, from_version=2, group=group, topic=topic) as feed:
            assert feed.run(lambda u: None, count=2) == 2  # 2, 3
        with PolicyFeed(events, from_version=2, group=group, topic=topic) as feed:
            assert [u.version for u in feed.updates(count=3, idle_timeout=15.0)] == [4, 5, 6]
    finally:
        bus.close()


def test_follow_steps_and_dead_letters(events, pv):
    from schemas.events import GradientStep, now_ms
    from streams.topics import LEARNER_STEPS

    for s in range(4):
        events.publish(LEARNER_STEPS, GradientStep(
            learner_id="learner-0", step=s + 1, from_version=s, to_version=s + 1, algo="ppo",
            losses={"loss_policy": 0.1 * s}, grad_norm=1.0, batch_ids=["a", "b"], num_samples=64,
            started_at_ms=now_ms(), finished_at_ms=now_ms()), key="learner-0")
    steps = list(follow(events.bus, "steps", from_version=2, idle_timeout=0.3))
    assert [s["to_version"] for s in steps] == [2, 3, 4] and steps[0]["batches"] == 2
    assert [s["to_version"] for s in follow(events.bus, "steps", idle_timeout=0.3)] == [4]
    events.bus.produce(POLICY_VERSIONS, b"junk", key=b"policy")
    with PolicyFeed(events, from_version=0) as feed:  # counts the junk
        assert feed.poll(0.5) == [] and feed.undecodable == 1
    owner = events.consumer(None, [POLICY_VERSIONS], stage="learner", start="earliest")
    assert owner.poll(0.5) == []  # the learner's reader dead-letters it
    owner.close()
    (dl,) = follow(events.bus, "deadletters", count=1, idle_timeout=2.0)
    assert dl["event"] == "dead_letter" and dl["topic"] == POLICY_VERSIONS and dl["reason"] == "corrupt"
    assert dl["value"] == {"bytes": 4, "sha256": dl["value"]["sha256"]} and dl["key"] == "policy"
    json.dumps(dl)
    with pytest.raises(ValueError, match="from-version"):
        next(follow(events.bus, "deadletters", from_version=1))
