"""Time one PPO update (wall and process CPU time: on a shared machine the CPU time is the steadier figure) (CleanRL settings: 2,048 x 1 batch, 10 epochs, minibatch 64) on a
fixed synthetic HalfCheetah-shaped batch, and optionally print its top profile entries.
``--algo agro``: one AGRO update (its defaults: V-trace on, 4 epochs x 8 minibatches) on the same batch.

    python bench/update.py --updates 5 --profile 15
    python bench/update.py --algo agro --updates 5
    python bench/update.py --device cuda --num-envs 32 --updates 10   # 65,536 x 1 batch on the GPU

``--compare``: the eager update against the captured one (``agents.capture``: each minibatch step
compiled whole), interleaved in one process (eager, captured, captured, eager, ...: a shared
machine's load falls on both alike), for each of ``--algos`` at each of ``--sizes`` samples
(2,048-step columns: 262,144 is 2,048 x 128); medians, their ratio, and the compile apart with
the updates it takes to pay for itself:

    python bench/update.py --compare --sizes 2048,262144 --algos ppo,agro --updates 3
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench.common

from agents.agro import AGRO, AGROConfig  # noqa: E402
from agents.core import TrajectoryBatch  # noqa: E402
from agents.ppo import PPO, PPOConfig  # noqa: E402
from bench.common import host_info, load_1m  # noqa: E402


def synthetic_batch(T: int, N: int, obs_dim: int, act_dim: int, seed: int = 0) -> TrajectoryBatch:
    rng = np.random.default_rng(seed)
    term = np.zeros((T, N), bool)
    trunc = np.zeros((T, N), bool)
    trunc[999::1000] = True  # HalfCheetah's time limit
    obs = rng.normal(size=(T, N, obs_dim)).astype(np.float32)
    return TrajectoryBatch.from_numpy(
        obs=obs, actions=rng.normal(size=(T, N, act_dim)).astype(np.float32),
        rewards=rng.normal(size=(T, N)).astype(np.float32), terminated=term, truncated=trunc,
        behaviour_logp=rng.normal(-8.0, 1.0, size=(T, N)).astype(np.float32),
        next_obs_final=obs, last_obs=obs[-1], stream_ids=np.arange(N, dtype=np.int64))


def make(algo: str, device: str):
    """The algorithm at its defaults (PPO: CleanRL's) for HalfCheetah's spaces (17, 6)."""
    if algo == "agro":
        return AGRO(AGROConfig(), obs_dim=17, act_dim=6, device=device)
    return PPO(PPOConfig(), obs_dim=17, act_dim=6, device=device)


def timed(algo, batch, cuda: bool) -> tuple[float, float]:
    """Wall and process CPU seconds of one ``algo.update(batch)``."""
    if cuda:
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    algo.update(batch)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, time.process_time() - c0


def compare(algo_name: str, samples: int, updates: int, device: str, steps: int = 2048) -> dict:
    """Eager against captured, interleaved, on one synthetic batch of ``samples``."""
    cuda = torch.device(device).type == "cuda"
    T = min(steps, samples)
    batch = synthetic_batch(T, max(1, samples // T), 17, 6)
    eager, captured = make(algo_name, device), make(algo_name, device)
    captured.enable_capture()
    first_eager = timed(eager, batch, cuda)[0]
    first_captured = timed(captured, batch, cuda)[0]  # compiles its graphs (timed apart)
    walls: dict[str, list[float]] = {"eager": [], "captured": []}
    cpus: dict[str, list[float]] = {"eager": [], "captured": []}
    for i in range(updates):
        order = (("eager", eager), ("captured", captured))
        for name, algo in (order if i % 2 == 0 else order[::-1]):
            w, c = timed(algo, batch, cuda)
            walls[name].append(w)
            cpus[name].append(c)
    med = {k: float(np.median(v)) for k, v in walls.items()}
    cpu_med = {k: float(np.median(v)) for k, v in cpus.items()}
    saved = med["eager"] - med["captured"]
    stats = captured.capture
    return {
        "algo": algo_name, "samples": T * max(1, samples // T), "updates": updates,
        "optimizer_steps_per_update": stats.captured_steps // (updates + 1) if updates else None,
        "eager_s_median": round(med["eager"], 4), "captured_s_median": round(med["captured"], 4),
        "speedup": round(med["eager"] / med["captured"], 3) if med["captured"] > 0 else None,
        "eager_cpu_s_median": round(cpu_med["eager"], 4), "captured_cpu_s_median": round(cpu_med["captured"], 4),
        "speedup_cpu": round(cpu_med["eager"] / cpu_med["captured"], 3) if cpu_med["captured"] > 0 else None,
        "first_update_s": {"eager": round(first_eager, 3), "captured": round(first_captured, 3)},
        "compile_s": round(stats.compile_s, 3), "compiles": stats.compiles, "eager_fallback_steps": stats.eager_steps,
        "compile_paid_back_after_updates": round(stats.compile_s / saved, 1) if saved > 0 else None,
    }


def host(threads: int, device: str) -> dict:
    out = host_info(threads=threads, loadavg_1m=load_1m())
    if torch.device(device).type == "cuda":
        out.update(gpu=torch.cuda.get_device_name(torch.device(device)), cuda=torch.version.cuda)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compare", action="store_true", help="eager against captured, interleaved (see the module doc)")
    ap.add_argument("--sizes", default="2048,262144", help="--compare: samples per update, comma-separated")
    ap.add_argument("--algos", default="ppo,agro", help="--compare: algorithms, comma-separated")
    ap.add_argument("--algo", choices=("ppo", "agro"), default="ppo")
    ap.add_argument("--updates", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2048)
    ap.add_argument("--num-envs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--profile", type=int, default=0, help="print this many top cProfile entries (by tottime)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.compare:
        load0 = load_1m()
        rows = [compare(a, int(n), args.updates, args.device) for n in args.sizes.split(",") for a in args.algos.split(",")]
        h = host(args.threads, args.device)
        h["loadavg_1m_before"] = load0
        h["loaded"] = max(load0, h["loadavg_1m"]) > 0.5 * (h["cpus"] or 1)
        print(json.dumps({"bench": "update_compare", "device": args.device, "rows": rows, "host": h}, indent=2))
        return
    if args.algo == "agro":
        algo = AGRO(AGROConfig(), obs_dim=17, act_dim=6, device=args.device)
    else:
        algo = PPO(PPOConfig(), obs_dim=17, act_dim=6, device=args.device)
    batch = synthetic_batch(args.steps, args.num_envs, 17, 6)
    cuda = torch.device(args.device).type == "cuda"
    algo.update(batch)  # warm-up
    prof = cProfile.Profile() if args.profile else None
    times, cpu = [], []
    for _ in range(args.updates):
        if prof:
            prof.enable()
        if cuda:
            torch.cuda.synchronize()  # nothing queued before the clock starts
        t0, c0 = time.perf_counter(), time.process_time()
        algo.update(batch)  # the batch starts on the host each time: its copy to the device is timed
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        if prof:
            prof.disable()
    out = {"bench": f"{args.algo}_update", "device": args.device, "batch": args.steps * args.num_envs,
           "update_s_median": round(float(np.median(times)), 4),
           "update_cpu_s_median": round(float(np.median(cpu)), 4),
           "samples_per_s": round(args.steps * args.num_envs * algo.config.update_epochs / float(np.median(times)), 1),
           "host": host_info(threads=args.threads, loadavg_1m=load_1m())}
    if cuda:
        out["host"].update(gpu=torch.cuda.get_device_name(algo.device), cuda=torch.version.cuda)
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.profile)
        out["profile_top"] = [ln.strip() for ln in s.getvalue().splitlines() if ln.strip()][-args.profile:]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
