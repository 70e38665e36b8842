"""The Faust shell, broker-less: agents driven with ``agent.test_context()``."""

from __future__ import annotations

from config import Environment

import asyncio
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from schemas.codec import Codec
from schemas.events import DeadLetter, PolicyVersion, PreparedBatch, SampleBatch
from streams.faust_app import StreamsApp, StreamsSettings, broker_urls, faust_credentials
from config import PrepareConfig
from streams.processors.pipeline import Prepare
from streams.topics import DEADLETTER, POLICY_VERSIONS, SAMPLES_PREPARED

torch.set_num_threads(1)
CODEC = Codec()
T, N, OBS, ACT = 4, 2, 3, 2


class Clock:
    def __init__(self, t: int = 1_000_000) -> None:
        self.t = t

    def __call__(self) -> int:
        return self.t


def make_batch(actor: str, seq: int, version: int, created: int, batch_id: str | None = None) -> SampleBatch:
    rng = np.random.default_rng(seq)
    return SampleBatch(
        batch_id=batch_id or f"{actor}-{seq}", actor_id=actor, seq=seq, env_id="Test-v0",
        policy_version=version, created_at_ms=created,
        obs=rng.standard_normal((T, N, OBS)).astype(np.float32),
        actions=rng.standard_normal((T, N, ACT)).astype(np.float32),
        rewards=np.zeros((T, N), np.float32), terminated=np.zeros((T, N), bool),
        truncated=np.zeros((T, N), bool), behaviour_logp=np.full((T, N), -1.5, np.float32),
        last_obs=np.zeros((N, OBS), np.float32), final_obs_index=np.zeros((0,), np.int64),
        final_obs=np.zeros((0, OBS), np.float32),
    )


BOOM = 12345.0  # obs of this value make the logp function below fail: a processor bug


def half_probability_logp(pv):
    """The processors' logp seam: the current policy is half as likely as the behaviour one."""
    def fn(obs, act):
        if (np.asarray(obs) == BOOM).any():
            raise RuntimeError("processor bug")
        return np.full(obs.shape[:2], -1.5 + np.log(0.5), np.float32)
    return fn


def streams_app(clock, factory=half_probability_logp):
    cfg = PrepareConfig(max_versions=2, max_ms=10_000, reorder_timeout_ms=500)
    prepare = Prepare.from_config(cfg, factory, clock=clock)
    sa = StreamsApp(StreamsSettings(app_id=f"test-{uuid.uuid4().hex[:8]}"), prepare=prepare, metrics=None)
    sent: list[tuple[str, bytes | None, bytes]] = []

    async def capture(topic, key, value, headers):  # StreamsApp.send: the output seam (no Kafka here)
        assert headers["rl-schema"]
        sent.append((topic, key, value))

    sa.send = capture
    return sa, sent


@pytest.fixture
def streams():
    clock = Clock()
    return (clock, *streams_app(clock))


def policy_msg(offset: int, value: bytes, partition: int = 0) -> SimpleNamespace:
    """A record of rl.policy.versions as the policy reader (aiokafka) hands it over."""
    return SimpleNamespace(topic=POLICY_VERSIONS, partition=partition, offset=offset, key=b"policy", value=value,
                           headers=())


def decoded(sent, topic, cls):
    return [CODEC.decode(v, cls) for t, _, v in sent if t == topic]


def test_agents_prepare_and_dead_letter(streams):
    clock, sa, sent = streams

    async def scenario():
        for v in range(4):
            await sa.on_policy_message(policy_msg(v, CODEC.encode(PolicyVersion("policy", v, clock.t, "L", "ppo"))))
        await sa.on_policy_message(policy_msg(4, b"not a policy"))
        await sa.on_policy_message(policy_msg(5, CODEC.encode(PolicyVersion("other", 99, clock.t, "L", "ppo"))))
        assert sa.prepare.stats.latest_version == 3 and sa.prepare.stats.policy_ignored == 1
        async with sa.samples_agent.test_context() as agent:
            for s in [0, 2, 1]:  # reordered
                await agent.put(CODEC.encode(make_batch("a", s, 3, clock.t)), key=b"a")
            await agent.put(CODEC.encode(make_batch("a", 1, 3, clock.t)), key=b"a")  # duplicate
            await agent.put(CODEC.encode(make_batch("a", 3, 0, clock.t)), key=b"a")  # 3 versions behind
            await agent.put(CODEC.encode(make_batch("a", 4, 2, clock.t)), key=b"a")  # off-policy, kept
            await agent.put(CODEC.encode(make_batch("a", 6, 3, clock.t)), key=b"a")  # gap at 5
            await agent.put(b"\x00garbage", key=b"a")
            assert len(sa.core.ledger) == 1
            clock.t += 500
            assert await sa.tick() == 1
            await agent.put(CODEC.encode(make_batch("a", 5, 3, clock.t - 500)), key=b"a")  # late now

    asyncio.run(scenario())
    prepared = decoded(sent, SAMPLES_PREPARED, PreparedBatch)
    dead = decoded(sent, DEADLETTER, DeadLetter)
    assert [p.sample.seq for p in prepared] == [0, 1, 2, 4, 6]
    off = prepared[3]
    assert off.staleness_versions == 1 and off.current_version == 3
    np.testing.assert_allclose(off.is_rho, 0.5, rtol=1e-6)
    assert sorted(d.reason for d in dead) == ["corrupt", "late", "stale_versions"]
    assert {d.topic for d in dead if d.reason == "corrupt"} == {"rl.samples.raw"}
    assert sa.skipped == 1  # the bad policy record: the learner dead-letters it
    stale = next(d for d in dead if d.reason == "stale_versions")
    assert CODEC.decode(stale.value, SampleBatch).seq == 3 and stale.error_class == "PolicyStalenessError"
    s = sa.prepare.stats
    assert s.drops == {"duplicate": 1, "stale_versions": 1, "corrupt": 1, "late": 1}
    assert s.emitted_batches == 5 and len(sa.core.ledger) == 0


def test_processor_error_does_not_stop_the_agent(streams):
    clock, sa, sent = streams
    bad = make_batch("bad", 0, 0, clock.t)
    bad = SampleBatch(**{**bad.__dict__, "obs": np.full_like(bad.obs, BOOM)})

    async def scenario():
        await sa.on_policy_message(policy_msg(0, CODEC.encode(PolicyVersion("policy", 1, clock.t, "L", "ppo"))))
        async with sa.samples_agent.test_context() as agent:  # version 0 behind 1: the logp fn runs
            await agent.put(CODEC.encode(bad), key=b"bad")
            await agent.put(CODEC.encode(make_batch("ok", 0, 0, clock.t)), key=b"ok")

    asyncio.run(scenario())
    assert [d.reason for d in decoded(sent, DEADLETTER, DeadLetter)] == ["processor_error"]
    assert [p.sample.actor_id for p in decoded(sent, SAMPLES_PREPARED, PreparedBatch)] == ["ok"]


def test_failed_publish_is_dead_lettered(streams):
    clock, sa, sent = streams
    ok_send = sa.send

    async def flaky(topic, key, value, headers):
        if topic == SAMPLES_PREPARED:
            raise RuntimeError("record too large")
        await ok_send(topic, key, value, headers)

    sa.send = flaky

    async def scenario():
        async with sa.samples_agent.test_context() as agent:
            await agent.put(CODEC.encode(make_batch("a", 0, 0, clock.t)), key=b"a")

    asyncio.run(scenario())
    assert [d.reason for d in decoded(sent, DEADLETTER, DeadLetter)] == ["processor_error"]


def test_revocation_forgets_held_batches(streams):
    clock, sa, sent = streams

    async def scenario():
        async with sa.samples_agent.test_context() as agent:
            await agent.put(CODEC.encode(make_batch("a", 3, 0, clock.t)), key=b"a")
            assert len(sa.core.ledger) == 1
            sa.on_revoked({0})
            assert len(sa.core.ledger) == 0 and sa.prepare.reorder.buffered == 0
            clock.t += 10_000
            assert await sa.tick() == 0

    asyncio.run(scenario())
    assert sent == []


def test_settings_and_credentials():
    s = StreamsSettings.from_environment(Environment({"KAFKA_BROKERS": "k1:9092, k2:9093", "RLSTREAM_METRICS_PORT": "9999"}))
    assert broker_urls(s.brokers) == ["kafka://k1:9092", "kafka://k2:9093"] and s.web_port == 9999
    assert StreamsSettings.from_environment(Environment({})).brokers == "127.0.0.1:9092"
    assert faust_credentials({}) is None
    c = faust_credentials({"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-512",
                           "sasl.username": "u", "sasl.password": "pw"})
    assert c.username == "u" and str(c.mechanism.value) == "SCRAM-SHA-512"
    c = faust_credentials({"security.protocol": "SSL"})
    assert c.context is not None
    with pytest.raises(ValueError):
        faust_credentials({"security.protocol": "BOGUS"})


def test_policy_reader_gets_the_same_security_settings():
    from streams.faust_app.clients import aiokafka_security

    assert aiokafka_security({}) == {}
    sasl = aiokafka_security({"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN",
                              "sasl.username": "svc", "sasl.password": "pw"})
    assert sasl == {"security_protocol": "SASL_PLAINTEXT", "ssl_context": None, "sasl_mechanism": "PLAIN",
                    "sasl_plain_username": "svc", "sasl_plain_password": "pw"}
    tls = aiokafka_security({"security.protocol": "SSL"})
    assert tls["security_protocol"] == "SSL" and tls["ssl_context"] is not None


def test_security_settings_come_from_the_bus_env(monkeypatch):
    pytest.importorskip("streams.bus.kafka")
    monkeypatch.setenv("RLSTREAM_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    monkeypatch.setenv("RLSTREAM_KAFKA_SASL_MECHANISM", "PLAIN")
    monkeypatch.setenv("RLSTREAM_KAFKA_SASL_USERNAME", "svc")
    monkeypatch.setenv("RLSTREAM_KAFKA_SASL_PASSWORD", "pw")
    s = StreamsSettings.from_environment(Environment.read())
    assert s.client_config["security.protocol"] == "SASL_PLAINTEXT"
    c = faust_credentials(s.client_config)
    assert c.username == "svc" and c.password == "pw"


def test_module_app_is_configured():
    import streams

    app = streams.app
    assert app.conf.id == "rlstream-streams"
    assert app.conf.topic_partitions == 1 and str(app.conf.store) == "memory:"
    names = {a.name for a in app.agents.values()}
    assert any(n.endswith("prepare-samples") for n in names)
    assert not any(POLICY_VERSIONS in str(t) for a in app.agents.values() for t in a.channel.topics), \
        "policy versions are read group-less by the follow-policies task, not by a group agent"
    from rlstream import entry

    assert entry._APP.policies_task in app._app_tasks
    assert app.conf.broker_commit_interval == 0.5


class FakePolicyConsumer:
    """The aiokafka consumer surface ``follow_policies`` uses, over a list of records."""

    def __init__(self, values: list[bytes], beginning: int = 0) -> None:
        self.values, self.beginning = values, beginning
        self._pos: dict = {}
        self.started = self.stopped = False

    async def start(self):
        self.started = True

    async def stop(self):
        self.stopped = True

    async def topics(self):
        return {POLICY_VERSIONS}

    def partitions_for_topic(self, topic):
        return {0} if topic == POLICY_VERSIONS and hasattr(self, "assigned") else None

    def assign(self, tps):
        self.assigned = list(tps)

    async def end_offsets(self, tps):
        return {tp: len(self.values) for tp in tps}

    async def beginning_offsets(self, tps):
        return {tp: self.beginning for tp in tps}

    def seek(self, tp, offset):
        self._pos[tp] = offset
        self.seeked = offset

    async def position(self, tp):
        return self._pos.get(tp, 0)

    async def getmany(self, timeout_ms=0, max_records=None):
        out = {}
        for tp, pos in self._pos.items():
            recs = [policy_msg(o, self.values[o]) for o in range(pos, len(self.values))]
            if recs:
                out[tp] = recs
                self._pos[tp] = len(self.values)
        if not out:
            await asyncio.sleep(timeout_ms / 1000)
        return out


def test_policy_reader_starts_k_plus_1_back_and_gates_samples(streams):
    """Every worker reads the versions group-less from end - (K + 1); samples wait until it has
    caught up, so the first batch is judged against the newest version."""
    clock, sa, sent = streams
    values = [CODEC.encode(PolicyVersion("policy", v, clock.t, "L", "ppo")) for v in range(10)]
    fake = FakePolicyConsumer(values)

    async def scenario():
        reader = asyncio.create_task(sa.follow_policies(fake))
        async with sa.samples_agent.test_context() as agent:
            await agent.put(CODEC.encode(make_batch("a", 0, 6, clock.t)), key=b"a")  # 3 behind 9: stale (K=2)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader

    asyncio.run(scenario())
    assert fake.seeked == 10 - 3 and fake.stopped
    assert sa.prepare.stats.policy_versions == 3 and sa.prepare.stats.latest_version == 9
    assert [d.reason for d in decoded(sent, DEADLETTER, DeadLetter)] == ["stale_versions"]


def test_a_policy_version_that_does_not_build_is_skipped_and_the_previous_one_used():
    """The real logp factory (``PolicyLogpFn.from_policy_version``) over real weights; version 3's
    weights are not safetensors."""
    from agents.networks import Policy
    from schemas.weights import encode_weights
    from streams.policies import PolicyLogpFn

    clock = Clock()
    sa, sent = streams_app(clock, PolicyLogpFn.from_policy_version)
    torch.manual_seed(0)
    weights = encode_weights(Policy(OBS, ACT, hidden=(8,)).state_dict(), {"obs_dim": OBS, "act_dim": ACT, "hidden": [8]})

    def version(v: int) -> bytes:
        w = weights if v < 3 else b"\x08" + b"\x00" * 7 + b"not safetensors"
        return CODEC.encode(PolicyVersion("policy", v, clock.t, "L", "ppo", weights=w))

    async def scenario():
        for v in range(4):
            await sa.on_policy_message(policy_msg(v, version(v)))
        async with sa.samples_agent.test_context() as agent:
            await agent.put(CODEC.encode(make_batch("a", 0, 1, clock.t)), key=b"a")  # needs IS

    asyncio.run(scenario())
    prepared = decoded(sent, SAMPLES_PREPARED, PreparedBatch)
    assert [p.current_version for p in prepared] == [2]  # the newest version that builds
    assert decoded(sent, DEADLETTER, DeadLetter) == [] and sa.skipped == 1  # the learner dead-letters it


class FlowConsumer:
    """The consumer seam of ``StreamsApp.watch_gaps``: a highwater, and flow stops and seeks recorded."""

    def __init__(self, end: int) -> None:
        self.end, self.calls = end, []

    def highwater(self, tp):
        return self.end

    def stop_flow(self):
        self.calls.append("stop_flow")

    def resume_flow(self):
        self.calls.append("resume_flow")

    async def seek_wait(self, offsets):
        self.calls.extend(("seek", tp.partition, o) for tp, o in offsets.items())


@pytest.mark.parametrize("settling", [None, "rebalancing", "in_recovery"])
def test_the_gap_watch_rewinds_a_stalled_partition_only_once_the_app_is_settled(streams, settling):
    """A partition whose records stopped below its end is sought back to the next offset
    expected; while Faust rebalances or recovers its table (raw partitions paused on purpose)
    nothing is rewound, since stopping the flow then drops the changelog records recovery
    waits for, and the stall clock starts again."""
    import time

    _, sa, _ = streams
    consumer = sa.app.consumer = FlowConsumer(end=10)
    sa.partitions = {0}
    sa.acks.expect(0, 4)
    sa._arrived_at[0] = time.monotonic() - 10 * sa.settings.gap_stall_s
    if settling:
        setattr(sa.app, settling, True)
    before = time.monotonic()
    n = asyncio.run(sa.watch_gaps())
    if settling:
        assert (n, consumer.calls) == (0, [])
        assert sa._arrived_at[0] >= before  # the clock restarted (during the call, not before it)
    else:
        assert (n, consumer.calls) == (1, ["stop_flow", ("seek", 0, 4), "resume_flow"])
