"""Unit tests of the pure processors: staleness, reorder, importance."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.events import ClaimCheck, PolicyVersion, SampleBatch
from schemas.weights import encode_weights
from streams.dedup import SeenIds
from streams.policies import PolicyLoadError as PolicyBuildError
from streams.policies import PolicyLogpFn
from streams.processors.importance import ImportanceWeights
from streams.processors.reorder import ReorderBuffer
from streams.processors.staleness import PolicyStalenessError, StalenessWindow

torch.set_num_threads(1)


class Clock:
    def __init__(self, t: int = 1_000_000) -> None:
        self.t = t

    def __call__(self) -> int:
        return self.t


def make_batch(actor: str = "a0", seq: int = 0, version: int = 0, created: int = 1_000_000, t: int = 4,
               n: int = 2, obs_dim: int = 3, act_dim: int = 2, batch_id: str | None = None,
               logp: np.ndarray | None = None) -> SampleBatch:
    rng = np.random.default_rng(seq * 7919 + len(actor))
    return SampleBatch(
        batch_id=batch_id or f"{actor}-{seq}-{created}",
        actor_id=actor, seq=seq, env_id="Test-v0", policy_version=version, created_at_ms=created,
        obs=rng.standard_normal((t, n, obs_dim)).astype(np.float32),
        actions=rng.standard_normal((t, n, act_dim)).astype(np.float32),
        rewards=np.zeros((t, n), np.float32), terminated=np.zeros((t, n), bool),
        truncated=np.zeros((t, n), bool),
        behaviour_logp=(np.full((t, n), -1.0, np.float32) if logp is None else logp.astype(np.float32)),
        last_obs=np.zeros((n, obs_dim), np.float32), final_obs_index=np.zeros((0,), np.int64),
        final_obs=np.zeros((0, obs_dim), np.float32),
    )


def pv(version: int, created: int = 1_000_000, weights: bytes | None = None, policy_id: str = "p") -> PolicyVersion:
    return PolicyVersion(policy_id=policy_id, version=version, created_at_ms=created, learner_id="L",
                         algo="ppo", weights=weights)


# --- staleness ------------------------------------------------------------------------------

class TestStaleness:
    def test_drop_by_versions_and_ms_counts_reasons(self):
        clock = Clock(10_000)
        w = StalenessWindow(max_versions=2, max_ms=5_000, mode="drop", clock=clock)
        w.on_policy(pv(10))
        ok = w.assess(make_batch(version=8, created=9_000))  # K exactly, 1 s old
        assert ok.action == "keep" and ok.weight == 1.0 and ok.versions == 2 and ok.ms == 1_000
        v = w.assess(make_batch(version=7, created=9_000))  # 3 > K
        assert v.action == "drop" and isinstance(v.error, PolicyStalenessError)
        assert v.error.reason == "stale_versions" and v.versions == 3
        t = w.assess(make_batch(version=10, created=4_999))  # 5001 ms > T
        assert t.action == "drop" and t.error.reason == "stale_ms" and t.ms == 5_001
        edge = w.assess(make_batch(version=10, created=5_000))  # exactly T: kept
        assert edge.action == "keep"
        both = w.assess(make_batch(version=0, created=0))  # both stale: versions named first
        assert both.error.reason == "stale_versions"
        assert w.stats.dropped == {"stale_versions": 2, "stale_ms": 1}
        assert w.stats.checked_batches == 5 and w.stats.fresh_batches == 2
        assert w.stats.freshness == pytest.approx(2 / 5)
        assert w.stats.lag_versions.max == 10 and w.stats.lag_versions.last == 10

    def test_check_raises(self):
        w = StalenessWindow(max_versions=0, clock=Clock())
        w.on_policy(pv(1))
        with pytest.raises(PolicyStalenessError) as ei:
            w.check(make_batch(version=0))
        assert ei.value.reason == "stale_versions" and ei.value.versions == 1

    def test_downweight_schedule_k_and_t(self):
        clock = Clock(100_000)
        w = StalenessWindow(max_versions=2, max_ms=10_000, mode="downweight", decay=0.5, min_weight=0.1,
                            clock=clock)
        w.on_policy(pv(10))
        assert w.assess(make_batch(version=8, created=95_000)).weight == 1.0
        d = w.assess(make_batch(version=7, created=95_000))  # 1 over K
        assert d.action == "downweight" and d.weight == pytest.approx(0.5)
        d = w.assess(make_batch(version=6, created=95_000))  # 2 over K
        assert d.weight == pytest.approx(0.25)
        d = w.assess(make_batch(version=10, created=85_000))  # 15 s: 0.5 T over
        assert d.weight == pytest.approx(0.5 ** 0.5)
        d = w.assess(make_batch(version=7, created=80_000))  # 1 over K and 1 T over
        assert d.weight == pytest.approx(0.25)
        d = w.assess(make_batch(version=4, created=95_000))  # 4 over: 0.0625 < 0.1 -> drop
        assert d.action == "drop" and d.error.reason == "stale_versions"
        d = w.assess(make_batch(version=10, created=60_000))  # 3 T over: 0.125 kept
        assert d.action == "downweight" and d.weight == pytest.approx(0.125)
        d = w.assess(make_batch(version=10, created=50_000))  # 4 T over: 0.0625 -> drop stale_ms
        assert d.action == "drop" and d.error.reason == "stale_ms"
        assert w.stats.downweighted_batches == 5
        assert w.stats.dropped == {"stale_versions": 1, "stale_ms": 1}

    def test_downweight_custom_decay(self):
        w = StalenessWindow(max_versions=1, mode="downweight", decay=lambda v, ms: 1.0 / (1 + v), min_weight=0.3,
                            clock=Clock())
        w.on_policy(pv(5))
        assert w.assess(make_batch(version=3)).weight == pytest.approx(0.5)
        assert w.assess(make_batch(version=1)).action == "drop"  # 1/4 < 0.3

    def test_unknown_and_ahead(self):
        w = StalenessWindow(max_versions=1, clock=Clock())
        d = w.assess(make_batch(version=7))
        assert d.action == "keep" and d.current_version == 7 and d.versions == 0
        w.on_policy(pv(3))
        d = w.assess(make_batch(version=5))
        assert d.versions == 0 and d.current_version == 5
        assert w.stats.unknown_policy_batches == 1 and w.stats.ahead_batches == 1

    def test_out_of_order_policies_and_age_from_policy(self):
        clock = Clock(50_000)
        w = StalenessWindow(max_versions=10, max_ms=20_000, age_from="policy", clock=clock)
        assert w.on_policy(pv(2, created=10_000)) is True
        assert w.on_policy(pv(1, created=5_000)) is False  # older: history only
        assert w.latest_version == 2
        d = w.assess(make_batch(version=1, created=49_000))  # behaviour policy born at 5 s
        assert d.ms == 45_000 and d.action == "drop" and d.error.reason == "stale_ms"
        d = w.assess(make_batch(version=0, created=49_000))  # version never seen: batch time
        assert d.ms == 1_000 and d.action == "keep"

    def test_bad_args(self):
        with pytest.raises(ValueError):
            StalenessWindow(max_versions=1, mode="nope")
        with pytest.raises(ValueError):
            StalenessWindow(max_versions=-1)
        with pytest.raises(ValueError):
            StalenessWindow(max_versions=1, decay=0.0)


# --- reorder --------------------------------------------------------------------------------

def released_seqs(res) -> list[int]:
    return [b.seq for b, _ in res.released]


class TestReorder:
    def test_shuffled_input_comes_out_in_order(self):
        clock = Clock()
        rb = ReorderBuffer(max_buffered=64, timeout_ms=1000, clock=clock)
        order = list(range(50))
        random.Random(3).shuffle(order)
        order.remove(0)
        order.insert(random.Random(4).randrange(len(order)), 0)
        out = []
        for s in order:
            out += released_seqs(rb.push(make_batch(seq=s)))
        assert out == list(range(50))
        assert rb.buffered == 0 and rb.stats.skipped_seqs == 0

    def test_interleaved_actors_keep_their_own_order(self):
        rb = ReorderBuffer(clock=Clock())
        seqs = {"a": [1, 0, 3, 2], "b": [0, 2, 1, 3]}
        out = {"a": [], "b": []}
        for i in range(4):
            for a in ("a", "b"):
                for b, _ in rb.push(make_batch(actor=a, seq=seqs[a][i])).released:
                    out[b.actor_id].append(b.seq)
        assert out == {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3]}

    def test_gap_timeout_skips_ahead_and_late_is_rejected(self):
        clock = Clock(0)
        rb = ReorderBuffer(max_buffered=8, timeout_ms=500, clock=clock)
        assert released_seqs(rb.push(make_batch(seq=0))) == [0]
        assert released_seqs(rb.push(make_batch(seq=2, created=10))) == []
        clock.t = 200
        assert released_seqs(rb.push(make_batch(seq=3, created=20))) == []
        assert not rb.expire()  # 200 ms < timeout
        assert rb.next_deadline() == 500
        clock.t = 499
        assert not rb.expire()
        clock.t = 500
        res = rb.expire()
        assert released_seqs(res) == [2, 3]
        assert rb.stats.timeouts == 1 and rb.stats.skipped_seqs == 1 and rb.next_seq("a0") == 4
        late = rb.push(make_batch(seq=1, created=5))
        assert late.released == [] and [r.reason for r in late.rejected] == ["late"]
        assert rb.stats.rejected == {"late": 1}

    def test_second_gap_uses_oldest_waiting_batch(self):
        clock = Clock(0)
        rb = ReorderBuffer(max_buffered=8, timeout_ms=100, clock=clock)
        rb.push(make_batch(seq=0))
        rb.push(make_batch(seq=2, created=2))   # waits from t=0
        rb.push(make_batch(seq=5, created=5))   # waits from t=0 too
        clock.t = 100
        assert released_seqs(rb.expire()) == [2, 5]  # both gaps timed out
        assert rb.stats.timeouts == 2 and rb.stats.skipped_seqs == 1 + 2

    def test_duplicate_dropped_idempotently(self):
        rb = ReorderBuffer(clock=Clock())
        b = make_batch(seq=0)
        assert released_seqs(rb.push(b)) == [0]
        res = rb.push(b)
        assert res.released == [] and [r.reason for r in res.rejected] == ["duplicate"]
        b2 = make_batch(seq=2)
        rb.push(b2)
        res = rb.push(b2)  # duplicate of a buffered one
        assert [r.reason for r in res.rejected] == ["duplicate"]
        assert rb.stats.rejected == {"duplicate": 2} and rb.buffered == 1

    def test_seq_conflict(self):
        rb = ReorderBuffer(clock=Clock())
        rb.push(make_batch(seq=0))
        rb.push(make_batch(seq=2, batch_id="x"))
        res = rb.push(make_batch(seq=2, batch_id="y"))
        assert [r.reason for r in res.rejected] == ["seq_conflict"]

    def test_bounded_memory_under_flood(self):
        clock = Clock()
        rb = ReorderBuffer(max_buffered=16, timeout_ms=10**9, clock=clock)
        rb.push(make_batch(seq=0))
        out = []
        for s in range(2, 5002):  # seq 1 never comes
            out += released_seqs(rb.push(make_batch(seq=s, t=1, n=1)))
            assert rb.buffered <= 16
        assert rb.stats.max_buffered_seen <= 17  # one over the window, flushed at once
        assert rb.stats.overflows == 1 and rb.stats.skipped_seqs == 1
        assert out == list(range(2, 5002))

    def test_flood_of_gaps_stays_bounded(self):
        rb = ReorderBuffer(max_buffered=8, timeout_ms=10**9, clock=Clock())
        rb.push(make_batch(seq=0))
        for s in range(2, 20000, 2):  # every other seq missing
            rb.push(make_batch(seq=s, t=1, n=1))
            assert rb.buffered <= 8
        assert rb.stats.overflows > 0 and len(rb.seen) <= 65536

    def test_first_contact_mid_stream_waits_then_starts_lowest(self):
        clock = Clock(0)
        rb = ReorderBuffer(timeout_ms=100, clock=clock)
        assert released_seqs(rb.push(make_batch(seq=7))) == []
        assert released_seqs(rb.push(make_batch(seq=6))) == []
        clock.t = 100
        assert released_seqs(rb.expire()) == [6, 7]
        assert rb.stats.skipped_seqs == 0 and rb.stats.timeouts == 0

    def test_first_contact_seq_zero_after_later_ones(self):
        rb = ReorderBuffer(clock=Clock())
        assert released_seqs(rb.push(make_batch(seq=1))) == []
        assert released_seqs(rb.push(make_batch(seq=0))) == [0, 1]

    def test_restart_recognised_by_newer_seq_regression(self):
        clock = Clock(0)
        rb = ReorderBuffer(timeout_ms=100, clock=clock)
        for s in range(5):
            rb.push(make_batch(seq=s, created=1000 + s))
        rb.push(make_batch(seq=6, created=1006))  # buffered behind a gap
        # the actor restarts: seq 0 again, created later than anything before
        res = rb.push(make_batch(seq=0, created=2000))
        assert released_seqs(res) == [6, 0]  # old incarnation flushed first, in order
        assert rb.stats.restarts == 1 and rb.next_seq("a0") == 1
        assert released_seqs(rb.push(make_batch(seq=1, created=2001))) == [1]
        # an old straggler of the previous incarnation is late, not another restart
        res = rb.push(make_batch(seq=5, created=1005))
        assert [r.reason for r in res.rejected] == ["late"] and rb.stats.restarts == 1

    def test_restart_whose_first_batches_overtake(self):
        rb = ReorderBuffer(clock=Clock())
        for s in range(3):
            rb.push(make_batch(seq=s, created=100 + s))
        res = rb.push(make_batch(seq=1, created=500))  # new incarnation, seq 0 still in flight
        assert res.released == [] and rb.stats.restarts == 1
        assert released_seqs(rb.push(make_batch(seq=0, created=499))) == [0, 1]

    def test_incarnation_in_actor_id_is_just_a_new_actor(self):
        rb = ReorderBuffer(clock=Clock())
        for s in range(3):
            rb.push(make_batch(actor="a.1", seq=s))
        assert released_seqs(rb.push(make_batch(actor="a.2", seq=0))) == [0]
        assert rb.stats.restarts == 0

    def test_idle_actors_forgotten_and_max_actors(self):
        clock = Clock(0)
        rb = ReorderBuffer(max_actors=3, actor_idle_ms=1000, clock=clock)
        for i in range(3):
            rb.push(make_batch(actor=f"x{i}", seq=0))
        rb.push(make_batch(actor="x0", seq=2))  # x0 buffered, most recent
        res = rb.push(make_batch(actor="x3", seq=0))  # 4 actors > 3: x1 (LRU) forgotten
        assert rb.actors() == 3 and rb.next_seq("x1") is None and released_seqs(res) == [0]
        clock.t = 5000
        res = rb.expire()  # everyone idle; x0's buffer released as it goes
        assert rb.actors() == 0 and 2 in released_seqs(res)

    def test_drain_and_forget(self):
        rb = ReorderBuffer(clock=Clock())
        rb.push(make_batch(actor="a", seq=0), tag=(0, 0))
        rb.push(make_batch(actor="a", seq=3), tag=(0, 1))
        rb.push(make_batch(actor="b", seq=0), tag=(1, 0))
        rb.push(make_batch(actor="b", seq=2), tag=(1, 1))
        dropped = rb.forget_where(lambda t: t[0] == 1)
        assert [b.seq for b, _ in dropped] == [2] and rb.next_seq("b") is None
        assert [(b.seq, t) for b, t in rb.drain().released] == [(3, (0, 1))]
        assert rb.buffered == 0

    def test_seen_ids_lru_and_ttl(self):
        s = SeenIds(capacity=2)
        assert not s.seen_or_add("a", 0) and not s.seen_or_add("b", 0)
        assert s.seen_or_add("a", 0)  # refreshes a
        assert not s.seen_or_add("c", 0)  # evicts b
        assert "b" not in s and "a" in s and len(s) == 2
        t = SeenIds(capacity=10, ttl_ms=100)
        t.seen_or_add("x", 0)
        assert t.seen_or_add("x", 50)
        assert not t.seen_or_add("x", 251)  # expired: counted as new

    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 30), st.integers(0, 3),
                              st.integers(0, 400)), max_size=120),
           st.integers(1, 8), st.integers(0, 300))
    def test_every_batch_leaves_once_in_order(self, ops, window, timeout):
        """Property: any arrival pattern (restarts included) -> each batch released or rejected
        exactly once."""
        clock = Clock(0)
        rb = ReorderBuffer(max_buffered=window, timeout_ms=timeout, clock=clock)
        pushed, outs = 0, []
        for i, (actor, seq, dup, dt) in enumerate(ops):
            clock.t += dt
            bid = f"{actor}-{seq}" if dup == 0 else f"{actor}-{seq}-{i}"
            res = rb.push(make_batch(actor=actor, seq=seq, created=clock.t, batch_id=bid, t=1, n=1), tag=i)
            pushed += 1
            res.extend(rb.expire())
            outs.append(res)
            assert rb.buffered <= 3 * window
        final = rb.drain()
        outs.append(final)
        tags = [t for r in outs for _, t in r.released] + [x.tag for r in outs for x in r.rejected]
        assert sorted(tags) == list(range(pushed))

    @settings(max_examples=80, deadline=None)
    @given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 30), st.integers(0, 3),
                              st.integers(0, 400)), max_size=120),
           st.integers(1, 8), st.integers(0, 300))
    def test_per_actor_order_holds_for_any_arrival_pattern(self, ops, window, timeout):
        """Property: one incarnation per actor (a batch's creation time follows its seq, whatever
        the arrival order, so nothing looks like a restart) -> per actor the released seqs
        strictly increase, through buffering, gap timeouts, overflows and the final drain."""
        clock = Clock(0)
        rb = ReorderBuffer(max_buffered=window, timeout_ms=timeout, clock=clock)
        last: dict[str, int] = {}

        def check(res) -> None:
            for b, _ in res.released:
                assert b.seq > last.get(b.actor_id, -1), (b.actor_id, b.seq, last)
                last[b.actor_id] = b.seq

        for i, (actor, seq, dup, dt) in enumerate(ops):
            clock.t += dt
            bid = f"{actor}-{seq}" if dup == 0 else f"{actor}-{seq}-{i}"
            check(rb.push(make_batch(actor=actor, seq=seq, created=1_000 + seq, batch_id=bid, t=1, n=1), tag=i))
            check(rb.expire())
        check(rb.drain())
        assert rb.stats.restarts == 0


# --- importance -----------------------------------------------------------------------------

class TestImportance:
    def test_hand_computed_truncation(self):
        iw = ImportanceWeights(rho_bar=1.0, c_bar=0.9)
        ratios = np.array([[0.5, 1.0], [0.95, 2.0]])
        b = np.full((2, 2), -2.0)
        r = iw.from_logps(b, b + np.log(ratios))
        np.testing.assert_allclose(r.rho, [[0.5, 1.0], [0.95, 1.0]], rtol=1e-6)
        np.testing.assert_allclose(r.c, [[0.5, 0.9], [0.9, 0.9]], rtol=1e-6)
        assert r.rho.dtype == np.float32 and r.computed and r.capped == 0

    def test_untruncated_and_cap_masks(self):
        iw = ImportanceWeights(rho_bar=math.inf, c_bar=2.0, behaviour_cap=3.0)
        ratios = np.array([[0.25, 2.5, 3.0, 3.5, 10.0]])
        r = iw.from_logps(np.zeros((1, 5)), np.log(ratios))
        np.testing.assert_allclose(r.rho, [[0.25, 2.5, 3.0, 0.0, 0.0]], rtol=1e-6)
        np.testing.assert_allclose(r.c, [[0.25, 2.0, 2.0, 0.0, 0.0]], rtol=1e-6)
        assert r.capped == 2

    def test_numerically_safe(self):
        iw = ImportanceWeights(rho_bar=math.inf, c_bar=1.0)
        b = np.array([[0.0, 0.0, -1e30, 0.0, np.nan]])
        p = np.array([[1e4, -1e4, 0.0, np.inf, 0.0]])
        r = iw.from_logps(b, p)
        assert np.isfinite(r.rho).all() and np.isfinite(r.c).all()
        assert r.rho[0, 0] == pytest.approx(math.exp(20.0), rel=1e-5)  # clamped log ratio
        assert r.rho[0, 1] == pytest.approx(math.exp(-20.0), rel=1e-5)
        assert r.rho[0, 3] == 0.0 and r.rho[0, 4] == 0.0 and r.nonfinite == 2

    def test_same_version_is_exactly_one(self):
        iw = ImportanceWeights()
        calls = []
        b = make_batch(version=3)
        r = iw.compute(b, lambda o, a: calls.append(1), current_version=3)
        assert not r.computed and calls == [] and (r.rho == 1.0).all() and (r.c == 1.0).all()
        r = iw.compute(make_batch(version=2, logp=np.full((4, 2), -1.0)),
                       lambda o, a: np.full((4, 2), -1.0 + math.log(0.5)), current_version=3)
        assert r.computed and np.allclose(r.rho, 0.5)

    def test_bad_args(self):
        with pytest.raises(ValueError):
            ImportanceWeights(behaviour_cap=0.5)
        with pytest.raises(ValueError):
            ImportanceWeights(rho_bar=0)
        with pytest.raises(ValueError):
            ImportanceWeights().from_logps(np.zeros((2, 2)), np.zeros((2, 3)))


class TestPolicyLogpFn:
    def _policy(self):
        from agents.networks import Policy

        torch.manual_seed(0)
        p = Policy(3, 2, hidden=(8, 8))
        with torch.no_grad():
            p.obs_rms.mean.fill_(0.5)
            p.net.actor_logstd.fill_(-0.3)
        return p

    def test_from_policy_version_matches_policy(self):
        p = self._policy()
        data = encode_weights(p.state_dict(), {"obs_dim": 3, "act_dim": 2, "hidden": [8, 8], "activation": "tanh"})
        fn = PolicyLogpFn.from_policy_version(pv(4, weights=data))
        b = make_batch()
        got = fn(b.obs, b.actions)
        with torch.no_grad():
            want = p.log_prob(torch.from_numpy(b.obs.copy()), torch.from_numpy(b.actions.copy())).numpy()
        assert got.shape == (4, 2) and fn.version == 4
        np.testing.assert_allclose(got, want, rtol=1e-6)

    def test_errors(self):
        p = self._policy()
        with pytest.raises(PolicyBuildError):
            PolicyLogpFn.from_policy_version(pv(1))  # no weights
        ref = ClaimCheck("redis", "k", "0" * 64, 10)
        with pytest.raises(PolicyBuildError):
            PolicyLogpFn.from_policy_version(PolicyVersion("p", 1, 0, "L", "ppo", weights_ref=ref))
        with pytest.raises(PolicyBuildError):  # fetched bytes do not match the sha256
            PolicyLogpFn.from_policy_version(PolicyVersion("p", 1, 0, "L", "ppo", weights_ref=ref),
                                             fetch=lambda r: b"x" * 10)
        data = encode_weights(p.state_dict(), {"obs_dim": 3})  # act_dim missing
        with pytest.raises(PolicyBuildError):
            PolicyLogpFn.from_policy_version(pv(1, weights=data))
        data = encode_weights(p.state_dict(), {"obs_dim": 3, "act_dim": 2, "hidden": [16, 16]})
        with pytest.raises(PolicyBuildError):  # shapes do not fit
            PolicyLogpFn.from_policy_version(pv(1, weights=data))
