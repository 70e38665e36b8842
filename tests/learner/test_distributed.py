"""Data-parallel learner ranks (gloo, CPU): the update of 2 ranks on their shares equals one
learner's on the union; uneven minibatch counts neither hang nor split the ranks' weights."""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing as mp

import pytest
import torch

from agents.registry import make_algorithm
from learner.batching import StreamIds, to_trajectory_batch
from learner.distributed import DataParallel, free_port, parse_devices
from schemas.events import PreparedBatch
from tests.support.fragments import ACT, OBS, fragment

# one minibatch, no per-minibatch or running statistics: the loss is a mean over the batch
EXACT = {"num_minibatches": 1, "update_epochs": 2, "norm_adv": False, "normalize_obs": False,
         "normalize_reward": False, "seed": 3}


def updates(k: int, per_update: int = 4) -> list[list[PreparedBatch]]:
    return [[fragment(u * per_update + j) for j in range(per_update)] for u in range(k)]


def params(algo) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in algo.policy.parameters()])


def _rank(rank: int, world: int, port: int, jobs, out) -> None:
    """One rank: for each job (overrides, compression, plan), a fresh learner's updates."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=world, timeout=datetime.timedelta(seconds=60))
    for j, (overrides, compression, plan, *name) in enumerate(jobs):
        algo = make_algorithm(name[0] if name else "ppo", OBS, ACT, overrides, "cpu")
        dp = DataParallel(algo, rank, world, compression)
        ids = StreamIds()
        for shares in plan:
            mine = shares[rank]
            dp.update(to_trajectory_batch(mine, ids) if mine else None, sum(b.sample.size for b in mine))
        out.put((j, rank, params(algo).numpy(), dp.uneven_updates, dp.sync.reductions))  # no shared tensors
    # both ranks reach the teardown together: a gloo rank destroying its group while the other is
    # still working can abort ("terminate called without an active exception", exit -6)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def run_ranks(jobs, world: int = 2, timeout: float = 300.0) -> list[dict]:
    """``[{rank: (weights, uneven updates, all-reduces)}]`` per job, from ``world`` spawned ranks."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, jobs, out)) for r in range(world)]
    for p in procs:
        p.start()
    results: list[dict] = [{} for _ in jobs]
    try:
        for _ in range(world * len(jobs)):
            j, rank, flat, uneven, reductions = out.get(timeout=timeout)
            results[j][rank] = (torch.from_numpy(flat), uneven, reductions)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return results


def single(plan_global, overrides: dict) -> tuple[torch.Tensor, torch.Tensor]:
    algo = make_algorithm("ppo", OBS, ACT, overrides, "cpu")
    before = params(algo)
    ids = StreamIds()
    for batches in plan_global:
        algo.update(to_trajectory_batch(batches, ids))
    return before, params(algo)


def test_two_ranks_equal_one_rank_on_the_same_global_batch():
    k = 3
    glob = updates(k)
    plan = [[batches[0::2], batches[1::2]] for batches in glob]  # each rank: half of every global batch
    before, want = single(glob, EXACT)
    tolerances = {"none": 1e-6, "fp16": 2e-4, "bf16": 2e-3}
    runs = run_ranks([(EXACT, c, plan) for c in tolerances])
    assert not torch.equal(before, want)  # the updates moved the weights
    for (compression, atol), got in zip(tolerances.items(), runs):
        assert torch.equal(got[0][0], got[1][0])  # the ranks hold the same weights
        # one all-reduce per optimizer step, and one closing round per update
        assert got[0][2] == k * (EXACT["update_epochs"] + 1)
        assert got[0][1] == 0
        err = float((got[0][0] - want).abs().max())
        assert err <= atol, f"2 ranks differ from 1 rank by {err} (tolerance {atol}, {compression})"
    # the tolerance is not vacuous: one rank's half alone ends elsewhere
    half = single([b[0::2] for b in glob], EXACT)[1]
    assert float((half - want).abs().max()) > 100 * tolerances["none"]


@pytest.mark.parametrize("empty", [0, 1])
def test_a_rank_with_no_share_still_updates_the_group_as_one_learner_would(empty):
    """A rank whose partitions were quiet holds nothing: the other's fragments are the global
    batch, and both ranks end with one learner's weights on it (whichever rank was empty)."""
    glob = updates(2)
    plan = [[[], b] if empty == 0 else [b, []] for b in glob]
    before, want = single(glob, EXACT)
    got = run_ranks([(EXACT, "none", plan)])[0]
    assert not torch.equal(before, want)
    assert torch.equal(got[0][0], got[1][0])
    assert got[0][1] == got[1][1] == 2  # both updates were uneven: the empty rank made no step
    err = float((got[0][0] - want).abs().max())
    assert err <= 1e-6, f"differs from one learner by {err}"


def test_uneven_minibatch_counts_do_not_hang_and_keep_ranks_identical():
    over = {**EXACT, "num_minibatches": 4, "update_epochs": 1}
    # rank 0: 16x2 = 32 transitions -> 4 minibatches of 8; rank 1: 17x2 = 34 -> 5 minibatches
    plan = [[[fragment(0)], [fragment(1, steps=17)]]]
    got = run_ranks([(over, "none", plan)])[0]
    assert got[0][1] == got[1][1] == 1  # counted as an uneven update on both ranks
    assert torch.equal(got[0][0], got[1][0])


def test_devices_one_per_rank():
    assert parse_devices("cpu", 2) == ["cpu", "cpu"]
    assert parse_devices("cuda:0,1,2,3", None) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert parse_devices("cuda", 2) == ["cuda:0", "cuda:1"]
    assert parse_devices("cuda:1", None) == ["cuda:1"]
    with pytest.raises(ValueError, match="lists 2 devices"):
        parse_devices("cuda:0,1", 3)
    with pytest.raises(ValueError, match="one GPU per rank"):
        parse_devices("cuda:1", 2)


def test_the_decoupled_parent_passes_the_rank_settings_to_its_learner(tmp_path):
    from rlstream.cli import build_parser, train_config
    from config import read_config, write_config
    from rlstream.decoupled import child_commands, child_config

    a = build_parser().parse_args(["train", "--mode", "decoupled", "--learners", "2", "--grad-compression", "bf16",
                                   "--run-dir", str(tmp_path)])
    cfg = train_config(a)
    path = write_config(child_config(cfg), tmp_path / "config.json")
    child = read_config(path)  # what the learner process reads (rlstream learner --config PATH)
    assert (child.learners, child.device, child.grad_compression) == (2, "cpu", "bf16")
    learner_cmd = child_commands(cfg, path)["learner"]
    assert learner_cmd[3:] == ["learner", "--config", str(path), "--log-json"]


@pytest.mark.parametrize("name", ["agro", "tba"])
def test_down_weighted_shares_keep_the_ranks_one_learner(name):
    """AGRO/TBA turn the batch's mean sample weight into the step's learning rate (``decay_lr``).
    One rank holding the stale (down-weighted) fragments and the other the fresh ones must still
    step with the group's mean weight, not each its own, or the ranks' weights drift apart. (Not
    compared with one learner on the union to 1e-6: AGRO's in-loss baseline is a per-minibatch
    mean, each rank's own, as PPO's advantage normalisation is.)"""
    glob = [[dataclasses.replace(b, sample_weight=0.25 if j % 2 == 0 else 1.0, staleness_versions=6 if j % 2 == 0 else 0)
             for j, b in enumerate(batches)] for batches in updates(2)]
    plan = [[batches[0::2], batches[1::2]] for batches in glob]  # rank 0: every stale fragment
    over = {**EXACT, "update_epochs": 1}
    before = params(make_algorithm(name, OBS, ACT, over, "cpu"))
    got = run_ranks([(over, "none", plan, name)])[0]
    assert not torch.equal(before, got[0][0])
    assert torch.equal(got[0][0], got[1][0]), "the ranks' weights drifted apart"
