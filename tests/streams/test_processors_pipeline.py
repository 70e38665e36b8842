"""Prepare pipeline and PrepareWorker end to end on the memory bus."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.codec import Codec
from schemas.events import DeadLetter, PolicyVersion, PreparedBatch, SampleBatch
from schemas.weights import encode_weights
from streams.bus.memory import MemoryBus
from streams.events import EventBus
from streams.policies import PolicyLogpFn
from config import PrepareConfig
from streams.processors.pipeline import Prepare, Rejection
from streams.topics import DEADLETTER, POLICY_VERSIONS, SAMPLES_PREPARED, SAMPLES_RAW, all_topics
from streams.worker import PrepareWorker
from tests.support import wait_for

torch.set_num_threads(1)

OBS, ACT, T, N = 3, 2, 4, 2
CODEC = Codec()


class Clock:
    def __init__(self, t: int = 1_000_000) -> None:
        self.t = t

    def __call__(self) -> int:
        return self.t


def make_batch(actor: str, seq: int, version: int, created: int, batch_id: str | None = None,
               env_id: str = "Test-v0", seed: int | None = None) -> SampleBatch:
    rng = np.random.default_rng(seq * 1009 + sum(map(ord, actor)) if seed is None else seed)
    return SampleBatch(
        batch_id=batch_id or f"{actor}-{seq}", actor_id=actor, seq=seq, env_id=env_id,
        policy_version=version, created_at_ms=created,
        obs=rng.standard_normal((T, N, OBS)).astype(np.float32),
        actions=rng.standard_normal((T, N, ACT)).astype(np.float32),
        rewards=rng.standard_normal((T, N)).astype(np.float32), terminated=np.zeros((T, N), bool),
        truncated=np.zeros((T, N), bool), behaviour_logp=rng.uniform(-4, -1, (T, N)).astype(np.float32),
        last_obs=np.zeros((N, OBS), np.float32), final_obs_index=np.zeros((0,), np.int64),
        final_obs=np.zeros((0, OBS), np.float32),
    )


def policy_version(version: int, created: int, seed: int | None = None) -> PolicyVersion:
    from agents.networks import Policy

    torch.manual_seed(version if seed is None else seed)
    p = Policy(OBS, ACT, hidden=(8,))
    with torch.no_grad():
        for prm in p.net.actor_mean.parameters():
            prm.add_(0.3 * torch.randn_like(prm))
    w = encode_weights(p.state_dict(), {"obs_dim": OBS, "act_dim": ACT, "hidden": [8]})
    return PolicyVersion("policy", version, created, "L", "ppo", weights=w)


def read(bus: MemoryBus, topic: str, cls):
    return [CODEC.decode(r.value, cls) for r in bus.read_all(topic)]


@pytest.fixture
def setup():
    clock = Clock()
    bus = MemoryBus()
    bus.create_topics(all_topics())
    events = EventBus(bus)
    cfg = PrepareConfig(max_versions=2, max_ms=10_000, reorder_window=8, reorder_timeout_ms=500,
                        behaviour_cap=None)
    prepare = Prepare.from_config(cfg, PolicyLogpFn.from_policy_version, clock=clock)
    return clock, bus, events, prepare


class TestPrepare:
    def test_pure_pipeline_outputs(self):
        clock = Clock()
        calls = []

        def factory(pv):
            calls.append(pv.version)
            return lambda obs, act: np.full(obs.shape[:2], -2.0, np.float32)

        prep = Prepare.from_config(PrepareConfig(max_versions=1, max_ms=None, behaviour_cap=None),
                                   factory, clock=clock)
        for v in range(4):
            prep.on_policy(PolicyVersion("policy", v, 0, "L", "ppo", weights=b""))
        assert calls == []  # lazy
        b = make_batch("a", 0, 2, clock.t)
        (out,) = prep.push(b, 0, 7)
        assert isinstance(out, PreparedBatch) and out.current_version == 3 and out.staleness_versions == 1
        assert (out.source_partition, out.source_offset) == (0, 7)
        np.testing.assert_allclose(out.is_rho, np.minimum(1.0, np.exp(-2.0 - b.behaviour_logp)), rtol=1e-5)
        (out,) = prep.push(make_batch("a", 1, 3, clock.t))
        assert (out.is_rho == 1).all() and calls == [3]
        (out,) = prep.push(make_batch("a", 2, 1, clock.t))
        assert isinstance(out, Rejection) and out.reason == "stale_versions" and out.dead_letter
        (out,) = prep.push(make_batch("a", 2, 3, clock.t))  # same batch_id as the stale one
        assert out.reason == "duplicate" and not out.dead_letter
        s = prep.stats
        assert s.emitted_batches == 2 and s.drops == {"stale_versions": 1, "duplicate": 1}
        assert s.is_computed_batches == 1 and s.is_onpolicy_batches == 1 and s.freshness == pytest.approx(2 / 3)
        assert s.as_dict()["lag_versions"]["max"] == 2

    def test_bad_policy_falls_back_and_logp_errors_are_isolated(self):
        clock = Clock()
        good = lambda obs, act: np.full(obs.shape[:2], -1.0, np.float32)  # noqa: E731

        def factory(pv):
            if pv.version == 2:
                raise ValueError("broken weights")
            if pv.version == 3:
                def boom(obs, act):
                    if obs.shape[2] != OBS:
                        raise RuntimeError("shape")
                    return good(obs, act)
                return boom
            return good

        prep = Prepare.from_config(PrepareConfig(max_versions=5, max_ms=None), factory, clock=clock)
        prep.on_policy(PolicyVersion("policy", 1, 0, "L", "ppo"))
        prep.push(make_batch("a", 0, 0, clock.t))  # builds v1
        prep.on_policy(PolicyVersion("policy", 2, 0, "L", "ppo"))
        (out,) = prep.push(make_batch("a", 1, 0, clock.t))
        assert isinstance(out, PreparedBatch) and out.current_version == 1  # fell back to v1
        assert prep.stats.policy_errors == 1 and "broken" in prep.stats.last_policy_error
        (out,) = prep.push(make_batch("a", 2, 2, clock.t))  # behaviour newer than the usable policy
        assert isinstance(out, PreparedBatch) and (out.is_rho == 1).all()
        prep.on_policy(PolicyVersion("policy", 3, 0, "L", "ppo"))
        bad = make_batch("a", 3, 0, clock.t)
        bad = SampleBatch(**{**bad.__dict__, "obs": np.zeros((T, N, OBS + 1), np.float32),
                             "last_obs": np.zeros((N, OBS + 1), np.float32)})
        outs = prep.push(bad) + prep.push(make_batch("a", 4, 0, clock.t))
        assert [type(o).__name__ for o in outs] == ["Rejection", "PreparedBatch"]
        assert outs[0].reason == "processor_error" and isinstance(outs[0].error, RuntimeError)

    def test_no_policy_factory_means_unit_weights(self):
        prep = Prepare.from_config(PrepareConfig(importance=False, max_versions=10))
        prep.on_policy(PolicyVersion("policy", 5, 0, "L", "ppo"))
        (out,) = prep.push(make_batch("a", 0, 2, 10**15))
        assert (out.is_rho == 1).all() and out.current_version == 5 and out.staleness_versions == 3

    def test_policy_id_filter_and_algo_defaults(self):
        cfg = PrepareConfig.for_algo("grpo", policy_id="main")
        assert cfg.max_versions == 1 and cfg.policy_id == "main"
        prep = Prepare.from_config(cfg)
        assert prep.on_policy(PolicyVersion("other", 9, 0, "L", "ppo")) is False
        assert prep.stats.policy_ignored == 1 and prep.stats.latest_version is None


class TestWorker:
    def test_end_to_end_counts_match_injected(self, setup):
        clock, bus, events, prepare = setup
        now = clock.t
        for v in range(4):
            events.publish(POLICY_VERSIONS, policy_version(v, now - 1000 + v), key="p")
        latest = 3
        worker = PrepareWorker(events, prepare)
        sent = []

        def send(b: SampleBatch):
            sent.append(b)
            events.publish(SAMPLES_RAW, b, key=b.actor_id)

        # actor r: reordered
        for s in [0, 2, 1, 3, 5, 4, 6, 9, 8, 7]:
            send(make_batch("r", s, latest, now))
        # actor d: duplicates of seq 1 and 3
        for s in [0, 1, 2, 1, 3, 3, 4]:
            send(make_batch("d", s, latest, now))
        # actor l: seq 2 arrives after the gap timed out
        for s in [0, 1, 3, 4]:
            send(make_batch("l", s, latest, now))
        bus.produce(SAMPLES_RAW, b"garbage", key=b"x")
        while worker.step(0):
            pass
        assert prepare.reorder.buffered == 2  # l3, l4 wait for l2
        clock.t += 500
        worker.step(0)
        send(make_batch("l", 2, latest, now))
        # actor s: stale by versions, stale by time, and one off-policy batch within K
        send(make_batch("s", 0, latest - 3, clock.t))
        send(make_batch("s", 1, latest, clock.t - 10_001))
        off = make_batch("s", 2, latest - 1, clock.t)
        send(off)
        while worker.step(0):
            pass

        prepared = read(bus, SAMPLES_PREPARED, PreparedBatch)
        dead = read(bus, DEADLETTER, DeadLetter)
        by_actor: dict[str, list[int]] = {}
        for p in prepared:
            by_actor.setdefault(p.sample.actor_id, []).append(p.sample.seq)
        assert by_actor == {"r": list(range(10)), "d": [0, 1, 2, 3, 4], "l": [0, 1, 3, 4], "s": [2]}
        assert sorted(d.reason for d in dead) == ["corrupt", "late", "stale_ms", "stale_versions"]
        s = prepare.stats
        assert s.drops == {"duplicate": 2, "corrupt": 1, "late": 1, "stale_versions": 1, "stale_ms": 1}
        assert s.emitted_batches == 20 == len(prepared)
        assert s.received_batches + s.drops["corrupt"] == s.emitted_batches + s.dropped_batches + s.reorder.buffered
        assert s.reorder.skipped_seqs == 1 and s.reorder.timeouts == 1
        assert s.is_computed_batches == 1 and s.is_onpolicy_batches == 19
        assert worker.published == 20 and worker.dead_lettered == 4
        # late / stale dead letters carry the original bytes and offsets
        late = next(d for d in dead if d.reason == "late")
        assert CODEC.decode(late.value, SampleBatch).seq == 2 and late.topic == SAMPLES_RAW
        # IS weights of the off-policy batch, by hand with v3's policy
        pb = next(p for p in prepared if p.sample.actor_id == "s")
        fn = PolicyLogpFn.from_policy_version(policy_version(3, 0))
        ratio = np.exp(fn(off.obs, off.actions).astype(np.float64) - off.behaviour_logp)
        np.testing.assert_allclose(pb.is_rho, np.minimum(1.0, ratio), rtol=1e-5)
        assert pb.current_version == 3 and pb.staleness_versions == 1
        # everything committed
        assert worker.samples.raw.committed() == {(SAMPLES_RAW, 0): bus.end_offsets(SAMPLES_RAW)[0]}
        worker.close()

    def test_commit_stops_at_held_batches_and_restart_redelivers(self, setup):
        clock, bus, events, prepare = setup
        w1 = PrepareWorker(events, prepare)
        for s in [0, 2, 3]:
            events.publish(SAMPLES_RAW, make_batch("x", s, 0, clock.t), key="x")
        while w1.step(0):
            pass
        assert w1.samples.raw.committed() == {(SAMPLES_RAW, 0): 1}  # x2 (offset 1) is held
        w1.close()  # crash: no drain
        prep2 = Prepare.from_config(PrepareConfig(reorder_timeout_ms=500, behaviour_cap=None), clock=clock)
        w2 = PrepareWorker(events, prep2)
        events.publish(SAMPLES_RAW, make_batch("x", 1, 0, clock.t), key="x")
        while w2.step(0):
            pass
        clock.t += 500
        w2.step(0)
        seqs = [p.sample.seq for p in read(bus, SAMPLES_PREPARED, PreparedBatch)]
        assert seqs == [0, 1, 2, 3]
        assert w2.samples.raw.committed() == {(SAMPLES_RAW, 0): 4}
        w2.close()

    def test_run_stops_and_drains(self, setup):
        clock, bus, events, prepare = setup
        worker = PrepareWorker(events, prepare)
        events.publish(SAMPLES_RAW, make_batch("y", 0, 0, clock.t), key="y")
        events.publish(SAMPLES_RAW, make_batch("y", 5, 0, clock.t), key="y")
        stop = threading.Event()
        th = threading.Thread(target=worker.run, args=(stop, 0.01, True))
        th.start()
        wait_for(lambda: prepare.stats.received_batches >= 2, 60, "the worker thread to receive both batches",
                 every=0.01)
        stop.set()
        th.join(5)
        assert not th.is_alive()
        assert [p.sample.seq for p in read(bus, SAMPLES_PREPARED, PreparedBatch)] == [0, 5]

    def test_bad_policy_record_is_skipped_and_counted(self, setup):
        clock, bus, events, prepare = setup
        # the reader starts K + 1 = 3 versions of its policy back, so it reads the bad record between them
        events.publish(POLICY_VERSIONS, policy_version(0, clock.t), key="p")
        bus.produce(POLICY_VERSIONS, b"\xc3\x01junkjunkjunk")
        events.publish(POLICY_VERSIONS, policy_version(1, clock.t), key="p")
        worker = PrepareWorker(events, prepare)
        worker.step(0)
        assert prepare.stats.latest_version == 1 and prepare.stats.policy_errors == 1
        assert list(read(bus, DEADLETTER, DeadLetter)) == [] and worker.skipped == 1  # the learner's to dead-letter
        assert events.dead_letters.skipped == {(POLICY_VERSIONS, "unknown_schema"): 1}


# --- hypothesis: malformed / mutated records ------------------------------------------------

def _mutations():
    good = st.builds(lambda a, s, v: ("good", a, s, v), st.sampled_from(["a", "b"]), st.integers(0, 6),
                     st.integers(0, 3))
    flip = st.builds(lambda a, s, i, x: ("flip", a, s, i, x), st.sampled_from(["a", "b"]), st.integers(0, 6),
                     st.integers(0, 10**6), st.integers(1, 255))
    trunc = st.builds(lambda s, k: ("trunc", s, k), st.integers(0, 6), st.integers(0, 10**6))
    noise = st.builds(lambda b: ("noise", b), st.binary(max_size=64))
    kinds = st.sampled_from(["nan", "shape", "wrong_type", "boom", "neg_seq", "huge_seq"])
    special = st.builds(lambda k, s: ("special", k, s), kinds, st.integers(0, 6))
    return st.lists(st.one_of(good, good, flip, trunc, noise, special), min_size=1, max_size=25)


BOOM = 12345.0


def _record_for(op, clock, i: int) -> tuple[bytes, bool]:
    """(bytes, surely_bad): surely_bad records must be dead-lettered."""
    kind = op[0]
    if kind == "good":
        _, a, s, v = op
        return CODEC.encode(make_batch(a, s, v, clock.t)), False
    if kind == "flip":
        _, a, s, i, x = op
        data = bytearray(CODEC.encode(make_batch(a, s, 0, clock.t, batch_id=f"f{i}")))
        data[i % len(data)] ^= x
        return bytes(data), False
    if kind == "trunc":
        _, s, k = op
        data = CODEC.encode(make_batch("t", s, 0, clock.t))
        return data[: k % len(data)], True
    if kind == "noise":
        return op[1], not op[1].startswith(b"\xc3\x01")
    _, k, s = op
    b = make_batch("z", s, 0, clock.t, batch_id=f"{k}-{s}-{i}")
    if k == "nan":
        obs = b.obs.copy()
        obs[0, 0, 0] = np.nan
        return CODEC.encode(SampleBatch(**{**b.__dict__, "obs": obs})), True
    if k == "shape":
        return CODEC.encode(SampleBatch(**{**b.__dict__, "rewards": np.zeros((T + 1, N), np.float32)})), True
    if k == "wrong_type":
        return CODEC.encode(PolicyVersion("policy", 1, 0, "L", "ppo")), True
    if k == "neg_seq":
        return CODEC.encode(SampleBatch(**{**b.__dict__, "seq": -1})), True
    if k == "huge_seq":
        return CODEC.encode(SampleBatch(**{**b.__dict__, "seq": 2**62})), False
    boom = np.full_like(b.obs, BOOM)  # the policy's logp function fails on this one (a processor bug)
    return CODEC.encode(SampleBatch(**{**b.__dict__, "env_id": "boom", "policy_version": 0, "obs": boom})), True


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mutations())
def test_worker_never_raises_and_dead_letters_bad_records(ops):
    clock = Clock()
    bus = MemoryBus()
    bus.create_topics(all_topics())
    events = EventBus(bus)

    def factory(pv):  # the processors' public logp seam; it fails on the "boom" batches' obs
        def fn(obs, act):
            if (np.asarray(obs) == BOOM).any():
                raise RuntimeError("boom")
            return np.full(obs.shape[:2], -2.0, np.float32)
        return fn

    prepare = Prepare.from_config(PrepareConfig(max_versions=100, max_ms=None, reorder_timeout_ms=100), factory,
                                  clock=clock)
    events.publish(POLICY_VERSIONS, PolicyVersion("policy", 1, 0, "L", "ppo"), key="p")
    worker = PrepareWorker(events, prepare)
    bad_offsets = set()
    for i, op in enumerate(ops):
        data, bad = _record_for(op, clock, i)
        if bad:
            bad_offsets.add(i)
        bus.produce(SAMPLES_RAW, data, key=b"k")
        worker.step(0)
        clock.t += 37
    clock.t += 1000
    while worker.step(0):
        pass
    worker.drain()
    prepared = bus.end_offsets(SAMPLES_PREPARED)[0]
    dead = read(bus, DEADLETTER, DeadLetter)
    dups = prepare.stats.drops.get("duplicate", 0)
    assert prepared + len(dead) + dups == len(ops)
    dead_offsets = {d.offset for d in dead}
    assert bad_offsets <= dead_offsets
    assert all(d.reason for d in dead)
    booms = {i for i, op in enumerate(ops) if op[:2] == ("special", "boom")}
    assert {d.offset for d in dead if d.reason == "processor_error"} <= booms  # (a boom can also be late)
    assert prepare.reorder.buffered == 0
    assert worker.samples.raw.committed() == {(SAMPLES_RAW, 0): len(ops)}
    worker.close()


def test_a_policy_version_whose_weights_do_not_build_is_skipped_and_the_last_good_one_used(setup):
    clock, bus, events, prepare = setup
    now = clock.t
    events.publish(POLICY_VERSIONS, policy_version(0, now - 10), key="policy")
    worker = PrepareWorker(events, prepare)
    events.publish(SAMPLES_RAW, make_batch("a", 0, 0, now), key="a")
    while worker.step(0):
        pass
    good = policy_version(1, now - 5)
    bad = PolicyVersion("policy", 2, now - 1, "L", "ppo", weights=b"\x08" + b"\x00" * 7 + b"not safetensors")
    events.publish(POLICY_VERSIONS, good, key="policy")
    events.publish(POLICY_VERSIONS, bad, key="policy")
    events.publish(SAMPLES_RAW, make_batch("a", 1, 1, now), key="a")  # behind version 2: needs IS
    while worker.step(0):
        pass
    prepared = read(bus, SAMPLES_PREPARED, PreparedBatch)
    assert [p.sample.seq for p in prepared] == [0, 1]
    # IS fell back to the last policy that could be built (version 1: on-policy for this batch)
    assert prepared[1].current_version == 1
    assert list(read(bus, DEADLETTER, DeadLetter)) == []  # the learner dead-letters it
    assert events.dead_letters.skipped == {(POLICY_VERSIONS, "invalid"): 1}
    assert prepare.stats.policy_errors == 1
