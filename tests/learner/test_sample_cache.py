"""The learner node's sample cache (learner.replay) through the pure learner core: what an
update trains on with replay on -- eviction order, the samples-per-insert bound, reuse counts,
and importance/staleness weights of replayed fragments against the policy that trains on them."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from agents.registry import make_algorithm
from agents.vtrace import importance_weights
from learner.core import Fragment, LearnerConfig, LearnerCore
from learner.replay import REPLAY_STREAM_PREFIX, ReplayCache, ReplayConfig, SamplesPerInsert
from tests.support.fragments import ACT, OBS, N, fragment

torch.set_num_threads(1)
STEPS = 16
SIZE = STEPS * N  # transitions per fragment
OVERRIDES = {"num_minibatches": 2, "update_epochs": 1, "seed": 5}


def frag(i: int, version: int = 0) -> Fragment:
    pb = fragment(i, STEPS)
    return Fragment(dataclasses.replace(pb, sample=dataclasses.replace(pb.sample, policy_version=version)), f"d{i}")


def core_with(cache: ReplayCache, algo: str = "agro", per_update: int = 2, **overrides) -> LearnerCore:
    a = make_algorithm(algo, OBS, ACT, {**OVERRIDES, **overrides}, "cpu")
    core = LearnerCore(LearnerConfig(algo=algo, train_batch_size=per_update * SIZE), a, replay=cache)
    core.next_version()
    return core


def feed(core: LearnerCore, start: int, n: int, version: int | None = None):
    """``n`` fragments from index ``start`` (behaviour version: the learner's, unless given), one update."""
    for i in range(start, start + n):
        core.add(frag(i, core.model_version if version is None else version))
    assert core.ready()
    return core.update()


def ids(fragments) -> list[str]:
    return [f.batch.sample.batch_id for f in fragments]


def test_the_cache_evicts_the_oldest_fragments_first_and_holds_at_most_its_capacity():
    cache = ReplayCache(ReplayConfig(capacity=4 * SIZE, samples_per_insert=1.0))  # no replay: a cache only
    core = core_with(cache)
    feed(core, 0, 2)
    feed(core, 2, 2)
    assert cache.batch_ids() == ["b0", "b1", "b2", "b3"] and cache.held == 4 * SIZE  # exactly full
    feed(core, 4, 2)
    assert cache.batch_ids() == ["b2", "b3", "b4", "b5"] and cache.held == 4 * SIZE
    assert cache.stats.evicted == 2
    big = dataclasses.replace(frag(9).batch, sample=dataclasses.replace(frag(9).batch.sample, batch_id="big"))
    small = ReplayCache(ReplayConfig(capacity=SIZE - 1))
    small.add([Fragment(big, "d")])
    assert small.batch_ids() == [] and small.stats.oversize == 1 and small.held == 0


def test_samples_per_insert_bound_holds_exactly_after_every_update_and_replayed_data_is_trained():
    spi = 1.5
    cache = ReplayCache(ReplayConfig(capacity=16 * SIZE, samples_per_insert=spi, min_size=SIZE, max_reuse=100), seed=3)
    core = core_with(cache)
    lim = cache.limiter
    total_replayed = 0
    for k in range(12):
        upd = feed(core, 2 * k, 2)
        n_rep = sum(f.batch.sample.size for f in upd.replayed)
        total_replayed += n_rep
        # the algorithm trained on the fresh and the replayed transitions
        assert upd.metrics["num_samples"] == 2 * SIZE + n_rep
        assert upd.num_samples == 2 * SIZE and upd.batch_ids == [f"b{2 * k}", f"b{2 * k + 1}"]
        assert lim.inserted == 2 * SIZE * (k + 1) and lim.replayed == total_replayed
        assert lim.trained <= spi * lim.inserted  # never past the bound
        if k >= 1:  # tight: one more fragment would pass it
            assert lim.trained + SIZE > spi * lim.inserted, (k, lim.trained, lim.inserted)
        assert upd.metrics["replay_spi"] == pytest.approx(lim.trained / lim.inserted)
        assert upd.metrics["replay_ratio"] == pytest.approx(total_replayed / lim.trained)
        assert upd.metrics["replay_cache_samples"] == cache.held
    assert total_replayed > 0


def test_a_fragment_is_replayed_at_most_max_reuse_times_never_twice_in_one_update_nor_in_its_own():
    cache = ReplayCache(ReplayConfig(capacity=6 * SIZE, samples_per_insert=3.0, min_size=SIZE, max_reuse=2), seed=1)
    core = core_with(cache)
    uses: dict[str, int] = {}
    for k in range(10):
        upd = feed(core, 2 * k, 2)
        replayed = [i.removeprefix(REPLAY_STREAM_PREFIX) for i in ids(upd.replayed)]
        assert len(replayed) == len(set(replayed))  # once per update
        assert not set(replayed) & set(upd.batch_ids)  # a fresh fragment is not replayed beside itself
        for i in replayed:
            uses[i] = uses.get(i, 0) + 1
    assert uses and max(uses.values()) == 2  # reached, never passed
    assert cache.stats.exhausted == sum(1 for v in uses.values() if v == 2)
    assert all(cache.reuse(i) < 2 for i in cache.batch_ids())


def test_replayed_fragments_are_weighted_against_the_policy_that_trains_on_them():
    """Fragments collected under version 0, replayed once the policy has moved on: the behaviour
    log-probs are the actor's, untouched; the IS weights are those of the policy the update starts
    from; the lag is counted from it; and the update's own V-trace weights agree."""
    # no replay until 4 fragments are held: two updates on version-0 data move the policy first
    cache = ReplayCache(ReplayConfig(capacity=8 * SIZE, samples_per_insert=2.0, min_size=4 * SIZE, max_reuse=1), seed=0)
    core = core_with(cache, c_bar=0.5)  # rho and c differ
    originals = {f"b{i}": frag(i, 0).batch for i in range(4)}
    feed(core, 0, 2, version=0)
    assert not feed(core, 2, 2, version=0).replayed
    before = copy.deepcopy(core.algo.policy)
    v = core.model_version
    assert v == 2
    upd = feed(core, 200, 2)
    old = [f for f in upd.replayed if f.batch.sample.batch_id.removeprefix(REPLAY_STREAM_PREFIX) in originals]
    assert len(old) == 4
    for f in old:
        pb, orig = f.batch, originals[f.batch.sample.batch_id.removeprefix(REPLAY_STREAM_PREFIX)]
        assert np.array_equal(pb.sample.behaviour_logp, orig.sample.behaviour_logp)
        assert (pb.current_version, pb.staleness_versions) == (v, v - 0)
        with torch.no_grad():
            logp = before.log_prob(torch.as_tensor(orig.sample.obs), torch.as_tensor(orig.sample.actions))
        rho, c, _, _ = importance_weights(logp - torch.as_tensor(orig.sample.behaviour_logp), 1.0, 0.5)
        assert np.allclose(pb.is_rho, rho.numpy(), atol=1e-6) and np.allclose(pb.is_c, c.numpy(), atol=1e-6)
        assert not np.allclose(pb.is_rho, pb.is_c)
        assert not np.allclose(pb.is_rho, orig.is_rho)  # not the processor's weights of version 0
    # the update's V-trace weights: the same policy against the carried behaviour log-probs
    trained = [frag(i, v).batch for i in (200, 201)] + [f.batch for f in upd.replayed]
    with torch.no_grad():
        want = []
        for pb in trained:
            lp = before.log_prob(torch.as_tensor(pb.sample.obs), torch.as_tensor(pb.sample.actions))
            want.append(importance_weights(lp - torch.as_tensor(pb.sample.behaviour_logp))[0])
    assert upd.metrics["rho_mean"] == pytest.approx(float(torch.cat([w.reshape(-1) for w in want]).mean()), rel=1e-5)


def test_tba_decays_replayed_fragments_by_their_lag_behind_the_current_policy():
    cache = ReplayCache(ReplayConfig(capacity=8 * SIZE, samples_per_insert=2.0, min_size=SIZE, max_reuse=1), seed=2)
    core = core_with(cache, "tba", staleness_schedule="exponential", version_decay=0.5)
    feed(core, 0, 2)
    for k in range(1, 6):
        v = core.model_version
        upd = feed(core, 2 * k, 2)
        if not upd.replayed:
            continue
        lags = [v - f.batch.sample.policy_version for f in upd.replayed]
        assert all(f.batch.staleness_versions == lag for f, lag in zip(upd.replayed, lags))
        n_rep = len(upd.replayed) * SIZE
        want = (2 * SIZE * 1.0 + SIZE * sum(0.5 ** lag for lag in lags)) / (2 * SIZE + n_rep)
        assert upd.metrics["weight_mean"] == pytest.approx(want, rel=1e-6)
        assert max(lags) >= 1
        return
    pytest.fail("nothing was replayed")


def test_an_adopted_version_empties_the_cache():
    cache = ReplayCache(ReplayConfig(capacity=8 * SIZE, min_size=SIZE), seed=0)
    core = core_with(cache)
    feed(core, 0, 2)
    assert cache.held == 2 * SIZE
    core.adopt(7, weights=core.algo.policy.state_dict())  # a rollback published elsewhere
    assert cache.held == 0 and cache.batch_ids() == []
    assert not feed(core, 2, 2).replayed


def test_replay_needs_an_off_policy_algorithm_and_sane_settings():
    with pytest.raises(ValueError, match="off-policy"):
        core_with(ReplayCache(ReplayConfig()), "ppo")
    with pytest.raises(ValueError):
        ReplayConfig(samples_per_insert=0.5)
    lim = SamplesPerInsert(2.0, error_buffer=10)
    lim.insert(100)
    assert lim.allows(110) and not lim.allows(111)
    with pytest.raises(ValueError):
        lim.replay(111)
