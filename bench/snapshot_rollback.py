"""Rollback time from a snapshot in object storage (S3), beside the same from the file store.

A policy of about ``--params`` parameters (10M by default) is saved as snapshot K, as the learner
saves one (weights and learner state, ``arch`` in its meta), in each store: ``s3``, an
``s3://bucket/prefix`` store on an S3-compatible server (``--endpoint-url``; by default a local
moto server, its own process, started and ended here), and ``file``, a directory (the peer). A
co-located run's event log (memory bus with files) holds the newest version of the policy; with
Redis (``REDIS_URL``) weights over the inline size go by claim check, as in production (a 10M
policy is 40 MB: over the 4 MiB inline limit, so Redis is needed at that size).

Per store and repeat:

* ``read_s``: ``store.load(K)``, the verified weights alone;
* ``publish_s``: ``logtools.rollback.rollback`` (what ``rlstream rollback`` runs once its
  arguments are parsed): from the call to the new version published;
* ``loaded_s``: from the same call to the new version decoded and loaded into a ``Policy`` by a
  follower (``PolicyFeed``) that was waiting on the log;
* ``cli_s``: the whole ``rlstream rollback`` command as a process, with the store named by
  ``RLSTREAM_SNAPSHOT_STORE`` (Python and torch start-up included), the stores' runs interleaved.

Prints ONE JSON document: per store the runs and medians, and ``s3_over_file`` ratios.

    REDIS_URL=redis://127.0.0.1:6379/0 python bench/snapshot_rollback.py --params 10000000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root: bench.common, testbed.s3 (the local moto server)

import torch  # noqa: E402

from bench.common import host_info, policy_of_size  # noqa: E402
from config import BusConfig  # noqa: E402
from config.env import Environment  # noqa: E402
from config.storage import ObjectStoreConfig  # noqa: E402
from learner.snapshots.url import open_store  # noqa: E402
from logtools.rollback import rollback  # noqa: E402
from logtools.subscribe import PolicyFeed  # noqa: E402
from rlstream.wiring import blob_store_of, build_bus, build_events  # noqa: E402
from streams.policies import arch_of, make_policy_version, publish_policy_version  # noqa: E402

POLICY_ID = "policy"


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


def run_store(name: str, url: str, obj: ObjectStoreConfig | None, params: int, repeats: int,
              redis_url: str | None, workdir: Path, env: dict[str, str]) -> dict:
    blobs = blob_store_of(redis_url, "off")
    log = workdir / f"{name}-log"
    bus = build_bus(BusConfig(kind="memory", log_dir=str(log)))
    events = build_events(bus, None)
    store = open_store(url, keep_last=None, object_store=obj)
    snap, newest = policy_of_size(params, 1), policy_of_size(params, 2)
    n = sum(t.numel() for t in snap.state_dict().values())
    opt = torch.optim.Adam(snap.parameters())
    k = 5
    t0 = time.perf_counter()
    ref = store.save(k, snap.state_dict(), {"algo": "ppo", "arch": arch_of(snap), "updates": k},
                     state={"model": snap.state_dict(), "optimizer": opt.state_dict(), "step": k})
    save_s = time.perf_counter() - t0
    publish_policy_version(events, make_policy_version(newest, policy_id=POLICY_ID, version=k + 1,
                                                       parent_version=k, learner_id="learner-0", algo="ppo",
                                                       blob_store=blobs))
    runs = []
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            store.load(k)
            read_s = time.perf_counter() - t0
            with PolicyFeed(events, blob_store=blobs) as feed:
                feed.poll(1.0)  # at the newest version: the next one is the rollback's
                got: list = []
                seen_at: list[float] = []

                def follow() -> None:
                    for u in feed.updates(count=1, idle_timeout=600.0):
                        u.policy  # decoded and loaded
                        seen_at.append(time.perf_counter())
                        got.append(u)

                th = threading.Thread(target=follow)
                th.start()
                t0 = time.perf_counter()
                result = rollback(events, url, k, blob_store=blobs, object_store=obj)
                publish_s = time.perf_counter() - t0
                th.join(600)
            assert got and got[0].parent_version == k, "the follower did not see the rollback"
            runs.append({"read_s": round(read_s, 4), "publish_s": round(publish_s, 4),
                         "loaded_s": round(seen_at[0] - t0, 4), "new_version": result["new_version"]})
    finally:
        bus.close()
    return {"url": url, "params": n, "weights_bytes": ref.nbytes, "save_s": round(save_s, 4), "runs": runs,
            "read_s": _median([r["read_s"] for r in runs]), "publish_s": _median([r["publish_s"] for r in runs]),
            "loaded_s": _median([r["loaded_s"] for r in runs]), "cli_runs": [],
            "_cli": ([sys.executable, "-m", "rlstream.cli", "rollback", "--log-dir", str(log), "--to", str(k),
                      "--metrics-port", "-1"], {**env, "RLSTREAM_SNAPSHOT_STORE": url}, workdir)}


def run_cli(name: str, row: dict) -> None:
    """One ``rlstream rollback`` process against the store of ``row``; its wall time in ``cli_runs``."""
    cmd, env, cwd = row["_cli"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=str(cwd), env=env, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"rlstream rollback ({name}) failed: {p.stderr[-2000:]}")
    row["cli_runs"].append({"cli_s": round(seconds, 3),
                            "new_version": json.loads(p.stdout.strip().splitlines()[-1])["new_version"]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=10_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--endpoint-url", default=None,
                    help="an S3-compatible server with the bucket --bucket (default: start a local moto server)")
    ap.add_argument("--bucket", default=None)
    args = ap.parse_args()
    environ = Environment.read()
    redis_url = environ.redis_url
    if args.params * 4 > 4 * 1024 * 1024 and not redis_url:
        raise SystemExit("weights over 4 MiB are published by claim check: set REDIS_URL")
    base_env = {k: v for k, v in environ.values.items() if not k.startswith("AWS_")}
    base_env["PYTHONPATH"] = str(ROOT) + os.pathsep + environ.get("PYTHONPATH")
    base_env["RLSTREAM_BLOB_CACHE"] = "off"
    server = None
    if args.endpoint_url is None:
        from testbed.s3 import MotoServer

        server = MotoServer()
        obj = server.config()
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        server.make_bucket(bucket)
        s3_env = server.env()
    else:
        obj = ObjectStoreConfig.from_environment(Environment({**environ.values, "AWS_ENDPOINT_URL": args.endpoint_url}))
        bucket = args.bucket or "rlstream-bench"
        s3_env = {k: v for k, v in environ.values.items() if k.startswith("AWS_")} | {"AWS_ENDPOINT_URL": args.endpoint_url}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-rollback-") as tmp:
            work = Path(tmp)
            rows = {
                "s3": run_store("s3", f"s3://{bucket}/bench/{uuid.uuid4().hex[:8]}", obj, args.params, args.repeats,
                                redis_url, work, {**base_env, **s3_env, "AWS_EC2_METADATA_DISABLED": "true"}),
                "file": run_store("file", str(work / "snapshots"), None, args.params, args.repeats, redis_url, work,
                                  base_env),
            }
            for _ in range(args.repeats):  # the commands interleaved: the machine's load falls on both alike
                for name, row in rows.items():
                    run_cli(name, row)
            for row in rows.values():
                del row["_cli"]
                row["cli_s"] = _median([r["cli_s"] for r in row["cli_runs"]])
    finally:
        if server is not None:
            server.stop()
    ratios = {f"{key}_s3_over_file": round(rows["s3"][key] / rows["file"][key], 2) if rows["file"][key] else None
              for key in ("read_s", "publish_s", "loaded_s", "cli_s")}
    print(json.dumps({"bench": "snapshot_rollback", "params": args.params, "repeats": args.repeats,
                      "s3_server": "moto (local, its own process)" if server is not None else args.endpoint_url,
                      "claim_check": bool(redis_url), "stores": rows, "peer": "file", "ratios": ratios,
                      "machine": host_info()}, indent=2))


if __name__ == "__main__":
    main()
