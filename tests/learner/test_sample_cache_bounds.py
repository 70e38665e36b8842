"""The sample cache's defaults and edges beside tests/learner/test_sample_cache.py: the guide's
1,000 samples per training node (the cache's and the run config's default), replay from half the
capacity on unless ``min_size`` says otherwise, and a fragment exactly as large as the cache fits."""

from __future__ import annotations

from config import TrainConfig
from learner.replay import ReplayCache, ReplayConfig
from tests.learner.test_sample_cache import SIZE, frag


def test_the_cache_holds_the_guides_1000_samples_by_default():
    assert ReplayConfig().capacity == 1000
    assert TrainConfig().replay_capacity == 1000
    settings = TrainConfig(algo="agro", replay=True, fragment_steps=256).replay_settings()
    assert settings is not None and ReplayConfig(**settings).capacity == 1000


def test_replay_starts_once_half_the_capacity_is_held_by_default():
    cache = ReplayCache(ReplayConfig(capacity=4 * SIZE, samples_per_insert=2.0), seed=0)
    assert cache.config.min_to_replay == 2 * SIZE
    cache.add([frag(0)])
    cache.insert_count(SIZE)
    assert cache.draw() == []  # SIZE held: under half
    cache.add([frag(1)])
    cache.insert_count(SIZE)
    assert len(cache.draw()) == 2 and cache.stats.last_replayed == 2 * SIZE  # half held: replayed
    assert ReplayConfig(capacity=4 * SIZE, min_size=SIZE).min_to_replay == SIZE


def test_a_fragment_exactly_the_capacity_is_cached_and_one_transition_more_is_not():
    cache = ReplayCache(ReplayConfig(capacity=SIZE))
    cache.add([frag(0)])
    assert cache.batch_ids() == ["b0"] and cache.held == SIZE and cache.stats.oversize == 0
    small = ReplayCache(ReplayConfig(capacity=SIZE - 1))
    small.add([frag(1)])
    assert small.held == 0 and small.stats.oversize == 1
