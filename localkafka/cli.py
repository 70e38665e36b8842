"""The command line of the local Kafka manager: ``rlstream broker`` and ``python3 -m
localkafka`` (fetch, start, stop, status of one node or, with ``--nodes N``, a local
cluster; see ``localkafka.broker`` and ``localkafka.cluster``). Standard library only.

Where the data goes: ``--data-dir``, else ``<cache>/kafka-<ver>/data-<port>`` for one node and
``<cache>/kafka-<ver>/cluster-<port>`` for ``--nodes N``. ``start`` records the data dir it used
for its port (``<cache>/brokers/<port>.json``), so ``status`` and ``stop`` with the same
``--port`` (or none: 9092) find that broker or cluster without ``--data-dir``."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from config.env import Environment
from localkafka import cluster as lc
from localkafka.broker import DEFAULT_START_TIMEOUT, DEFAULT_STOP_TIMEOUT, LocalKafka
from localkafka.fetch import MARKER, fetch
from localkafka.paths import (
    DEFAULT_PORT,
    HOST,
    KAFKA_VERSION,
    BrokerError,
    PortBusyError,
    _atomic_write,
    cache_root,
    default_version,
)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlstream broker",
        description="Run a local Apache Kafka (KRaft) broker, or an N-node cluster, without Docker.")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser, with_port: bool = True) -> None:
        p.add_argument("--version", default=None,
                       help=f"Kafka version (env RLSTREAM_KAFKA_VERSION, default {KAFKA_VERSION})")
        if with_port:
            p.add_argument("--port", type=int, default=DEFAULT_PORT,
                           help=f"broker port on {HOST} (default {DEFAULT_PORT})")
            p.add_argument("--controller-port", type=int, default=None,
                           help="KRaft controller port (default port+1)")
            p.add_argument("--data-dir", default=None,
                           help="data dir (default <cache>/kafka-<ver>/data-<port> for one node, "
                                "<cache>/kafka-<ver>/cluster-<port> with --nodes N); status and stop "
                                "find the one `start --port PORT` used without it")
            p.add_argument("--host", default=HOST,
                           help=f"address to listen on and advertise (default {HOST})")
            p.add_argument("--nodes", type=int, default=None,
                           help="nodes of a local KRaft cluster (default 1; status and stop find a "
                                "cluster started with --nodes without it)")

    p = sub.add_parser("fetch", help="download the Kafka jars with mvn (idempotent)")
    common(p, with_port=False)
    p = sub.add_parser("start", help="format storage if needed, start, wait until ready")
    common(p)
    p.add_argument("--controllers", type=int, default=0,
                   help="with --nodes N: N broker-only nodes and this many controller-only nodes "
                        "(ids N+1.., ports after the brokers' pairs) as the KRaft quorum, so brokers "
                        "can be lost without it (default 0: every node is both)")
    p.add_argument("--fresh", action="store_true", help="wipe the data dir first")
    p.add_argument("--foreground", action="store_true", help="run attached (exec java)")
    p.add_argument("--timeout", type=float, default=DEFAULT_START_TIMEOUT,
                   help="seconds to wait for readiness (default 120)")
    p = sub.add_parser("stop", help="stop the broker (SIGTERM, then SIGKILL)")
    common(p)
    p.add_argument("--timeout", type=float, default=DEFAULT_STOP_TIMEOUT,
                   help="seconds before SIGKILL (default 30)")
    p = sub.add_parser("status", help="print JSON status")
    common(p)
    return parser


def main(argv: list[str] | None = None, env: Environment | None = None) -> int:
    """The entry point: ``env`` (default: this process's environment, read here once) is what
    every broker, cluster and cache path below it is given."""
    args = _build_parser().parse_args(argv)
    env = Environment.read() if env is None else env
    version = args.version or default_version(env)
    try:
        if args.command == "fetch":
            lib = fetch(version)
            info = json.loads((lib / MARKER).read_text())
            print(json.dumps({"version": version, "lib": str(lib), "jars": len(info["jars"]),
                              "bytes": info["bytes"]}))
            return 0
        if args.command in ("status", "stop") and args.data_dir is None:
            known = recall(args.port, env)  # the data dir `start --port` used
            if known is not None:
                args.data_dir = known["data_dir"]
                version = args.version or known.get("version") or version
        cluster = _cluster_of(args, version, env)
        if cluster is not None:
            return _cluster_command(args, cluster, env)
        kafka = LocalKafka(port=args.port, version=version, data_dir=args.data_dir,
                           controller_port=args.controller_port, host=args.host, env=env)
        if args.command == "status":
            print(json.dumps(kafka.status()))
            return 0
        if args.command == "stop":
            if kafka.stop(timeout=args.timeout):
                print(f"rlstream broker: stopped broker on {kafka.bootstrap}", file=sys.stderr)
            else:
                print(f"rlstream broker: no broker running from {kafka.data_dir}",
                      file=sys.stderr)
            return 0
        if args.command == "start":
            if args.fresh:
                kafka.wipe()
            if kafka.is_running():
                kafka.wait_ready(args.timeout)
                remember(kafka.port, kafka.data_dir, version, 1, env)
                print(f"rlstream broker: already running on {kafka.bootstrap} "
                      f"(pid {kafka.pid})", file=sys.stderr)
                return 0
            try:
                if args.foreground:
                    remember(kafka.port, kafka.data_dir, version, 1, env)
                    return kafka.run_foreground()
                kafka.start(timeout=args.timeout)
                remember(kafka.port, kafka.data_dir, version, 1, env)
            except PortBusyError as exc:
                if exc.is_kafka:
                    print(f"rlstream broker: {exc}; using it as is", file=sys.stderr)
                    return 0
                raise
            print(kafka.bootstrap)
            return 0
    except BrokerError as exc:
        print(f"rlstream broker: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 2


def _cluster_of(args: argparse.Namespace, version: str, env: Environment):
    """The ``LocalCluster`` a start/stop/status command means: ``--nodes`` > 1, or (stop,
    status without ``--nodes``) a cluster whose ``cluster.json`` is in the data dir. None: the
    single node."""
    nodes = args.nodes
    if nodes is not None and nodes < 1:
        raise BrokerError(f"--nodes {nodes}: a cluster needs at least one node")
    data_dir = Path(args.data_dir).expanduser() if args.data_dir else lc.default_data_dir(args.port, version)
    if nodes is None and args.command in ("stop", "status") and (data_dir / lc.CLUSTER_FILE).is_file():
        return lc.LocalCluster.open(data_dir, version=version, env=env)
    controllers = getattr(args, "controllers", 0)
    if controllers and nodes is None:
        raise BrokerError("--controllers K goes with --nodes N: N brokers beside K controllers")
    if (nodes is None or nodes == 1) and not controllers:
        return None
    if args.controller_port is not None:
        raise BrokerError("--controller-port applies to one node; a cluster's node i uses port+2i and port+2i+1")
    if args.command == "start" and args.fresh:
        if (data_dir / lc.CLUSTER_FILE).is_file():
            lc.LocalCluster.open(data_dir, version=version, quiet=True, env=env).wipe()  # stops it first
        shutil.rmtree(data_dir, ignore_errors=True)
    return lc.LocalCluster(nodes, controllers=controllers, port=args.port, data_dir=data_dir, version=version,
                           host=args.host, env=env)


def _cluster_command(args: argparse.Namespace, cluster, env: Environment) -> int:
    if args.command == "status":
        print(json.dumps(cluster.status()))
        return 0
    if args.command == "stop":
        stopped = cluster.stop_all(timeout=args.timeout)
        print(f"rlstream broker: stopped nodes {stopped} of {cluster.bootstrap}" if stopped
              else f"rlstream broker: no node running from {cluster.data_dir}", file=sys.stderr)
        return 0
    if args.foreground:
        raise BrokerError("--foreground runs one node; start a cluster without it")
    cluster.start(timeout=args.timeout)
    remember(cluster.ports[0][0], cluster.data_dir, cluster.version, len(cluster.nodes), env)
    print(cluster.bootstrap)
    return 0


def _record(port: int, env: Environment | None) -> Path:
    return cache_root(env) / "brokers" / f"{port}.json"


def remember(port: int, data_dir: Path, version: str, nodes: int, env: Environment | None = None) -> None:
    """Record the data dir a ``start`` on ``port`` used (``recall``; ``env``: whose cache)."""
    _atomic_write(_record(port, env), json.dumps({"port": port, "data_dir": str(data_dir), "version": version,
                                                    "nodes": nodes}, indent=1) + "\n")


def recall(port: int, env: Environment | None = None) -> dict | None:
    """What the last ``start`` on ``port`` recorded, while its data dir exists; else None."""
    try:
        known = json.loads(_record(port, env).read_text())
    except (OSError, ValueError):
        return None
    return known if Path(known.get("data_dir", "")).is_dir() else None


if __name__ == "__main__":
    sys.exit(main())
