"""Co-located pipeline overhead and policy latency.

Runs, in one process and one run, on the same env with the same PPO settings:
- ``peer``: the plain loop (vector env + policy rollout, then the PPO update) with no bus,
  no codec, no processors — what a single-file PPO does;
- ``rollout_only``: the raw vector-env + policy rollout loop, no training;
- ``rlstream``: ``rlstream train --mode colocated`` (every event Avro-encoded on the memory bus,
  through the stream processors, learner publishes versions, actors adopt them).

Prints one JSON document: SPS of each, overhead = 1 - rlstream/peer (target <= 15 %), policy
latency p50/p99 (learner publish -> actor adoption; target p99 < 10 ms) and freshness.

    python bench/colocated.py --env HalfCheetah-v5 --steps 40960
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench.common

from actor.actor import Actor, ActorConfig  # noqa: E402
from actor.envs import make_vector_env  # noqa: E402
from bench.common import DirectPolicy, host_info, timed  # noqa: E402
from learner.batching import StreamIds, to_trajectory_batch  # noqa: E402
from rlstream import wiring  # noqa: E402
from rlstream.colocated import run_colocated  # noqa: E402
from config import TrainConfig  # noqa: E402
from runtime.metrics import Metrics  # noqa: E402
from runtime.progress import quantiles_ms  # noqa: E402
from schemas.events import PreparedBatch, now_ms  # noqa: E402


def peer_loop(cfg: TrainConfig, train: bool) -> dict:
    info = wiring.env_info(cfg)
    algo = wiring.build_algo(cfg, info.obs_dim, info.act_dim, info.nvec)
    env = make_vector_env(cfg.env_id, cfg.num_envs)
    acfg = ActorConfig(env_id=cfg.env_id, num_envs=cfg.num_envs, fragment_steps=cfg.effective_fragment_steps(),
                       seed=cfg.seed)
    source = DirectPolicy(algo.policy)
    actor = Actor(acfg, source, events=None, env=env)
    ids = StreamIds()
    steps, t0 = 0, time.perf_counter()
    returns: list[float] = []
    while steps < cfg.total_steps:
        b = actor.collect(acfg.fragment_steps)
        steps += b.size
        returns += b.episode_returns
        if train:
            ones = np.ones(b.rewards.shape, np.float32)
            algo.update(to_trajectory_batch([PreparedBatch(b, 0, 0, 0, ones, ones, now_ms())], ids))
    elapsed = time.perf_counter() - t0
    env.close()
    return {"sps": round(steps / elapsed, 1), "steps": steps, "elapsed_s": round(elapsed, 2),
            "return_mean_last10": round(float(np.mean(returns[-10:])), 1) if returns else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", default="HalfCheetah-v5")
    ap.add_argument("--steps", type=int, default=40960)
    ap.add_argument("--num-envs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as d:
        cfg = TrainConfig(env_id=args.env, total_steps=args.steps, num_envs=args.num_envs, preset="none",
                          run_dir=Path(d), log_every_s=1e9, snapshot_every=0)
        rollout = peer_loop(cfg, train=False)
        peer = peer_loop(cfg, train=True)
        metrics = Metrics(role="colocated")
        in_loop: list[float] = []
        observe = metrics.observe_policy_latency

        def record(seconds: float) -> None:
            in_loop.append(seconds)
            observe(seconds)

        metrics.observe_policy_latency = record
        summary, elapsed = timed(run_colocated, cfg, metrics=metrics)
    # the first adoption is version 0, published before the actor (and its env) is even built:
    # that is start-up time, which the subscriber keeps apart (actor.policy_client's module doc)
    lat = {"in_training_loop": quantiles_ms(in_loop),
           "startup_adoption_ms": summary.get("startup_adoption_ms"),
           "probe_threaded": latency_probe(cfg)}
    ours = summary["steps"] / elapsed
    out = {
        "bench": "colocated",
        "host": host_info(threads=args.threads),
        "env": args.env, "steps": args.steps, "num_envs": args.num_envs,
        "rollout_only_sps": rollout["sps"],
        "peer_plain_loop_sps": peer["sps"],
        "rlstream_colocated_sps": round(ours, 1),
        "overhead_vs_peer": round(1 - ours / peer["sps"], 4),
        "target_overhead_max": 0.15,
        "policy_latency_ms": lat,
        "target_policy_latency_p99_ms": 10.0,
        "freshness": summary.get("streams", {}).get("freshness"),
        "target_freshness_min": 0.95,
        "events": summary["events"],
    }
    print(json.dumps(out, indent=2))


def latency_probe(cfg: TrainConfig, n: int = 300) -> dict:
    """Learner publish -> actor adoption with the actor's subscriber blocked in poll on another
    thread (the threaded co-located layout): bus + Avro codec + safetensors decode + load."""
    import threading

    from actor.policy_client import PolicySubscriber
    from learner.learner import Learner, LearnerConfig

    bus = wiring.build_bus(cfg.bus)
    events = wiring.build_events(bus, None)
    info = wiring.env_info(cfg)
    learner = Learner(LearnerConfig(), wiring.build_algo(cfg, info.obs_dim, info.act_dim, info.nvec), events)
    learner.start(resume=False)
    got: list[float] = []
    sub = PolicySubscriber(events, "policy", "probe", on_latency=got.append)
    stop = threading.Event()

    def follow() -> None:
        while not stop.is_set():
            sub.poll(0.5)

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    for _ in range(n):
        before = len(got)
        learner._publish(parent=learner.version)
        deadline = time.monotonic() + 2
        while len(got) == before and time.monotonic() < deadline:
            time.sleep(0.0005)
    stop.set()
    t.join()
    return quantiles_ms(got)  # the first adoption (start-up) is not among them


if __name__ == "__main__":
    main()
