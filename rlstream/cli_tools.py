"""The ``rlstream`` commands over a run's event log, on Kafka or a co-located run's log:
``serve``, ``replay``, ``subscribe``, ``lag``, ``rollback``, ``eval`` and the time-travel tools
``verify``, ``fork`` and ``lineage`` (``logtools``)."""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from pathlib import Path

from config.bus import LATEST_RUN, RUNS_ROOT
from config.storage import ObjectStoreConfig
from rlstream.cli_args import add_common, kv, refuse, stop_on_signals, wrapper_names
from runtime.ports import DEFAULT_PORTS


def _positive(text: str) -> float:
    x = float(text)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {text}")
    return x


def add_parsers(sub) -> None:
    """``serve``, ``replay``, ``subscribe``, ``lag``, ``rollback`` and ``eval``."""
    p = sub.add_parser("serve", help="policy server following PolicyVersion events")
    add_common(p)
    p.add_argument("--policy-id", default="policy")
    p.add_argument("--port", type=int, default=DEFAULT_PORTS["serve"])
    pin = p.add_mutually_exclusive_group()
    pin.add_argument("--version", type=int, default=None, help="serve this version only (point in time)")
    pin.add_argument("--at", default=None, help="serve the version current at this time: HH:MM, ISO 8601 or epoch ms")
    p.add_argument("--max-act-p99-ms", type=_positive, default=100.0,
                   help="/healthz fails (503; Kubernetes restarts the pod) while the p99 of /act over the last "
                        "--act-window-s is over this many ms (default 100)")
    p.add_argument("--act-window-s", type=_positive, default=60.0, help="window of that p99 (default 60 s)")
    p.add_argument("--act-min-requests", type=int, default=20,
                   help="fewer /act requests than this in the window count as healthy (default 20)")
    p.add_argument("--run-dir", type=Path, default=None, metavar="RUN",
                   help="the run to read: its namespace (RUN/namespace) when neither --namespace nor "
                        "RLSTREAM_NAMESPACE names one (default: runs/latest)")

    p = sub.add_parser("replay", help="replay a historical topic (offline DPO)")
    add_common(p)
    p.add_argument("--topic", default="rl.samples.raw")
    p.add_argument("--from-beginning", action="store_true", help="replay from offset 0 (default)")
    p.add_argument("--build-preferences", action="store_true", default=True)
    p.add_argument("--train-dpo", action="store_true", help="train a DPO policy on the rebuilt pairs")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--segment", type=int, default=32, help="segment length of preference pairs")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--run-dir", type=Path, default=None, metavar="RUN",
                   help="the run to read: its namespace (RUN/namespace) when neither --namespace nor "
                        "RLSTREAM_NAMESPACE names one (default: runs/latest)")
    p.add_argument("--out", type=Path, default=None,
                   help="the DPO run's directory (default: runs/<new run id>; runs/latest follows it)")

    p = sub.add_parser("subscribe", help="follow an event stream (e.g. policies)")
    add_common(p)
    p.add_argument("what", choices=["policies", "steps", "deadletters"])
    p.add_argument("--from-version", type=int, default=None, help="start at this policy version")
    p.add_argument("--count", type=int, default=None, help="stop after this many events")
    p.add_argument("--timeout", type=float, default=None, help="stop after this many idle seconds")
    p.add_argument("--run-dir", type=Path, default=None, metavar="RUN",
                   help="the run to read: its namespace (RUN/namespace) when neither --namespace nor "
                        "RLSTREAM_NAMESPACE names one (default: runs/latest)")

    p = sub.add_parser("lag", help="consumer lag per group and partition, as kafka-consumer-groups --describe")
    p.add_argument("--bootstrap", default=None, help="Kafka bootstrap servers (env KAFKA_BROKERS)")
    p.add_argument("--namespace", default=None,
                   help="the run namespace whose groups to show (default: env RLSTREAM_NAMESPACE, else the "
                        "one --run-dir records, else the legacy unscoped names)")
    p.add_argument("--run-dir", type=Path, default=None, metavar="RUN",
                   help="the run whose namespace to read (RUN/namespace; default: runs/latest)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--group", action="append", default=None, metavar="GROUP",
                       help="this consumer group (as Kafka names it, or scoped: learner -> <ns>.learner); "
                            "repeatable (default: the run's groups <ns>.rlstream-streams and <ns>.learner)")
    which.add_argument("--all", action="store_true", help="every consumer group of the namespace")
    p.add_argument("--learner-group", default=None, metavar="NAME",
                   help="the run's learner group (env RLSTREAM_LEARNER_GROUP; default: learner)")
    p.add_argument("--json", action="store_true", help="JSON instead of the table")

    p = sub.add_parser("rollback", help="republish a snapshot as the newest policy version")
    add_common(p)
    p.add_argument("--to", dest="to_version", type=int, required=True)
    p.add_argument("--algo", default=None, help="default: the one the snapshot records")
    p.add_argument("--env", dest="env_id", default=None, help="check the snapshot is of this env")
    p.add_argument("--run-dir", type=Path, default=Path("runs/latest"))
    p.add_argument("--snapshot-store", default=None,
                   help="file path, redis:// or s3://bucket/prefix (env RLSTREAM_SNAPSHOT_STORE; "
                        "s3: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID...); default: RUN_DIR/snapshots")

    p = sub.add_parser("eval", help="mean and std return of a recorded policy version")
    p.add_argument("run", type=Path, nargs="?", default=Path("runs/latest"), help="run directory (default: runs/latest)")
    p.add_argument("--version", type=int, default=None, help="policy version (default: the newest recorded)")
    p.add_argument("--episodes", type=int, default=10)
    p.add_argument("--deterministic", action="store_true", help="mean (Gaussian) / most likely (categorical) action")
    p.add_argument("--env", dest="env_id", default=None, help="default: the env the run trained on")
    p.add_argument("--wrappers", default=None, metavar="A,B", help="default: the run's wrappers")
    p.add_argument("--video", type=Path, default=None, metavar="DIR", help="record the first episode here")
    p.add_argument("--seed", type=int, default=0)


def add_time_travel(sub) -> None:
    """``verify``, ``fork`` and ``lineage`` (logtools.timetravel): tools over a recorded run."""
    def run_args(p: argparse.ArgumentParser, report: bool = True) -> None:
        add_common(p)
        p.add_argument("run", nargs="?", type=Path, default=None,
                       help="a co-located run directory (runs/<id>); omit with --bus kafka")
        p.add_argument("--policy-id", default="policy")
        if report:
            p.add_argument("--json", action="store_true", help="JSON instead of the human report")

    p = sub.add_parser("verify", help="retrain a run from its log and check every version bit for bit")
    run_args(p)
    p.add_argument("--snapshot-store", default=None,
                   help="snapshots of a fork or resumed run's first version (default: RUN/snapshots)")

    p = sub.add_parser("fork", help="start a new run from version V of a recorded run")
    run_args(p, report=False)
    p.add_argument("--from-version", type=int, required=True)
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="algorithm config override")
    p.add_argument("--train-batch-size", type=int, default=None, help="default: the parent's")
    p.add_argument("--out", type=Path, default=None, help="the fork's run directory (default: runs/<new id>)")
    p.add_argument("--snapshot-store", default=None)

    p = sub.add_parser("lineage", help="the steps, batches, actors and drops behind a version")
    run_args(p)
    p.add_argument("--version", type=int, default=None, help="default: the run's newest")


def tool_bus(a: argparse.Namespace):
    """The bus of a tool command: Kafka, or a co-located run's log with --log-dir / --bus memory."""
    from config import BusConfig

    log_dir = a.log_dir
    if a.bus == "memory" and log_dir is None and getattr(a, "run_dir", None) is not None:
        log_dir = str(Path(a.run_dir) / "log")
    kind = a.bus or ("memory" if log_dir else "kafka")
    if kind == "memory" and not log_dir:
        raise SystemExit("--bus memory needs --log-dir (the event log of a co-located run, e.g. runs/latest/log)")
    if kind == "memory" and not (Path(log_dir) / "_topics.json").exists():
        raise SystemExit(f"no event log at {log_dir}")
    run_dir = getattr(a, "run_dir", None)  # Kafka: the namespace a run recorded, when not given
    return BusConfig.from_environment(a.env, kind=kind, bootstrap=a.bootstrap, log_dir=log_dir,
                                      namespace=a.namespace, run_dir=(run_dir or LATEST_RUN) if kind == "kafka" else None)


def _tool_blobs(a: argparse.Namespace):
    """The claim-check store of ``REDIS_URL`` behind the host cache (None without Redis): a tool
    that loads or publishes weights over the inline size needs it, as the roles do."""
    from rlstream.wiring import blob_store_of

    return blob_store_of(a.env.redis_url, a.env.blob_cache)


def cmd_subscribe(a: argparse.Namespace) -> int:
    from logtools.subscribe import follow

    bus = tool_bus(a)
    stop = stop_on_signals()
    for line in follow(bus, a.what, from_version=a.from_version, count=a.count, idle_timeout=a.timeout, stop=stop):
        print(json.dumps(line), flush=True)
    return 0


def cmd_replay(a: argparse.Namespace) -> int:
    from logtools.replay import run_replay

    if a.log_dir:  # read the run it names now, before a new run moves runs/latest
        a.log_dir = str(Path(a.log_dir).resolve())
    bus = tool_bus(a)
    out = dpo_run_dir(a) if a.train_dpo else a.out
    try:
        summary = run_replay(bus, topic=a.topic, segment=a.segment, train=a.train_dpo, beta=a.beta,
                             epochs=a.epochs, blob_store=_tool_blobs(a), **({"out": out} if out is not None else {}))
    except BaseException:
        if out is not None and a.out is None and [p.name for p in out.iterdir()] == ["run.json"]:
            import shutil

            shutil.rmtree(out)  # nothing was trained: leave no empty run behind
        raise
    print(json.dumps({"summary": summary}, indent=2))
    if a.train_dpo:
        if a.out is None:
            from runtime.rundir import RunDir

            RunDir(out).point_latest()
        print(f"DPO policy: {out / 'policy.safetensors'}; evaluate it with: rlstream eval {out}", flush=True)
    return 0


def dpo_run_dir(a: argparse.Namespace) -> Path:
    """The run directory of a DPO replay: ``--out``, else ``runs/<new id>`` (``runs/latest`` follows it)."""
    from runtime.rundir import RunDir, RunDirError

    run_id = a.run_id or uuid.uuid4().hex[:12]
    rd = RunDir(a.out if a.out is not None else RUNS_ROOT / run_id)
    try:
        rd.claim(run_id, mode="dpo", algo="dpo", namespace=a.namespace or "")
    except RunDirError as e:
        refuse(str(e))
    return rd.path


def cmd_lag(a: argparse.Namespace) -> int:
    """Consumer lag per group and partition (exit 2: no such group, with the ones there)."""
    from config import BusConfig
    from logtools.lag import LagError, format_table, lag_report

    cfg = BusConfig.from_environment(a.env, kind="kafka", bootstrap=a.bootstrap, namespace=a.namespace,
                                     run_dir=a.run_dir or LATEST_RUN, learner_group=a.learner_group)
    try:
        report = lag_report(cfg, groups=a.group or (), every=a.all)
    except LagError as e:
        print(f"rlstream lag: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if a.json else format_table(report), flush=True)
    return 0


def cmd_rollback(a: argparse.Namespace) -> int:
    from logtools.rollback import RollbackError, rollback

    bus = tool_bus(a)
    store = a.snapshot_store or a.env.snapshot_store or str(a.run_dir / "snapshots")
    try:
        result = rollback(bus, store, a.to_version, algo=a.algo or "ppo", env_id=a.env_id, blob_store=_tool_blobs(a),
                          object_store=ObjectStoreConfig.from_environment(a.env))
    except RollbackError as e:
        print(f"rollback failed: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


def cmd_eval(a: argparse.Namespace) -> int:
    from logtools.evaluate import EvalError, evaluate, format_result

    wrappers = None if a.wrappers is None else wrapper_names(a.wrappers)
    try:
        result = evaluate(a.run, version=a.version, episodes=a.episodes, deterministic=a.deterministic,
                          env_id=a.env_id, wrappers=wrappers, video_dir=a.video, seed=a.seed)
    except (EvalError, ValueError) as e:
        print(f"eval failed: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    print(format_result(result), flush=True)
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    from logtools.serve import serve
    from logtools.subscribe import PinNotFound, parse_at

    bus = tool_bus(a)
    try:
        at_ms = parse_at(a.at) if a.at else None
        return serve(bus, policy_id=a.policy_id, port=a.port, stop=stop_on_signals(), version=a.version,
                     at_ms=at_ms, blob_store=_tool_blobs(a), max_act_p99_ms=a.max_act_p99_ms,
                     act_window_s=a.act_window_s, act_min_requests=a.act_min_requests)
    except (PinNotFound, ValueError) as e:
        print(f"serve: {e}", file=sys.stderr)
        return 2


def cmd_time_travel(a: argparse.Namespace) -> int:
    """verify / fork / lineage over a run directory or Kafka (exit 1: verify found a divergence)."""
    from config import BusConfig
    from logtools.timetravel import fork, lineage, record, verify

    bus = None if a.run is not None else BusConfig.from_environment(a.env, kind=a.bus or "kafka",
                                                                    bootstrap=a.bootstrap, namespace=a.namespace)
    snapshots = getattr(a, "snapshot_store", None) or (str(a.run / "snapshots") if a.run is not None else None)
    try:
        run = record.load(a.run, bus, run_id=a.run_id or None, policy_id=a.policy_id)
        if a.command == "verify":
            report = verify.verify(run, snapshots, blobs=_tool_blobs(a))
            print(json.dumps(report.as_dict(), indent=2) if a.json else verify.format_report(report))
            return 0 if report.ok else 1
        if a.command == "lineage":
            lin = lineage.lineage(run, run.last_version if a.version is None else a.version)
            print(json.dumps(lin, indent=2) if a.json else lineage.format_table(lin))
            return 0
        new_id = uuid.uuid4().hex[:12]
        summary = fork.fork(run, a.from_version, a.out or Path("runs") / new_id, overrides=kv(a.set),
                            train_batch_size=a.train_batch_size, run_id=new_id, parent_snapshots=snapshots)
        print(json.dumps({"fork": summary}, indent=2))
        return 0
    except (record.RunNotFound, verify.ReplayError, fork.ForkError, lineage.LineageError, ValueError) as e:
        print(f"{a.command}: {e}", file=sys.stderr)
        return 2


HANDLERS = {"subscribe": cmd_subscribe, "replay": cmd_replay, "rollback": cmd_rollback, "serve": cmd_serve,
            "eval": cmd_eval, "verify": cmd_time_travel, "fork": cmd_time_travel, "lineage": cmd_time_travel,
            "lag": cmd_lag}
