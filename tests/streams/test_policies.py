"""streams.policies: the one loader (inline and claim-checked weights) and the one follower with
its start rules (newest of this policy, K back, from version V), on the memory bus and on the
real Kafka broker (a namespace of its own); the window of recent versions; claim-checked
versions get importance weights in both processor shells and are adopted by an actor (Redis)."""

from __future__ import annotations

import asyncio
import threading
import uuid

import numpy as np
import pytest
import torch

from actor.actor import Actor, ActorConfig
from actor.policy_client import PolicySubscriber
from agents.networks import Policy
from schemas.codec import Codec
from schemas.events import PolicyVersion, PreparedBatch
from streams.bus.memory import MemoryBus
from streams.bus.namespaced import NamespacedBus
from streams.events import EventBus
from streams.policies import (
    BlobWriteError,
    FetchRetry,
    PolicyFollower,
    PolicyLoadError,
    PolicyLogpFn,
    RedisBlobStore,
    SharedWeights,
    StartRule,
    load_policy,
    make_policy_version,
    publish_policy_version,
)
from config import PrepareConfig
from streams.processors.pipeline import Prepare
from streams.topics import POLICY_VERSIONS, SAMPLES_PREPARED, SAMPLES_RAW, Namespace
from tests.conftest import TEST_CONSUMER_CONFIG
from tests.ops.conftest import redis_server_url  # noqa: F401  (fixture)
from tests.streams.test_processors_pipeline import make_batch
from tests.support import wait_for

torch.set_num_threads(1)

OBS, ACT = 3, 2


def policy(seed: int, obs: int = OBS, act: int = ACT) -> Policy:
    torch.manual_seed(seed)
    p = Policy(obs, act, hidden=(8,))
    with torch.no_grad():
        for prm in p.parameters():
            prm.add_(0.3 * torch.randn_like(prm))
    return p.eval()


def version(v: int, policy_id: str = "p", blobs=None, p: Policy | None = None) -> PolicyVersion:
    """Version ``v`` of ``policy_id``; with ``blobs``, its weights go by claim check."""
    return make_policy_version(p or policy(v), policy_id=policy_id, version=v, parent_version=None,
                               learner_id="L", algo="ppo", blob_store=blobs,
                               inline_limit=0 if blobs is not None else 4 << 20)


def publish(events: EventBus, *pvs: PolicyVersion) -> None:
    for pv in pvs:
        publish_policy_version(events, pv)


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(params=["memory", pytest.param("kafka", marks=pytest.mark.kafka)])
def events(request):
    """Typed events over a memory bus, or over the Kafka broker in a namespace of this test."""
    if request.param == "memory":
        bus = MemoryBus()
        bus.create_topics(Namespace().topics())
        yield EventBus(bus, Codec())
        return
    from streams.bus.kafka import KafkaBus

    inner = KafkaBus(request.getfixturevalue("kafka_bootstrap"), client_id="rlstream-test",
                     consumer_config=TEST_CONSUMER_CONFIG)
    ns = Namespace(f"pol-{uuid.uuid4().hex[:10]}")
    bus = NamespacedBus(inner, ns)
    bus.create_topics(Namespace().topics())
    try:
        yield EventBus(bus, Codec())
    finally:
        inner.delete_topics([t.name for t in ns.topics()])
        inner.close()


@pytest.fixture
def blobs(redis_server_url):  # noqa: F811
    return RedisBlobStore(redis_server_url)


def drain(follower: PolicyFollower, want: int, timeout: float = 30.0) -> list[int]:
    """Versions handed out until ``want`` arrived (the deadline only bounds a missing one)."""
    got: list[int] = []
    wait_for(lambda: got.extend(u.version for u in follower.poll(0.2)) or len(got) >= want, timeout,
             f"{want} versions")
    return got


# -- start rules ------------------------------------------------------------------------------

def test_newest_starts_at_the_newest_version_of_this_policy(events):
    publish(events, *(version(v) for v in range(4)))
    publish(events, version(9, "other"), version(10, "other"))  # others after ours: still 3
    f = PolicyFollower(events, "p", StartRule.newest())
    try:
        assert drain(f, 1) == [3]
        publish(events, version(11, "other"), version(4))
        assert drain(f, 1) == [4] and f.ignored >= 1
    finally:
        f.close()


def test_back_k_takes_k_plus_one_records_of_this_policy_whatever_lies_between(events):
    for v in range(5):  # p0 o0 p1 o1 ...: K+1 records back from the end would hold only half of them
        publish(events, version(v), version(v, "other"))
    for k, want in ((2, [2, 3, 4]), (0, [4]), (10, [0, 1, 2, 3, 4])):
        f = PolicyFollower(events, "p", StartRule.back(k))
        try:
            assert drain(f, len(want)) == want
        finally:
            f.close()


def test_at_version_replays_from_v_then_follows(events):
    publish(events, *(version(v) for v in range(5)))
    f = PolicyFollower(events, "p", StartRule.at_version(2))
    try:
        assert drain(f, 3) == [2, 3, 4]
        publish(events, version(5))
        assert drain(f, 1) == [5]
    finally:
        f.close()


def test_the_follower_ignores_other_policies_and_counts_junk(events):
    publish(events, version(0), version(0, "other"), version(1, "other"))
    events.bus.produce(POLICY_VERSIONS, b"not an event", key=b"p")
    publish(events, version(1), version(1))  # a duplicate: versions never go backwards
    f = PolicyFollower(events, "p", StartRule.at_version(0), stage="actor-0")
    try:
        got = drain(f, 2)
        assert got == [0, 1]
        wait_for(lambda: f.poll(0.2) == [] and f.skipped == 1, 30, "the duplicate")
        assert f.ignored == 2 and f.undecodable == 1
        assert events.dead_letters.skipped  # an actor only counts it: the learner owns the dead letter
    finally:
        f.close()


def test_start_rules_are_checked():
    with pytest.raises(ValueError):
        StartRule.back(-1)
    with pytest.raises(ValueError):
        StartRule.at_version(-2)


# -- the loader --------------------------------------------------------------------------------

def test_one_loader_for_inline_and_claim_checked_weights(blobs):
    p = policy(7)
    inline, checked = version(7, p=p), version(7, blobs=blobs, p=p)
    assert checked.weights is None and checked.weights_ref is not None
    assert same(load_policy(inline), p) and same(load_policy(checked, blobs), p)
    assert same(load_policy(checked, lambda ref: blobs.get(ref.key)), p)  # a fetch function will do
    into = policy(1)
    assert load_policy(checked, blobs, into=into) is into and same(into, p)
    with pytest.raises(PolicyLoadError, match="no blob store"):
        load_policy(checked)
    with pytest.raises(PolicyLoadError, match="sha256"):
        load_policy(checked, lambda ref: b"x" * ref.size)
    other = version(1, p=policy(1, obs=5))  # another architecture: a new module, ``into`` untouched
    assert load_policy(other, into=into) is not into and same(into, p)


# -- claim-checked versions get importance weights and are adopted ---------------------------------

def _stale_batch(prepared: list[PreparedBatch]) -> PreparedBatch:
    (pb,) = prepared
    assert pb.current_version == 1 and pb.sample.policy_version == 0
    assert not np.allclose(pb.is_rho, 1.0)  # computed against version 1, not defaulted to ones
    return pb


def test_the_worker_shell_weights_a_batch_against_a_claim_checked_version(events, blobs):
    from streams.worker import PrepareWorker

    cfg = PrepareConfig(max_versions=4, max_ms=None, reorder_timeout_ms=10, policy_id="p", behaviour_cap=None)
    worker = PrepareWorker(events, Prepare.from_config(cfg, PolicyLogpFn.factory(blobs)), group="g")
    try:
        publish(events, version(0), version(1, blobs=blobs))
        wait_for(lambda: worker.step(0.2) >= 0 and worker.prepare.stats.latest_version == 1, 30, "version 1")
        b = make_batch("a", 0, version=0, created=0)
        events.publish(SAMPLES_RAW, b, key="a")
        events.flush()
        wait_for(lambda: worker.step(0.2) >= 0 and worker.published == 1, 30, "the prepared batch")
    finally:
        worker.close()
    prepared = [events.codec.decode(r.value) for r in events.bus.read_all(SAMPLES_PREPARED)]
    _stale_batch(prepared)
    assert worker.prepare.stats.is_version == 1 and worker.prepare.stats.policy_errors == 0


def test_the_faust_shell_fetches_claim_checked_weights_from_redis_url(monkeypatch, blobs):
    from dataclasses import replace

    from config import Environment
    from rlstream.wiring import build_faust_app
    from streams.settings import StreamsSettings

    monkeypatch.setenv("REDIS_URL", blobs.url)
    cfg = PrepareConfig(max_versions=4, max_ms=None, reorder_timeout_ms=10, policy_id="p", behaviour_cap=None)
    settings = StreamsSettings.from_environment(Environment.read())  # as the Faust entry point does
    sa = build_faust_app(replace(settings, app_id=f"test-{uuid.uuid4().hex[:8]}", prepare=cfg, raw_partitions=1),
                         metrics=None)
    # the app's own weights loader (from REDIS_URL), over a dict for the per-actor state: its Faust
    # table writes a changelog, which needs the running app this in-process test does not start
    sa.prepare, sa.actor_state = Prepare.from_config(cfg, sa.prepare.logp_factory), None
    sent: list[tuple[str, bytes]] = []

    async def capture(topic, key, value, headers):  # the app's output seam
        sent.append((topic, value))

    sa.send = capture
    codec = Codec()

    async def scenario():
        for off, pv in enumerate((version(0), version(1, blobs=blobs))):
            msg = type("Msg", (), dict(topic=POLICY_VERSIONS, partition=0, offset=off, key=b"p",
                                       value=codec.encode(pv), headers=()))
            await sa.on_policy_message(msg)
        async with sa.samples_agent.test_context() as agent:
            await agent.put(codec.encode(make_batch("a", 0, version=0, created=0)), key=b"a")

    asyncio.run(scenario())
    _stale_batch([codec.decode(v) for t, v in sent if t == SAMPLES_PREPARED])


def test_an_actor_adopts_a_claim_checked_version(events, blobs):
    p = policy(3, obs=3, act=1)
    publish(events, version(0, "other"), version(3, "policy", blobs=blobs, p=p), version(4, "other"))
    sub = PolicySubscriber(events, "policy", "actor-0", blob_store=blobs)  # newest of ITS policy: 3
    actor = Actor(ActorConfig(env_id="Pendulum-v1", num_envs=1, fragment_steps=8), sub, events)
    try:
        assert sub.wait_for(3, timeout=30.0) and same(sub.policy, p)
        batch = actor.step()
        assert batch.policy_version == 3
    finally:
        sub.close()


# -- weight sync: claim-check threshold, retried fetches, one fetch per process ------------------

class FlakyBlobs:
    """The real Redis store behind a fault: the first ``fail`` reads of a key in ``keys`` (None:
    every key; -1: every read) raise redis' TimeoutError, as a saturated Redis does."""

    def __init__(self, store: RedisBlobStore, fail: int = 0, keys: set[str] | None = None) -> None:
        self.store, self.url, self.fail, self.keys = store, store.url, fail, keys
        self.gets: list[str] = []

    def put(self, key: str, data: bytes) -> None:
        self.store.put(key, data)

    def get(self, key: str) -> bytes:
        import redis

        self.gets.append(key)
        if (self.keys is None or key in self.keys) and (self.fail < 0 or self.gets.count(key) <= self.fail):
            raise redis.exceptions.TimeoutError("Timeout reading from socket")
        return self.store.get(key)


FAST_RETRY = FetchRetry(attempts=3, base_s=0.01)


def test_weights_over_the_claim_check_threshold_go_to_a_configured_blob_store(blobs):
    p = policy(0)
    size = len(make_policy_version(p, policy_id="p", version=0, parent_version=None, learner_id="L",
                                   algo="ppo").weights)
    kw = {"policy_id": f"p-{uuid.uuid4().hex[:6]}", "version": 1, "parent_version": None, "learner_id": "L",
          "algo": "ppo"}
    assert make_policy_version(p, **kw, claim_check_above=size - 1).weights is not None  # no store: inline
    pv = make_policy_version(p, **kw, blob_store=blobs, claim_check_above=size - 1)
    assert pv.weights is None and pv.weights_ref.size == size and same(load_policy(pv, blobs), p)
    assert make_policy_version(p, **kw, blob_store=blobs, claim_check_above=size).weights is not None


def test_a_transient_blob_fetch_failure_is_retried_and_the_subscriber_adopts(events, blobs):
    p, pid = policy(5), f"policy-{uuid.uuid4().hex[:8]}"  # its own blob keys on the shared Redis
    flaky = FlakyBlobs(blobs, fail=2)
    publish(events, version(5, pid, blobs=blobs, p=p))
    sub = PolicySubscriber(events, pid, "actor-0", blob_store=flaky, shared=SharedWeights(), retry=FAST_RETRY)
    try:
        assert sub.wait_for(5, timeout=30.0) and same(sub.policy, p)
        assert len(flaky.gets) == 3 and sub.failed == 0
    finally:
        sub.close()


def test_a_blob_that_never_loads_leaves_the_subscriber_on_its_version_until_the_next(events, blobs):
    p1, p3, pid = policy(1), policy(3), f"policy-{uuid.uuid4().hex[:8]}"
    pv2 = version(2, pid, blobs=blobs)
    pv4 = version(4, pid, blobs=blobs)
    flaky = FlakyBlobs(blobs, fail=-1, keys={pv4.weights_ref.key})  # v4's reads always time out
    blobs._r.delete(pv2.weights_ref.key)  # v2's blob is gone (expired, evicted)
    publish(events, version(1, pid, blobs=blobs, p=p1))
    sub = PolicySubscriber(events, pid, "actor-0", blob_store=flaky, shared=SharedWeights(), retry=FAST_RETRY)
    try:
        assert sub.wait_for(1, timeout=30.0)
        for bad, want_failed in ((pv2, 1), (pv4, 2)):
            publish(events, bad)
            wait_for(lambda n=want_failed: sub.poll(0.2) or sub.failed >= n, 30, f"version {bad.version} tried")
            assert sub.version == 1 and same(sub.policy, p1) and sub.failed == want_failed
        assert flaky.gets.count(pv4.weights_ref.key) == FAST_RETRY.attempts  # bounded: then it gives up
        assert "not found" in str(sub.last_error) or "TimeoutError" in str(sub.last_error)
        publish(events, version(5, pid, blobs=blobs, p=p3))
        assert sub.wait_for(5, timeout=30.0) and same(sub.policy, p3)
    finally:
        sub.close()


def test_subscribers_of_one_process_share_one_fetch_and_the_decoded_weights(events, blobs):
    p, pid = policy(7), f"policy-{uuid.uuid4().hex[:8]}"
    counting = FlakyBlobs(blobs)
    shared = SharedWeights()
    publish(events, version(7, pid, blobs=blobs, p=p))
    subs = [PolicySubscriber(events, pid, f"actor-{i}", blob_store=counting, shared=shared) for i in range(4)]
    try:
        threads = [threading.Thread(target=s.wait_for, args=(7, 30.0)) for s in subs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(s.version == 7 and same(s.policy, p) for s in subs)
        assert len(counting.gets) == 1 and (shared.fills, shared.hits) == (1, 3)
        ptrs = {s.policy.net.actor_mean[0].weight.data_ptr() for s in subs}
        assert len(ptrs) == 1  # referenced, not copied per subscriber
    finally:
        for s in subs:
            s.close()


def test_a_shared_adoption_replaces_the_modules_tensors_and_never_writes_them(blobs):
    old, new = policy(1), policy(2)
    before = {k: v.clone() for k, v in old.state_dict().items()}
    held = old.net.actor_mean[0].weight  # what a snapshot of the previous version holds
    pv = version(2, f"p-{uuid.uuid4().hex[:6]}", blobs=blobs, p=new)
    loaded = load_policy(pv, blobs, into=old, shared=SharedWeights())
    assert loaded is old and same(loaded, new)
    assert torch.equal(held, before["net.actor_mean.0.weight"])


def test_a_claim_check_write_to_a_store_that_is_down_is_a_write_error_not_a_bad_record():
    """Publishing to an unreachable store fails after its retries with BlobWriteError, which is
    no CodecError: nothing may dead-letter it as a bad record; a read of the same store is a
    PolicyLoadError (the record's weights cannot load)."""
    import socket

    from schemas.errors import CodecError

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = RedisBlobStore(f"redis://127.0.0.1:{port}/0", timeout_s=1.0, retry=FetchRetry(attempts=2, base_s=0.01))
    with pytest.raises(BlobWriteError, match="writing claim-check key k .* failed 2 times") as e:
        store.put("k", b"x")
    assert not isinstance(e.value, CodecError)
    with pytest.raises(PolicyLoadError, match="reading k failed 2 times"):
        store.retry.call(lambda: store.get("k"), "reading k")
