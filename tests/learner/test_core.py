"""The pure learner core (learner.core): fragments in, a GradientStep and the new weights out --
no bus, no snapshot store; a learner alone is one SingleRank."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from agents.registry import make_algorithm
from learner.batching import StreamIds, to_trajectory_batch
from learner.core import Fragment, LearnerConfig, LearnerCore
from learner.ranks import SingleRank
from tests.support.fragments import ACT, OBS, N, fragment

torch.set_num_threads(1)
OVERRIDES = {"num_minibatches": 2, "update_epochs": 1, "seed": 5}


def algo():
    return make_algorithm("ppo", OBS, ACT, OVERRIDES, "cpu")


def params(a) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in a.policy.parameters()])


def test_an_update_trains_every_buffered_fragment_and_returns_its_gradient_step():
    core = LearnerCore(LearnerConfig(learner_id="l", algo="ppo", train_batch_size=3 * 16 * N), algo())
    assert isinstance(core.ranks, SingleRank)
    core.next_version()  # version 0: the initial weights, published by the shell
    frags = [fragment(i) for i in range(3)]
    for i, f in enumerate(frags[:2]):
        core.add(Fragment(f, f"d{i}"))
    assert not core.ready() and core.buffered == 2 * 16 * N
    core.add(Fragment(frags[2], "d2", source="rec-2"))
    assert not core.ready(paused=True)  # the breaker holds it back
    assert core.ready()
    reference = algo()  # one algorithm's update on the same padded batch
    want = reference.update(to_trajectory_batch(frags, StreamIds()))
    upd = core.update(started_at_ms=100)
    assert torch.equal(params(core.algo), params(reference))
    assert upd.metrics == want and [f.source for f in upd.fragments] == [None, None, "rec-2"]
    step = upd.step(finished_at_ms=200)
    assert (step.learner_id, step.step, step.from_version, step.to_version, step.algo) == ("l", 1, 0, 1, "ppo")
    assert step.batch_ids == ["b0", "b1", "b2"] and step.batch_digests == ["d0", "d1", "d2"]
    assert step.num_samples == 3 * 16 * N and (step.started_at_ms, step.finished_at_ms) == (100, 200)
    assert step.losses == {k: float(v) for k, v in want.items()}
    assert (core.version, core.model_version, core.buffered, core.pending) == (1, 1, 0, [])
    assert core.stats.updates == 1 and core.stats.samples_trained == 3 * 16 * N


def test_duplicates_and_batches_of_another_shape_are_refused():
    core = LearnerCore(LearnerConfig(train_batch_size=16 * N), algo())
    f0 = fragment(0)
    assert core.refuse(f0) is None
    core.add(Fragment(f0, "d"))
    assert core.refuse(f0)[0] == "duplicate"  # buffered already
    core.update()
    assert core.trained("b0") and core.refuse(f0)[:2] == ("duplicate", "DuplicateBatch")  # trained already
    other = fragment(1)
    wide = dataclasses.replace(other, sample=dataclasses.replace(
        other.sample, obs=np.zeros((16, N, OBS + 1), np.float32)))
    reason, error, detail = core.refuse(wide)
    assert (reason, error) == ("incompatible", "IncompatibleBatch") and "(4,)" in detail


def test_the_budget_remainder_is_the_last_update_and_restored_ids_are_refused():
    core = LearnerCore(LearnerConfig(train_batch_size=4 * 16 * N, total_samples=5 * 16 * N), algo())
    assert core.need() == 4 * 16 * N
    core.stats.samples_trained = 4 * 16 * N
    assert core.need() == 16 * N
    core.add(Fragment(fragment(0), "d"))
    assert core.ready()
    fresh = LearnerCore(LearnerConfig(), algo())
    fresh.restore(7, core.algo.state_dict(), {"updates": 3, "samples_trained": 99, "trained_batch_ids": ["b5"]})
    assert (fresh.model_version, fresh.stats.updates, fresh.stats.samples_trained) == (7, 3, 99)
    assert fresh.refuse(fragment(5))[0] == "duplicate"


def test_adopting_a_newer_version_takes_its_weights_and_hands_back_what_was_buffered():
    core = LearnerCore(LearnerConfig(train_batch_size=10 * 16 * N), algo())
    core.next_version()
    core.add(Fragment(fragment(0), "d", source="r0"))
    other = algo()
    with torch.no_grad():
        for p in other.policy.parameters():
            p.add_(1.0)
    dropped = core.adopt(5, weights=other.policy.state_dict())
    assert [f.source for f in dropped] == ["r0"] and core.buffered == 0 and core.refuse(fragment(0)) is None
    assert (core.version, core.model_version, core.stats.adopted_versions) == (5, 5, 1)
    assert torch.equal(params(core.algo), params(other))
    assert core.snapshot_share({("t", 0): 3}) == ({("t", 0): 3}, [])
