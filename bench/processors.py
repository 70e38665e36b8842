"""Throughput of the prepare pipeline (reorder -> staleness -> IS) on one core; prints JSON.

    python bench/processors.py [--batches 400] [--t 128] [--n 8]

Batches are HalfCheetah-sized (obs 17, act 6), T*N transitions each (default 128 x 8 = 1024),
from several actors, partly reordered; the current policy is an ``agents.networks.Policy``
(64x64 tanh MLP + obs normaliser) decoded from safetensors like in production. Measured:

* ``pipeline_is``: every batch one version behind the latest -> IS weights computed;
* ``pipeline_onpolicy``: behaviour == current -> IS skipped (weights 1);
* ``pipeline_no_is``: importance disabled;
* ``is_only``: ``PolicyLogpFn`` + ``ImportanceWeights.from_logps`` alone;
* ``reorder_staleness_only``: the pipeline with a free logp function;
* ``codec_decode`` / ``codec_encode_prepared``: the Avro codec around it (for context).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from schemas.codec import Codec  # noqa: E402
from schemas.events import PolicyVersion, SampleBatch  # noqa: E402
from schemas.weights import encode_weights  # noqa: E402
from streams.policies import PolicyLogpFn  # noqa: E402
from streams.processors.importance import ImportanceWeights  # noqa: E402
from bench.common import host_info  # noqa: E402
from config import PrepareConfig  # noqa: E402
from streams.processors.pipeline import Prepare  # noqa: E402

OBS, ACT = 17, 6


def make_batches(count: int, t: int, n: int, actors: int, version: int, rng: np.random.Generator) -> list[SampleBatch]:
    out = []
    seqs = [0] * actors
    for i in range(count):
        a = i % actors
        out.append(SampleBatch(
            batch_id=f"b{i}-{version}", actor_id=f"actor-{a}", seq=seqs[a], env_id="HalfCheetah-v5",
            policy_version=version, created_at_ms=10**12,
            obs=rng.standard_normal((t, n, OBS), dtype=np.float32),
            actions=rng.standard_normal((t, n, ACT), dtype=np.float32),
            rewards=rng.standard_normal((t, n), dtype=np.float32), terminated=np.zeros((t, n), bool),
            truncated=np.zeros((t, n), bool), behaviour_logp=rng.uniform(-12, -6, (t, n)).astype(np.float32),
            last_obs=np.zeros((n, OBS), np.float32), final_obs_index=np.zeros((0,), np.int64),
            final_obs=np.zeros((0, OBS), np.float32),
        ))
        seqs[a] += 1
    # reorder: swap neighbours of the same actor every 4th pair
    for i in range(0, count - actors, 4 * actors):
        out[i], out[i + actors] = out[i + actors], out[i]
    return out


def policy_versions() -> list[PolicyVersion]:
    from agents.networks import Policy

    torch.manual_seed(0)
    p = Policy(OBS, ACT, hidden=(64, 64))
    pvs = []
    for v in (0, 1):
        w = encode_weights(p.state_dict(), {"obs_dim": OBS, "act_dim": ACT, "hidden": [64, 64], "activation": "tanh"})
        pvs.append(PolicyVersion("policy", v, 10**12, "bench", "ppo", weights=w))
        with torch.no_grad():
            for prm in p.net.actor_mean.parameters():
                prm.add_(0.01 * torch.randn_like(prm))
    return pvs


def run_pipeline(batches: list[SampleBatch], cfg: PrepareConfig, pvs: list[PolicyVersion], factory) -> dict:
    clock = lambda: 10**12  # noqa: E731  (nothing times out, nothing is stale by age)
    prep = Prepare.from_config(cfg, factory, clock=clock)
    for pv in pvs:
        prep.on_policy(pv)
    prep.push(batches[0])  # warm-up: builds the policy once
    t0 = time.perf_counter()
    emitted = 0
    for i, b in enumerate(batches[1:]):
        emitted += len(prep.push(b, 0, i))
    emitted += len(prep.drain())
    dt = time.perf_counter() - t0
    samples = sum(b.size for b in batches[1:])
    s = prep.stats
    assert s.dropped_batches == 0, s.drops
    return {"samples_per_s": round(samples / dt), "batches_per_s": round((len(batches) - 1) / dt, 1),
            "us_per_batch": round(dt / (len(batches) - 1) * 1e6, 1), "is_computed_batches": s.is_computed_batches,
            "reordered": s.reorder.reordered}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=400)
    ap.add_argument("--t", type=int, default=128)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--actors", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    pvs = policy_versions()
    behind = make_batches(args.batches, args.t, args.n, args.actors, version=0, rng=rng)
    onpol = make_batches(args.batches, args.t, args.n, args.actors, version=1, rng=rng)
    cfg = PrepareConfig(max_versions=4, max_ms=None, reorder_window=32, behaviour_cap=5.0)
    free = lambda pv: (lambda obs, act: np.full(obs.shape[:2], -9.0, np.float32))  # noqa: E731

    results = {
        "pipeline_is": run_pipeline(behind, cfg, pvs, PolicyLogpFn.from_policy_version),
        "pipeline_onpolicy": run_pipeline(onpol, cfg, pvs, PolicyLogpFn.from_policy_version),
        "pipeline_no_is": run_pipeline(behind, PrepareConfig(**{**cfg.__dict__, "importance": False}), pvs, None),
        "reorder_staleness_only": run_pipeline(behind, cfg, pvs, free),
    }
    fn = PolicyLogpFn.from_policy_version(pvs[1])
    iw = ImportanceWeights(behaviour_cap=5.0)
    fn(behind[0].obs, behind[0].actions)
    t0 = time.perf_counter()
    for b in behind:
        iw.from_logps(b.behaviour_logp, fn(b.obs, b.actions))
    dt = time.perf_counter() - t0
    results["is_only"] = {"samples_per_s": round(sum(b.size for b in behind) / dt),
                          "us_per_batch": round(dt / len(behind) * 1e6, 1)}
    t0 = time.perf_counter()
    for b in behind:
        fn(b.obs, b.actions)
    dt = time.perf_counter() - t0
    results["logp_forward_only"] = {"us_per_batch": round(dt / len(behind) * 1e6, 1)}

    codec = Codec()
    enc = [codec.encode(b) for b in behind[:100]]
    t0 = time.perf_counter()
    for e in enc:
        codec.decode(e, SampleBatch)
    dt = time.perf_counter() - t0
    results["codec_decode"] = {"samples_per_s": round(sum(b.size for b in behind[:100]) / dt),
                               "us_per_batch": round(dt / 100 * 1e6, 1), "bytes_per_batch": len(enc[0])}
    prep = Prepare.from_config(cfg, PolicyLogpFn.from_policy_version, clock=lambda: 10**12)
    for pv in pvs:
        prep.on_policy(pv)
    pbs = [o for i, b in enumerate(behind[:100]) for o in prep.push(b, 0, i)] + prep.drain()
    t0 = time.perf_counter()
    for pb in pbs:
        codec.encode(pb)
    dt = time.perf_counter() - t0
    results["codec_encode_prepared"] = {"us_per_batch": round(dt / len(pbs) * 1e6, 1)}

    base = results["pipeline_no_is"]["us_per_batch"]
    out = {
        "bench": "processors",
        "config": {"batches": args.batches, "T": args.t, "N": args.n, "transitions_per_batch": args.t * args.n,
                   "obs_dim": OBS, "act_dim": ACT, "policy": "Policy(17, 6, hidden=(64, 64), tanh)",
                   "actors": args.actors, "torch_threads": torch.get_num_threads()},
        "results": results,
        "overhead_us_per_batch": {
            "is_vs_no_is": round(results["pipeline_is"]["us_per_batch"] - base, 1),
            "onpolicy_vs_no_is": round(results["pipeline_onpolicy"]["us_per_batch"] - base, 1),
        },
        "target_samples_per_s": 100_000,
        "meets_target": results["pipeline_is"]["samples_per_s"] >= 100_000
        and results["pipeline_is"]["is_computed_batches"] > 0,  # a run that computed no IS measured nothing
        "host": host_info(),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
