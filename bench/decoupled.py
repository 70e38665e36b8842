"""Decoupled (Kafka, separate processes) vs co-located (one process, memory bus), in one run.

On the same env with the same settings (algorithm, budget, batch, fragment length, seed, one
torch thread per process):

- ``colocated``: ``run_colocated`` in this process;
- ``decoupled``: ``run_decoupled`` -- ``rlstream learner``, ``faust -A streams worker`` and
  ``rlstream actor`` processes over Kafka (see below);
- ``offpolicy`` (``--offpolicy agro``; ``""`` skips it): the same decoupled run with an
  off-policy algorithm, whose actor free-runs under backpressure with a dynamic fragment length.

Prints one JSON document with, per run:

- SPS: ``sps_steady`` = samples trained by updates 2..N / the time from the end of update 1 to
  the end of update N (GradientStep events: the training loop, without process start-up), and
  ``sps_wall`` = samples trained / wall time including start-up. Target: decoupled >= 70 % of
  co-located (``decoupled_vs_colocated``, steady).
- policy latency: learner publish -> actor adoption (what ``rlstream_policy_latency_seconds``
  observes; exact quantiles here). Target: decoupled p99 < 100 ms. ``policy_latency_parts_ms``:
  where it went (docs/explanation/policy-latency.md); ``inflight_swaps``: versions the actor took
  within a fragment, ``cut_fragments``: fragments it ended early for one.
- freshness: % of samples within the staleness window at the stream processors. Targets:
  decoupled > 70 %, co-located > 95 %.

The decoupled runs go to a Kafka broker of the benchmark's own (``localkafka.broker.LocalKafka`` on
free ports, started before and killed after; not timed), or to ``--bootstrap``, whose ``rl.*``
topics and role consumer groups are then reset (``KafkaBus.reset_topics``) before each run --
a development broker only.

    python bench/decoupled.py --env HalfCheetah-v5 --steps 16384
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench.common

from bench.common import Quiet, host_info, private_broker, timed  # noqa: E402
from rlstream import wiring  # noqa: E402
from rlstream.colocated import run_colocated  # noqa: E402
from config import BusConfig, TrainConfig  # noqa: E402
from rlstream.decoupled import run_decoupled  # noqa: E402
from runtime.progress import quantiles_ms  # noqa: E402
from runtime.metrics import Metrics  # noqa: E402
from schemas.codec import Codec  # noqa: E402
from streams.topics import LEARNER_STEPS, STREAMS_GROUP, all_topics  # noqa: E402

ROLE_GROUPS = (STREAMS_GROUP, "learner")


def steady_sps(bus) -> dict:
    """Samples per second of the training loop, from the GradientStep events: the samples of
    updates 2..N over the time from the end of update 1 to the end of update N (process
    start-up and the first collection are left out)."""
    codec = Codec()
    steps = sorted((codec.decode(r.value) for r in bus.read_all(LEARNER_STEPS)), key=lambda g: g.step)
    if len(steps) < 2:
        return {"sps_steady": None, "updates_timed": len(steps)}
    dt = (steps[-1].finished_at_ms - steps[0].finished_at_ms) / 1e3
    samples = sum(g.num_samples for g in steps[1:])
    return {"sps_steady": round(samples / dt, 1), "updates_timed": len(steps) - 1, "train_loop_s": round(dt, 2),
            "mean_update_samples": round(sum(g.num_samples for g in steps) / len(steps), 1)}


def colocated(cfg: TrainConfig) -> dict:
    bus = wiring.build_bus(BusConfig())
    metrics = Metrics(role="colocated")
    latencies: list[float] = []
    observe = metrics.observe_policy_latency

    def record(seconds: float) -> None:  # exact values, as the decoupled actor reports them
        latencies.append(seconds)
        observe(seconds)

    metrics.observe_policy_latency = record
    summary, wall = timed(run_colocated, cfg, log=Quiet(), metrics=metrics, bus=bus)
    trained = summary["updates"] * cfg.train_batch_size
    out = {"wall_s": round(wall, 2), "updates": summary["updates"], "sps_wall": round(trained / wall, 1),
           **steady_sps(bus),
           "policy_latency_ms": quantiles_ms(latencies),
           "freshness": summary["streams"]["freshness"], "return_mean20": summary.get("return_mean20")}
    bus.close()
    return out


def decoupled(cfg: TrainConfig) -> dict:
    from streams.bus.kafka import KafkaBus

    with KafkaBus(cfg.bus.bootstrap, client_id="rlstream-bench-reset") as admin:
        admin.reset_topics(all_topics(), groups=ROLE_GROUPS)
    summary, wall = timed(run_decoupled, cfg, log=Quiet())
    procs = summary["processes"]
    learner, actor, streams = procs.get("learner", {}), procs.get("actor-0", {}), procs.get("streams", {})
    with KafkaBus(cfg.bus.bootstrap, client_id="rlstream-bench-reader") as bus:
        steady = steady_sps(bus)
    trained = learner.get("samples_trained", 0)
    return {"wall_s": round(wall, 2), "exit_codes": summary["exit_codes"], "updates": learner.get("updates"),
            "sps_wall": round(trained / wall, 1), **steady,
            "actor_steps": actor.get("steps"), "policy_latency_ms": actor.get("policy_latency_ms"),
            "policy_latency_parts_ms": actor.get("policy_latency_parts_ms"), "cut_fragments": actor.get("cut_fragments"),
            "inflight_swaps": actor.get("inflight_swaps"), "actor_collect_s": actor.get("collect_s"),
            "freshness": streams.get("freshness"), "drops": streams.get("drops"),
            "lag_versions": streams.get("lag_versions"), "flow": actor.get("flow"),
            "breaker_trips": learner.get("breaker_trips")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", default="HalfCheetah-v5")
    ap.add_argument("--algo", default="ppo")
    ap.add_argument("--steps", type=int, default=16384)
    ap.add_argument("--train-batch-size", type=int, default=2048)
    ap.add_argument("--num-envs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (all runs)")
    ap.add_argument("--bootstrap", default=None,
                    help="use this broker (its rl.* topics are reset!) instead of a private one")
    ap.add_argument("--offpolicy", default="agro", help="also run this off-policy algorithm decoupled ('' skips)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    broker = contextlib.nullcontext(args.bootstrap) if args.bootstrap else private_broker()
    with tempfile.TemporaryDirectory() as d, broker as bootstrap:
        base = dict(algo=args.algo, env_id=args.env, total_steps=args.steps, num_envs=args.num_envs,
                    train_batch_size=args.train_batch_size, log_every_s=1e9, snapshot_every=0,
                    torch_threads=args.threads, preset="none")
        co = colocated(TrainConfig(**base, run_dir=Path(d) / "colocated"))
        kafka = BusConfig(kind="kafka", bootstrap=bootstrap)
        de = decoupled(TrainConfig(**base, mode="decoupled", bus=kafka, run_dir=Path(d) / "decoupled",
                                   policy_id=f"bench-{uuid.uuid4().hex[:8]}"))
        off = None
        if args.offpolicy:
            off = decoupled(TrainConfig(**{**base, "algo": args.offpolicy}, mode="decoupled", bus=kafka,
                                        run_dir=Path(d) / "offpolicy", policy_id=f"bench-{uuid.uuid4().hex[:8]}"))
            off["algo"] = args.offpolicy
    ratio = (de["sps_steady"] / co["sps_steady"]) if de.get("sps_steady") and co.get("sps_steady") else None
    lat = (de.get("policy_latency_ms") or {}).get("p99")
    out = {
        "bench": "decoupled",
        "host": host_info(threads_per_process=args.threads),
        "broker": args.bootstrap or "private LocalKafka", "env": args.env, "algo": args.algo, "steps": args.steps, "train_batch_size": args.train_batch_size,
        "num_envs": args.num_envs,
        "colocated": co, "decoupled": de, "offpolicy_decoupled": off,
        "decoupled_vs_colocated": None if ratio is None else round(ratio, 3), "target_ratio_min": 0.7,
        "decoupled_policy_latency_p99_ms": lat, "target_policy_latency_p99_ms": 100.0,
        "freshness": {"colocated": co["freshness"], "decoupled": de["freshness"],
                      "offpolicy_decoupled": off["freshness"] if off else None},
        "target_freshness_min": {"colocated": 0.95, "decoupled": 0.70},
        "ok": {"ratio": ratio is not None and ratio >= 0.7, "latency": lat is not None and lat < 100.0,
               "freshness_decoupled": (de["freshness"] or 0) > 0.70 and (off is None or (off["freshness"] or 0) > 0.70),
               "freshness_colocated": co["freshness"] > 0.95},
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
