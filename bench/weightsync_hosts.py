"""Weight sync by claim check across simulated hosts: publish-to-adoption latency of a new
PolicyVersion at ``--actors`` subscribers spread over ``--hosts`` hosts, each host with its own
blob cache, next to the same run on one host (the peer figure).

Each layout gets a fresh private network (``testbed/netns.py``: namespaces on one switch;
root needed): the Kafka broker, a Redis (the claim-check store) and the learner each on a host of
their own, and ``--procs-per-host`` subscriber processes on every actor host, each holding
``--actors / (hosts * procs-per-host)`` ``PolicySubscriber`` threads (``bench/weightsync.py``'s
subscribers: the actors' class, each its own Kafka consumer; a thread each, because 64 actor
processes do not fit on 2 cores; what is measured is the policy follow and the blob fetch, not
acting). With ``--delay-ms`` every host sends each packet that late (netem, else the NFQUEUE
delayer, which at 10M parameters is itself the bottleneck: docs/benchmarks.md). A
host's first process to want a blob fetches it from Redis into that host's cache for the others,
so ``blob_store_reads_per_version`` is the number of hosts. The peer layout (``one-host``) runs
the same processes, broker, Redis and learner in one namespace, with one cache and no delay.

    sudo python bench/weightsync_hosts.py --actors 64 --hosts 4 --params 1000000 10000000

Prints one JSON document: a row per layout and size (``bench/weightsync.py``'s fields plus the
layout, delay and hosts).
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root: bench, testbed

import torch  # noqa: E402

from bench import weightsync  # noqa: E402
from bench.common import host_info, load_1m  # noqa: E402
from streams.policies import DEFAULT_CLAIM_CHECK_ABOVE  # noqa: E402
from testbed import netns  # noqa: E402


def _learner(learner_ns: str, params: int, args: argparse.Namespace, redis_url: str, placement, out) -> None:
    """The publishing side, in a process of its own on the learner's host."""
    netns.enter(learner_ns)
    torch.set_num_threads(1)
    try:
        out.put(weightsync.run_size(params, args, redis_url, "another-host", placement))
    except Exception as e:  # reported in the row, the other rows still run
        out.put({"params": params, "error": f"{type(e).__name__}: {e}"})


def _place(hosts: list[str], caches: list[str], per_host: int, i: int):
    h = (i // per_host) % len(hosts)  # one host: every process there
    return functools.partial(netns.enter, hosts[h]), caches[h]


def run_layout(layout: str, params: int, opts) -> dict:
    n_hosts = opts.hosts if layout == "hosts" else 1
    with netns.Network() as net:
        if layout == "hosts":
            kafka, store, learner = net.add("kafka"), net.add("blobs"), net.add("learner")
            actors = [net.add(f"actors-{i}") for i in range(n_hosts)]
        else:
            kafka = store = learner = net.add("one")
            actors = [learner]
        tmp = Path(tempfile.mkdtemp(prefix="weightsync-hosts-"))
        caches = [tempfile.mkdtemp(prefix=f"ws-{h.name}-", dir="/dev/shm") for h in actors]
        try:
            bootstrap = kafka.start_kafka(tmp / "kafka")
            redis_url = store.start_redis()
            delay = opts.delay_ms if layout == "hosts" else 0.0
            if delay:
                for h in net.hosts.values():
                    h.delay(delay)
            procs = opts.hosts * opts.procs_per_host  # the same processes in both layouts
            args = argparse.Namespace(bootstrap=bootstrap, actors=opts.actors, procs=procs, versions=opts.versions,
                                      claim_check_above=opts.claim_check_above)
            ctx = mp.get_context("spawn")
            out = ctx.Queue()
            placement = functools.partial(_place, [h.ns for h in actors], caches, opts.procs_per_host)
            p = ctx.Process(target=_learner, args=(learner.ns, params, args, redis_url, placement, out))
            p.start()
            row = out.get(timeout=3600)
            p.join(60)
            delayers = {name: h.delay_counts() for name, h in net.hosts.items()} if delay else {}
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            for c in caches:
                shutil.rmtree(c, ignore_errors=True)
    return {"layout": layout, "hosts": n_hosts, "procs_per_host": procs // n_hosts,
            "delay_ms": delay, "delay_method": net.delay_method if delay else None,
            "delayed_packets": sum(d.get("packets", 0) for d in delayers.values()) if delay else 0, **row}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--actors", type=int, default=64)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--procs-per-host", type=int, default=2)
    ap.add_argument("--params", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--versions", type=int, default=20)
    ap.add_argument("--delay-ms", type=float, default=0.0,
                    help="on every packet each host sends (hosts layout); with the NFQUEUE delayer (no netem) "
                         "a 40 MB blob is ~30k packets through one Python process, which then bounds the figure")
    ap.add_argument("--layouts", nargs="+", choices=["hosts", "one-host"], default=["hosts", "one-host"])
    ap.add_argument("--claim-check-above", type=int, default=DEFAULT_CLAIM_CHECK_ABOVE)
    opts = ap.parse_args()
    why = netns.unavailable()
    if why is not None:
        raise SystemExit(f"simulated hosts unavailable: {why}")
    torch.set_num_threads(1)
    rows = [run_layout(layout, params, opts) for params in opts.params for layout in opts.layouts]
    print(json.dumps({
        "bench": "weightsync_hosts", "target_p99_ms_max": 100.0, "peer": "layout one-host",
        "claim_check_above_bytes": opts.claim_check_above,
        "host": host_info(loadavg_1m=load_1m()),
        "rows": rows,
    }, indent=2))


if __name__ == "__main__":
    main()
