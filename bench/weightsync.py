"""Weight sync: publish-to-adoption latency of a new PolicyVersion at many subscribed actors.

On the real Kafka broker (``KAFKA_BROKERS``), ``--actors`` real ``PolicySubscriber``s (each its own
Kafka consumer, the same class the actors use: fetch, Avro decode, claim-check fetch and sha256,
safetensors decode, ``load_state_dict``) run as threads spread over ``--procs`` processes. The
learner side publishes ``--versions`` new versions of a policy of about ``--params`` parameters,
each once every subscriber has adopted the previous one. Weights over the inline limit go by
claim check to Redis (``REDIS_URL``). Prints one JSON document: p50/p99/max latency per size,
broker bytes per version (the record) and blob bytes per version.

    KAFKA_BROKERS=127.0.0.1:9092 REDIS_URL=redis://127.0.0.1:6379/0 \\
        python bench/weightsync.py --actors 64 --params 1000000 10000000
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import threading
import time
import uuid

import numpy as np
import torch

from actor.policy_client import PolicySubscriber
from agents.networks import Policy
from rlstream.config import BusConfig
from streams.policies import DEFAULT_INLINE_LIMIT, RedisBlobStore, load_policy, make_policy_version, publish_policy_version
from rlstream.wiring import build_bus, build_events

OBS, ACT = 64, 8
POLICY_ID = "weightsync"


def policy_of_size(params: int) -> Policy:
    """A 2-hidden-layer policy with about ``params`` parameters (actor + critic)."""
    h = int((-(OBS + ACT + 3) + math.sqrt((OBS + ACT + 3) ** 2 + 2 * params)) / 2)  # 2h^2 + (2*OBS+ACT+5)h ~ params
    torch.manual_seed(0)
    return Policy(OBS, ACT, hidden=(max(h, 1), max(h, 1)))


def _subscriber_thread(bus, blob, module: Policy, stage: str, out: mp.Queue, stop) -> None:
    events = build_events(bus, None, publish_schemas=False)
    lat: list[float] = []
    sub = PolicySubscriber(events, POLICY_ID, stage, on_latency=lat.append, blob_store=blob)
    sub.policy = module  # an actor's module exists before its first version: only weights load
    try:
        sub.wait_for(0, 600)
        out.put(("ready", stage, sub.version, 0.0))
        while not stop.is_set():
            if sub.poll(0.1) and lat:
                out.put(("adopted", stage, sub.version, lat[-1]))
    except Exception as e:  # an actor that dies is reported, never waited for
        out.put(("error", stage, sub.version, f"{type(e).__name__}: {e}"))
    finally:
        sub.close()


def _worker(proc: int, threads: int, params: int, bootstrap: str, namespace: str, redis_url: str | None,
            out: mp.Queue, stop) -> None:
    torch.set_num_threads(1)
    bus = build_bus(BusConfig(kind="kafka", bootstrap=bootstrap, namespace=namespace))
    blob = RedisBlobStore(redis_url) if redis_url else None
    module = policy_of_size(params)  # built once per process (orthogonal init is costly), copied per actor
    ts = [threading.Thread(target=_subscriber_thread, args=(bus, blob, copy.deepcopy(module), f"ws-{proc}-{i}", out, stop),
                           daemon=True) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    bus.close()


def _drain(out: mp.Queue, want: int, kind: str, version: int, timeout: float, errors: list[str]) -> list[float]:
    """Values of ``want`` ``kind`` reports for ``version`` (fewer at the deadline); a dead subscriber
    ("error") lowers ``want`` and lands in ``errors``."""
    got: list[float] = []
    deadline = time.monotonic() + timeout
    while len(got) < want - len(errors) and time.monotonic() < deadline:
        try:
            k, stage, v, s = out.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        if k == "error":
            errors.append(f"{stage} (at version {v}): {s}")
        elif k == kind and v == version:
            got.append(s)
    return got


def run_size(params: int, args, redis_url: str | None) -> dict:
    policy = policy_of_size(params)
    n_params = sum(p.numel() for p in policy.parameters())
    namespace = f"weightsync-{uuid.uuid4().hex[:8]}"
    bus = build_bus(BusConfig(kind="kafka", bootstrap=args.bootstrap, namespace=namespace))
    events = build_events(bus, None)
    blob = RedisBlobStore(redis_url) if redis_url else None

    def publish(version: int) -> tuple[int, int]:
        pv = make_policy_version(policy, policy_id=POLICY_ID, version=version, parent_version=version - 1 if version else None,
                                 learner_id="bench", algo="ppo", blob_store=blob)
        publish_policy_version(events, pv)
        return len(events.codec.encode(pv)), (pv.weights_ref.size if pv.weights_ref is not None else 0)

    publish(0)
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    per = [args.actors // args.procs + (1 if i < args.actors % args.procs else 0) for i in range(args.procs)]
    procs = [ctx.Process(target=_worker, args=(i, n, params, args.bootstrap, namespace, redis_url, out, stop), daemon=True)
             for i, n in enumerate(per) if n]
    for p in procs:
        p.start()
    errors: list[str] = []
    ready = _drain(out, args.actors, "ready", 0, 600, errors)
    lat: list[float] = []
    record_bytes = blob_bytes = 0
    missing = 0
    try:
        if len(ready) + len(errors) < args.actors:
            raise RuntimeError(f"only {len(ready)} of {args.actors} subscribers adopted version 0 within 600 s")
        for v in range(1, args.versions + 1):
            with torch.no_grad():
                policy.net.actor_mean[-1].bias.add_(0.01)  # a new version really differs
            record_bytes, blob_bytes = publish(v)
            got = _drain(out, args.actors, "adopted", v, 60, errors)
            missing += args.actors - len(got)
            lat += got
    finally:
        stop.set()
        for p in procs:
            p.join(30)
    # the cost of one adoption (claim-check fetch, decode, load into the existing module) here
    pv = make_policy_version(policy, policy_id=POLICY_ID, version=99, parent_version=None, learner_id="bench",
                             algo="ppo", blob_store=blob)
    record = events.codec.encode(pv)
    target = policy_of_size(params)
    t0 = time.perf_counter()
    load_policy(events.codec.decode(record), blob, into=target)
    load_s = time.perf_counter() - t0
    bus.close()
    a = np.asarray(lat) * 1e3
    return {
        "params": n_params, "weights_bytes": n_params * 4, "claim_check": blob_bytes > 0,
        "actors": args.actors, "versions": args.versions, "adoptions": len(lat), "missing": missing,
        "latency_ms": {"p50": round(float(np.percentile(a, 50)), 1), "p99": round(float(np.percentile(a, 99)), 1),
                       "max": round(float(a.max()), 1)} if a.size else None,
        "broker_bytes_per_version": record_bytes,
        "blob_bytes_per_version": blob_bytes,
        "blob_bytes_fetched_per_version": blob_bytes * args.actors,
        "one_adoption_decode_fetch_load_ms": round(load_s * 1e3, 1),
        "subscriber_errors": errors,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bootstrap", default=os.environ.get("KAFKA_BROKERS"))
    ap.add_argument("--redis", default=os.environ.get("REDIS_URL"))
    ap.add_argument("--actors", type=int, default=64)
    ap.add_argument("--procs", type=int, default=4, help="processes the subscriber threads are spread over")
    ap.add_argument("--params", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--versions", type=int, default=10)
    args = ap.parse_args()
    if not args.bootstrap:
        raise SystemExit("set KAFKA_BROKERS (or --bootstrap) to the Kafka broker")
    torch.set_num_threads(1)
    rows = []
    for params in args.params:
        needs_blob = params * 4 > DEFAULT_INLINE_LIMIT
        if needs_blob and not args.redis:
            raise SystemExit(f"{params} parameters exceed the inline limit: set REDIS_URL (or --redis) for the claim check")
        rows.append(run_size(params, args, args.redis if needs_blob else None))
    print(json.dumps({
        "bench": "weightsync", "target_p99_ms_max": 100.0, "inline_limit_bytes": DEFAULT_INLINE_LIMIT,
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                 "loadavg_1m": round(os.getloadavg()[0], 2)},
        "rows": rows,
    }, indent=2))


if __name__ == "__main__":
    main()
