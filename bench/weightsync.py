"""Weight sync: publish-to-adoption latency of a new PolicyVersion at many subscribed actors.

On the real Kafka broker (``KAFKA_BROKERS``), ``--actors`` real ``PolicySubscriber``s (each its own
Kafka consumer, the same class the actors use) run as threads spread over ``--procs`` processes,
sharing each process's decoded versions as actors do. The learner side publishes ``--versions``
new versions of a policy of about ``--params`` parameters, each once every subscriber has adopted
the previous one. With Redis (``REDIS_URL``), weights over ``--claim-check-above`` go by claim
check; with a host cache (``streams.blobcache``) the subscribers' processes share one verified
copy of each blob, fetched once per host (``another-host``: the learner runs elsewhere) or left
there by the learner (``learner-host``). Prints one
JSON document, a row per size and cache mode: p50/p99/max of publish-to-adoption latency, of
publish-to-delivery (the Kafka part), of the CPU of one adoption and of the learner's work before
the record goes out (encode, sha256, blob write); broker bytes per version
(the record), blob bytes per version and how often they were fetched; and, in one process, the
parts of one adoption (Redis fetch, sha256 + decode, load by reference and by copy).

    KAFKA_BROKERS=127.0.0.1:9092 REDIS_URL=redis://127.0.0.1:6379/0 \\
        python bench/weightsync.py --actors 64 --params 1000000 10000000
"""

from __future__ import annotations

from config.env import Environment

import argparse
import copy
import json
import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench.common

from actor.policy_client import PolicySubscriber  # noqa: E402
from agents.networks import Policy  # noqa: E402
from bench.common import host_info, load_1m, policy_of_size  # noqa: E402
from config import BusConfig  # noqa: E402
from rlstream.wiring import build_bus, build_events  # noqa: E402
from streams.policies import (  # noqa: E402
    DEFAULT_CLAIM_CHECK_ABOVE,
    DEFAULT_INLINE_LIMIT,
    PROCESS_WEIGHTS,
    decode_version,
    load_state,
    make_policy_version,
    open_blob_store,
    publish_policy_version,
)

POLICY_ID = "weightsync"


def _subscriber_thread(bus, blob, module: Policy, stage: str, out: mp.Queue, stop) -> None:
    events = build_events(bus, None, publish_schemas=False)
    lat: list[float] = []
    sub = PolicySubscriber(events, POLICY_ID, stage, on_latency=lat.append, blob_store=blob)
    sub.policy = module  # an actor's module exists before its first version: only weights load
    delivered: dict[int, float] = {}
    follower_poll = sub.follower.poll

    def poll_and_stamp(timeout: float):  # publish-to-delivery: when the record left the consumer
        ups = follower_poll(timeout)
        for u in ups:
            delivered[u.version] = u.latency_s() or 0.0
        return ups

    sub.follower.poll = poll_and_stamp
    try:
        sub.wait_for(0, 600)
        out.put(("ready", stage, sub.version, 0.0))
        while not stop.is_set():
            cpu = time.thread_time()
            if sub.poll(0.1) and lat:
                out.put(("adopted", stage, sub.version,
                         (lat[-1], delivered.get(sub.version, float("nan")), time.thread_time() - cpu)))
    except Exception as e:  # an actor that dies is reported, never waited for
        out.put(("error", stage, sub.version, f"{type(e).__name__}: {e}"))
    finally:
        sub.close()


def _worker(proc: int, threads: int, params: int, bootstrap: str, namespace: str, redis_url: str | None,
            cache_dir: str | None, out: mp.Queue, stop, enter=None) -> None:
    if enter is not None:  # first, before any socket or thread: onto a simulated host (bench/weightsync_hosts.py)
        enter()
    torch.set_num_threads(1)
    bus = build_bus(BusConfig(kind="kafka", bootstrap=bootstrap, namespace=namespace))
    blob = open_blob_store(redis_url, cache_dir)
    module = policy_of_size(params)  # built once per process (orthogonal init is costly), copied per actor
    ts = [threading.Thread(target=_subscriber_thread, args=(bus, blob, copy.deepcopy(module), f"ws-{proc}-{i}", out, stop),
                           daemon=True) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    cache = getattr(blob, "cache", None)
    out.put(("shared", f"proc-{proc}", -1, (PROCESS_WEIGHTS.fills, PROCESS_WEIGHTS.hits, PROCESS_WEIGHTS.failures,
                                            cache.fills if cache else 0, cache.hits if cache else 0)))
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


def _pcts(xs: list[float]) -> dict | None:
    a = np.asarray(xs) * 1e3
    return {"p50": round(float(np.percentile(a, 50)), 1), "p99": round(float(np.percentile(a, 99)), 1),
            "max": round(float(a.max()), 1)} if a.size else None


def _one_adoption(pv, blob, params: int) -> dict:
    """The parts of one adoption in this process: Redis fetch, sha256 + decode, load into an
    existing module by reference (what subscribers do) and by copy (what they did)."""
    t0 = time.perf_counter()
    data = pv.weights if pv.weights is not None else blob.get(pv.weights_ref.key)
    t1 = time.perf_counter()
    state, arch = decode_version(pv, lambda ref: data)
    t2 = time.perf_counter()
    by_ref, by_copy = policy_of_size(params), policy_of_size(params)
    t3 = time.perf_counter()
    load_state(state, arch, by_ref, assign=True)
    t4 = time.perf_counter()
    load_state(state, arch, by_copy)
    t5 = time.perf_counter()
    ms = lambda a, b: round((b - a) * 1e3, 2)
    return {"fetch_ms": ms(t0, t1) if pv.weights is None else 0.0, "sha256_decode_ms": ms(t1, t2),
            "load_by_reference_ms": ms(t3, t4), "load_by_copy_ms": ms(t4, t5)}


def run_size(params: int, args, redis_url: str | None, host_cache: str, placement=None) -> dict:
    """One row. ``placement(i) -> (enter, cache_dir)``: where subscriber process ``i`` runs (a
    callable it calls first, e.g. ``netns.Host.enter``) and its host's blob cache; by default
    here, all processes sharing one cache."""
    policy = policy_of_size(params)
    n_params = sum(p.numel() for p in policy.parameters())
    namespace = f"weightsync-{uuid.uuid4().hex[:8]}"
    bus = build_bus(BusConfig(kind="kafka", bootstrap=args.bootstrap, namespace=namespace))
    events = build_events(bus, None)
    cache_dir = tempfile.mkdtemp(prefix="weightsync-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) \
        if host_cache != "off" else None  # the subscribers' host: starts empty
    # the learner's store: on the subscribers' host it leaves each blob in their cache
    blob = open_blob_store(redis_url, cache_dir if host_cache == "learner-host" else None)

    blob_keys: list[str] = []

    prepare: list[float] = []

    def publish(version: int) -> tuple[int, int]:
        t0 = time.perf_counter()
        pv = make_policy_version(policy, policy_id=POLICY_ID, version=version, parent_version=version - 1 if version else None,
                                 learner_id="bench", algo="ppo", blob_store=blob, claim_check_above=args.claim_check_above)
        prepare.append(time.perf_counter() - t0)  # the learner's side, before the record goes out
        publish_policy_version(events, pv)
        if pv.weights_ref is not None:
            blob_keys.append(pv.weights_ref.key)
        return len(events.codec.encode(pv)), (pv.weights_ref.size if pv.weights_ref is not None else 0)

    publish(0)
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    per = [args.actors // args.procs + (1 if i < args.actors % args.procs else 0) for i in range(args.procs)]
    place = placement or (lambda i: (None, cache_dir))
    procs = [ctx.Process(target=_worker, args=(i, n, params, args.bootstrap, namespace, redis_url, place(i)[1], out, stop,
                                               place(i)[0]), daemon=True)
             for i, n in enumerate(per) if n]
    for p in procs:
        p.start()
    errors: list[str] = []
    ready = _drain(out, args.actors, "ready", 0, 600, errors)
    lat: list[float] = []
    delivery: list[float] = []
    cpu: list[float] = []
    record_bytes = blob_bytes = 0
    missing = 0
    shared: list[tuple] = []
    try:
        if len(ready) + len(errors) < args.actors:
            raise RuntimeError(f"only {len(ready)} of {args.actors} subscribers adopted version 0 within 600 s")
        for v in range(1, args.versions + 1):
            with torch.no_grad():
                policy.net.actor_mean[-1].bias.add_(0.01)  # a new version really differs
            record_bytes, blob_bytes = publish(v)
            got = _drain(out, args.actors, "adopted", v, 60, errors)
            missing += args.actors - len(got)
            lat += [g[0] for g in got]
            delivery += [g[1] for g in got]
            cpu += [g[2] for g in got]
    finally:
        stop.set()
        for p in procs:
            p.join(30)
        while True:
            try:
                k, _, _, s = out.get(timeout=0.5)
            except queue.Empty:
                break
            if k == "shared":
                shared.append(s)
    pv = make_policy_version(policy, policy_id=POLICY_ID, version=99, parent_version=None, learner_id="bench",
                             algo="ppo", blob_store=blob, claim_check_above=args.claim_check_above)
    parts = _one_adoption(events.codec.decode(events.codec.encode(pv)), blob, params)
    bus.inner.delete_topics([t.name for t in bus.ns.topics()])  # what this run made, only
    if pv.weights_ref is not None:
        blob_keys.append(pv.weights_ref.key)
    if blob_keys:
        import redis

        redis.Redis.from_url(redis_url).delete(*blob_keys)
    bus.close()
    if cache_dir:
        shutil.rmtree(cache_dir, ignore_errors=True)
    fills = sum(s[0] for s in shared)  # per process: fetched and decoded once
    store_reads = sum(s[3] for s in shared) if host_cache != "off" else fills
    return {
        "params": n_params, "weights_bytes": n_params * 4, "claim_check": blob_bytes > 0,
        "host_cache": host_cache,
        "actors": args.actors, "procs": args.procs, "versions": args.versions, "adoptions": len(lat),
        "missing": missing,
        "latency_ms": _pcts(lat),
        "delivery_ms": _pcts(delivery),
        "publish_prepare_ms": _pcts(prepare[1:]),
        "adoption_cpu_ms": _pcts(cpu),
        "broker_bytes_per_version": record_bytes,
        "blob_bytes_per_version": blob_bytes,
        "blob_decodes_per_version": round(fills / (args.versions + 1), 2) if shared else None,
        "blob_store_reads_per_version": round(store_reads / (args.versions + 1), 2) if shared else None,
        "one_adoption": parts,
        "subscriber_errors": errors,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    env = Environment.read()
    ap.add_argument("--bootstrap", default=env.kafka_brokers)
    ap.add_argument("--redis", default=env.redis_url)
    ap.add_argument("--actors", type=int, default=64)
    ap.add_argument("--procs", type=int, default=4, help="processes the subscriber threads are spread over")
    ap.add_argument("--params", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--versions", type=int, default=10)
    ap.add_argument("--host-cache", nargs="+", choices=["learner-host", "another-host", "off"],
                    default=["learner-host", "another-host", "off"],
                    help="subscribers share one verified copy of each blob per host, on the learner's host (it "
                         "leaves each blob there) or on another; off: each process fetches its own")
    ap.add_argument("--claim-check-above", type=int, default=DEFAULT_CLAIM_CHECK_ABOVE,
                    help="with Redis, weights over this many bytes go by claim check")
    args = ap.parse_args()
    if not args.bootstrap:
        raise SystemExit("set KAFKA_BROKERS (or --bootstrap) to the Kafka broker")
    torch.set_num_threads(1)
    rows = []
    for params in args.params:
        if params * 4 > DEFAULT_INLINE_LIMIT and not args.redis:
            raise SystemExit(f"{params} parameters exceed the inline limit: set REDIS_URL (or --redis) for the claim check")
        for mode in args.host_cache if args.redis else ["off"]:
            rows.append(run_size(params, args, args.redis, mode))
    print(json.dumps({
        "bench": "weightsync", "target_p99_ms_max": 100.0, "inline_limit_bytes": DEFAULT_INLINE_LIMIT,
        "claim_check_above_bytes": args.claim_check_above,
        "host": host_info(loadavg_1m=load_1m()),
        "rows": rows,
    }, indent=2))


if __name__ == "__main__":
    main()
