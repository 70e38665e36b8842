"""Learner update throughput, 1 rank vs N data-parallel ranks (torch.distributed); prints JSON.

    python bench/learner_ranks.py [--ranks 2] [--updates 4] [--device cpu | cuda:0,1] [--grad-compression fp16]

The same recorded HalfCheetah-sized fragments (obs 17, act 6) make every global batch; one
learner trains on all of it (``algo.update``, the peer figure), N ranks each on their share
through ``learner.distributed.DataParallel`` (the learner's own update path: gradient
all-reduce per optimizer step, gloo on CPU, nccl on CUDA). samples/s = global transitions per
update x timed updates / wall time (the first update is a warm-up). On one shared CPU the ranks
compete for the same cores: the figure shows the communication overhead, not a speed-up.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from agents.registry import make_algorithm  # noqa: E402
from learner.batching import StreamIds, to_trajectory_batch  # noqa: E402
from learner.distributed import DataParallel, backend_for, free_port, parse_devices  # noqa: E402
from bench.common import host_info  # noqa: E402
from bench.processors import ACT, OBS, make_batches  # noqa: E402
from schemas.events import PreparedBatch  # noqa: E402


def fragments(args) -> list[list[PreparedBatch]]:
    """``updates + 1`` global batches of ``fragments`` fragments, fixed by the seed."""
    rng = np.random.default_rng(0)
    out = []
    for u in range(args.updates + 1):
        sbs = make_batches(args.fragments, args.t, args.n, 4, u, rng)
        ones = np.ones((args.t, args.n), np.float32)
        out.append([PreparedBatch(s, u, 0, 0, ones, ones, 10**12) for s in sbs])
    return out


def overrides(args) -> dict:
    return {"num_minibatches": args.minibatches, "update_epochs": args.epochs}


def timed(step, plan) -> float:
    step(plan[0])  # warm-up
    t0 = time.perf_counter()
    for batches in plan[1:]:
        step(batches)
    return time.perf_counter() - t0


def _rank(rank: int, world: int, port: int, args, device: str, out) -> None:
    torch.set_num_threads(args.threads)
    torch.distributed.init_process_group(backend_for(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=world, timeout=datetime.timedelta(seconds=300))
    algo = make_algorithm("ppo", OBS, ACT, overrides(args), device)
    dp = DataParallel(algo, rank, world, args.grad_compression)
    ids = StreamIds()

    def step(batches) -> None:
        mine = batches[rank::world]
        dp.update(to_trajectory_batch(mine, ids), sum(b.sample.size for b in mine))
    wall = timed(step, fragments(args))
    out.put((rank, wall, dp.uneven_updates))
    torch.distributed.destroy_process_group()


def ranks(args, devices: list[str]) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, len(devices), port, args, devices[r], out))
             for r in range(len(devices))]
    for p in procs:
        p.start()
    got = [out.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
    wall = max(w for _, w, _ in got)
    return {"wall_s": round(wall, 3), "uneven_updates": max(u for _, _, u in got)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu, or one device per rank: cuda:0,1")
    ap.add_argument("--grad-compression", choices=["none", "fp16", "bf16"], default="none")
    ap.add_argument("--updates", type=int, default=4, help="timed updates (after one warm-up)")
    ap.add_argument("--fragments", type=int, default=8, help="fragments per global batch")
    ap.add_argument("--t", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--minibatches", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = ap.parse_args()
    devices = parse_devices(args.device, args.ranks)
    per_update = args.fragments * args.t * args.n
    torch.set_num_threads(args.threads)
    algo = make_algorithm("ppo", OBS, ACT, overrides(args), devices[0])
    ids = StreamIds()
    single = timed(lambda b: algo.update(to_trajectory_batch(b, ids)), fragments(args))
    multi = ranks(args, devices)
    peer = per_update * args.updates / single
    sps = per_update * args.updates / multi["wall_s"]
    print(json.dumps({
        "bench": "learner",
        "config": {"global_batch": per_update, "updates": args.updates, "minibatches": args.minibatches,
                   "epochs": args.epochs, "devices": devices, "grad_compression": args.grad_compression,
                   "torch_threads_per_rank": args.threads, "policy": "PPO, Policy(17, 6, hidden=(64, 64))"},
        "peer": {"ranks": 1, "device": devices[0], "samples_per_s": round(peer, 1), "wall_s": round(single, 3)},
        "result": {"ranks": len(devices), "samples_per_s": round(sps, 1), **multi},
        "ratio_vs_peer": round(sps / peer, 3),
        "host": host_info(),
    }, indent=2))


if __name__ == "__main__":
    main()
