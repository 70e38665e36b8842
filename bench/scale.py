"""Scale-out: samples/s against actors x stream workers, on a real Kafka broker, in one run.

For each (actors, stream workers, learner ranks) triple, a short ``run_decoupled`` (L learner
ranks over torch.distributed, N Faust workers in one group, M actor processes; sample topics with
``--partitions`` partitions, default 4); before them,
the single-process co-located run on the same settings as the baseline. Per run it reports:

- ``sps_steady``: samples trained per second by updates 2..N (GradientStep events; start-up left
  out), and ``sps_produced``: samples the actors published per second, first to last batch;
- per-component figures for the model of docs/howto/scale-out.md: the learner's mean update time
  (``learner_step_s``, from GradientStep start/finish; ``learner_capacity_sps`` = samples per
  update / that), one actor's own rate (``actor_sps``,
  steps / the time it spent collecting and publishing, waits left out), the sample bytes per record and the broker write rate per partition
  (``raw_mb_per_s_per_partition``), and the policy fan-out (PolicyVersion bytes x readers / s).

On one host the learner ranks share its cores with everything else (gloo on CPU); the axis says
what the all-reduce costs here, not what several GPUs would gain.

Prints one JSON document. The broker is a private ``LocalKafka`` (``--bootstrap`` uses another,
each run in a namespace of its own).

    python bench/scale.py --env Pendulum-v1 --steps 4096 --actors 1,2,4 --workers 1,2 --learners 1,2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench.common

import torch  # noqa: E402

from bench.common import Quiet, host_info, load_1m, private_broker, timed  # noqa: E402
from bench.decoupled import colocated  # noqa: E402
from config import BusConfig, TrainConfig  # noqa: E402
from rlstream.decoupled import run_decoupled  # noqa: E402
from schemas.codec import Codec  # noqa: E402
from streams.bus.kafka import KafkaBus  # noqa: E402
from streams.topics import LEARNER_STEPS, POLICY_VERSIONS, SAMPLES_RAW, Namespace  # noqa: E402

CODEC = Codec()


def figures(bootstrap: str, ns: Namespace, partitions: int, readers: int) -> dict:
    """Throughput and per-component figures of one run, from its topics."""
    with KafkaBus(bootstrap, client_id="rlstream-bench-scale", auto_create=False) as bus:
        steps = sorted((CODEC.decode(r.value) for r in bus.read_all(ns.topic(LEARNER_STEPS))), key=lambda g: g.step)
        raw = [(len(r.value), CODEC.decode(r.value)) for r in bus.read_all(ns.topic(SAMPLES_RAW))]
        policy_bytes = [len(r.value) for r in bus.read_all(ns.topic(POLICY_VERSIONS))]
    if len(steps) < 2:
        return {"sps_steady": None, "updates": len(steps)}
    t0, t1 = steps[0].finished_at_ms, steps[-1].finished_at_ms
    dt = (t1 - t0) / 1e3
    made = sorted(b.created_at_ms for _, b in raw)
    produce_s = max(1e-3, (made[-1] - made[0]) / 1e3) if made else 1e-3
    raw_bytes = sum(n for n, _ in raw)
    step_s = sum(g.finished_at_ms - g.started_at_ms for g in steps) / len(steps) / 1e3
    update_samples = sum(g.num_samples for g in steps) / len(steps)
    return {
        "updates": len(steps),
        "sps_steady": round(sum(g.num_samples for g in steps[1:]) / dt, 1),
        "sps_produced": round(sum(b.size for _, b in raw) / produce_s, 1),
        "learner_step_s": round(step_s, 4),
        "update_samples": round(update_samples, 1),
        "learner_capacity_sps": round(update_samples / step_s, 1),
        "sample_record_bytes": round(sum(n for n, _ in raw) / max(1, len(raw))),
        "raw_mb_per_s_per_partition": round(raw_bytes / produce_s / 1e6 / partitions, 4),
        "policy_record_bytes": round(sum(policy_bytes) / max(1, len(policy_bytes))),
        "policy_fanout_mb_per_s": round(sum(policy_bytes) * readers / dt / 1e6, 4),
        "train_loop_s": round(dt, 2),
    }


def one(base: dict, bootstrap: str, run_dir: Path, actors: int, workers: int, partitions: int, ranks: int = 1) -> dict:
    ns = Namespace(f"scale-{uuid.uuid4().hex[:8]}")
    cfg = TrainConfig(**base, mode="decoupled", num_actors=actors, stream_workers=workers, learners=ranks,
                      run_dir=run_dir,
                      bus=BusConfig(kind="kafka", bootstrap=bootstrap, partitions=partitions, namespace=ns.name),
                      policy_id=f"bench-{ns.name}")
    summary, wall = timed(run_decoupled, cfg, log=Quiet())
    procs = summary["processes"]
    actor_sps = [p["steps"] / p["collect_s"] for n, p in procs.items() if n.startswith("actor") and p.get("collect_s")]
    out = {"actors": actors, "stream_workers": workers, "learner_ranks": ranks, "wall_s": round(wall, 1),
           "exit_codes": summary["exit_codes"], "restarts": summary["restarts"],
           "actor_sps": round(sum(actor_sps) / len(actor_sps), 1) if actor_sps else None,
           **figures(bootstrap, ns, partitions, readers=actors + workers)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", default="Pendulum-v1")
    ap.add_argument("--algo", default="agro")
    ap.add_argument("--steps", type=int, default=4096, help="env steps per run")
    ap.add_argument("--train-batch-size", type=int, default=512)
    ap.add_argument("--actors", default="1,2,4")
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--learners", default="1", help="learner ranks (torch.distributed), comma separated")
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--bootstrap", default=None, help="use this broker instead of a private one")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = dict(algo=args.algo, env_id=args.env, total_steps=args.steps, num_envs=1,
                train_batch_size=args.train_batch_size, log_every_s=2.0, snapshot_every=0, torch_threads=1,
                plot=False, tensorboard=None)
    broker = contextlib.nullcontext(args.bootstrap) if args.bootstrap else private_broker()
    runs = []
    with tempfile.TemporaryDirectory() as d, broker as bootstrap:
        co = colocated(TrainConfig(**base, run_dir=Path(d) / "colocated"))
        for a in (int(x) for x in args.actors.split(",")):
            for w in (int(x) for x in args.workers.split(",")):
                for r in (int(x) for x in args.learners.split(",")):
                    runs.append(one(base, bootstrap, Path(d) / f"a{a}w{w}r{r}", a, w, args.partitions, r))
    baseline = co.get("sps_steady")
    for r in runs:
        r["vs_colocated"] = round(r["sps_steady"] / baseline, 3) if r.get("sps_steady") and baseline else None
    print(json.dumps({
        "bench": "scale",
        "host": host_info(load_1m=load_1m()),
        "env": args.env, "algo": args.algo, "steps": args.steps, "train_batch_size": args.train_batch_size,
        "partitions": args.partitions,
        "colocated": {k: co.get(k) for k in ("sps_steady", "sps_wall", "updates", "wall_s")},
        "runs": runs,
    }, indent=2))


if __name__ == "__main__":
    main()
