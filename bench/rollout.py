"""Actor sampling speed against the raw vector environment, in one run.

For each number of envs (default 1 and 8) and vector mode, measures on the same env:
- ``raw_env_sps``: ``env.step`` with precomputed random actions, nothing else (the ceiling);
- ``actor_sps``: ``Actor.collect`` with a live ``Policy`` (inference, buffers, checks);
and prints one JSON document with ``actor_sps / raw_env_sps`` (target >= 0.5), by the wall clock
and by this process's CPU time (the steadier figure on a shared machine; sync mode only: async
envs step in other processes).

    python bench/rollout.py --env HalfCheetah-v5 --steps 20000 --num-envs 1 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench.common

from actor.actor import Actor, ActorConfig  # noqa: E402
from actor.envs import make_vector_env, spec_of  # noqa: E402
from agents.base import PolicyConfig, build_policy  # noqa: E402
from bench.common import DirectPolicy, host_info, load_1m  # noqa: E402


def raw_env_sps(env_id: str, num_envs: int, mode: str, steps: int, seed: int = 0) -> tuple[float, float]:
    env = make_vector_env(env_id, num_envs, mode)
    spec = spec_of(env, env_id)
    rng = np.random.default_rng(seed)
    acts = rng.uniform(spec.act_low, spec.act_high, size=(256, num_envs, spec.act_dim)).astype(np.float32)
    env.reset(seed=seed)
    n = max(1, steps // num_envs)
    t0, c0 = time.perf_counter(), time.process_time()
    for t in range(n):
        env.step(spec.to_env(acts[t % 256]))
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    env.close()
    return n * num_envs / elapsed, n * num_envs / cpu


def actor_sps(env_id: str, num_envs: int, mode: str, steps: int, fragment: int = 2048) -> tuple[float, float]:
    env = make_vector_env(env_id, num_envs, mode)
    spec = spec_of(env, env_id)
    policy = build_policy(PolicyConfig(), spec.obs_dim, spec.act_dim)
    actor = Actor(ActorConfig(env_id=env_id, num_envs=num_envs, fragment_steps=fragment, vector_mode=mode),
                  DirectPolicy(policy), events=None, env=env)
    T = max(1, min(fragment, steps // num_envs))
    actor.collect(min(T, 64))  # warm-up
    done, t0, c0 = 0, time.perf_counter(), time.process_time()
    while done < steps:
        done += actor.collect(T).size
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    env.close()
    return done / elapsed, done / cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", default="HalfCheetah-v5")
    ap.add_argument("--steps", type=int, default=20000, help="env steps per measurement (all envs together)")
    ap.add_argument("--num-envs", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--modes", nargs="+", default=["sync"], choices=["sync", "async"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for mode in args.modes:
        for n in args.num_envs:
            raw, raw_cpu = raw_env_sps(args.env, n, mode, args.steps)
            act, act_cpu = actor_sps(args.env, n, mode, args.steps)
            rows.append({"num_envs": n, "mode": mode, "raw_env_sps": round(raw, 1), "actor_sps": round(act, 1),
                         "actor_over_raw": round(act / raw, 3), "raw_env_cpu_sps": round(raw_cpu, 1),
                         "actor_cpu_sps": round(act_cpu, 1), "actor_over_raw_cpu": round(act_cpu / raw_cpu, 3)})
    print(json.dumps({
        "bench": "rollout", "env": args.env, "steps": args.steps, "target_actor_over_raw_min": 0.5,
        "host": host_info(threads=args.threads, loadavg_1m=load_1m()),
        "rows": rows,
    }, indent=2))


if __name__ == "__main__":
    main()
