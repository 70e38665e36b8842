"""``rlstream`` command line: parses arguments once into typed config and hands it to a role."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from config.env import Environment
from config.storage import ObjectStoreConfig
from config.bus import LATEST_RUN, RUNS_ROOT
from runtime.ports import DEFAULT_PORTS, KNOWN_COMMANDS, metrics_port
from runtime.prune import DEFAULT_OLDER_THAN


def _kv(items: list[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise SystemExit(f"--set expects key=value, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def _positive(text: str) -> float:
    x = float(text)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {text}")
    return x


def _names(csv: str) -> tuple[str, ...]:
    from actor.envs import wrapper_fns

    names = tuple(n.strip() for n in csv.split(",") if n.strip())
    try:
        wrapper_fns(names)
    except ValueError as e:
        raise SystemExit(f"--wrappers: {e}") from e
    return names


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bus", choices=["memory", "kafka"], default=None,
                   help="bus backend (default: memory for colocated, kafka otherwise; env RLSTREAM_BUS)")
    p.add_argument("--bootstrap", default=None, help="Kafka bootstrap servers (env KAFKA_BROKERS)")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus/health port; -1 disables")
    p.add_argument("--log-level", default="info")
    p.add_argument("--log-json", action="store_true", help="JSON log lines (default: console)")
    p.add_argument("--run-id", default="")
    p.add_argument("--namespace", default=None,
                   help="run namespace scoping every topic and consumer group (<ns>.rl.samples.raw); "
                        "default: env RLSTREAM_NAMESPACE, else the run id for `train --mode decoupled`, "
                        "the one --run-dir (default runs/latest) records for the Kafka tools "
                        "(subscribe, replay, serve, rollback, lag), and the legacy unscoped names otherwise")
    p.add_argument("--log-dir", default=None,
                   help="memory bus: directory of a run's event log (e.g. runs/latest/log) to read or extend")


#: Commands whose settings are ``TrainConfig``'s: their flags are generated from its fields and
#: the stream processors' (``PrepareConfig``) by tyro, over the shared ones below.
TRAINING_COMMANDS = ("train", "actor", "learner")


def _add_training(p: argparse.ArgumentParser) -> None:
    """The flags of ``TrainConfig``'s entry-point fields (``config.train.EntryPoint``); every
    other field is a generated flag (``parse_training``)."""
    p.add_argument("-h", "--help", action="store_true", help="show this help message and exit")
    p.set_defaults(shared_flags=p)
    p.add_argument("--wrappers", default="", metavar="A,B",
                   help="per-env gymnasium wrappers: normalize_obs, normalize_reward, clip_reward, flatten_obs")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="algorithm config override")
    p.add_argument("--importance-sampling", action="store_true",
                   help="the deployment guide's spelling of --importance (V-trace weights in the stream processors)")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="default: runs/<run-id> (runs/latest links to it); with --resume: runs/latest")
    p.add_argument("--tensorboard", nargs="?", const="", default="", metavar="DIR",
                   help="TensorBoard event files, one run per role (default: <run-dir>/tb; 'off' disables)")
    p.add_argument("--partitions", type=int, default=None,
                   help="partitions of the sample topics when they are created (keyed by actor id); "
                        "existing topics with fewer are an error (docs/howto/scale-out.md); default 1")
    p.add_argument("--learner-group", default=None, metavar="NAME",
                   help="the learner's consumer group on rl.samples.prepared (scoped by the namespace); "
                        "every role of a run must agree (env RLSTREAM_LEARNER_GROUP; default: learner)")


def parse_training(a: argparse.Namespace, argv: list[str]) -> None:
    """Parse what the shared flags left of a training command's ``argv`` into ``a.train``
    (``TrainConfig``) and ``a.streams`` (``PrepareConfig``, over the algorithm's row), with flags
    generated from the dataclasses' fields and docstrings (``--num-envs``, ``--max-versions``...)."""
    import tyro

    from config.algos import TRAINABLE
    from config import TrainConfig
    from config import PrepareConfig

    prog = f"rlstream {a.command}"
    if a.help:
        a.shared_flags.print_help()
        for cls in (TrainConfig, PrepareConfig):
            try:
                tyro.cli(cls, args=["--help"], prog=prog, description=f"{cls.__name__} flags")
            except SystemExit:
                pass
        raise SystemExit(0)
    from config.train import TrainFlags
    from rlstream import guide

    typed = getattr(a, "given_argv", [a.command, *argv])
    if getattr(a, "importance_sampling", False):  # the deployment guide's spelling
        argv = [*argv, "--importance"]
    if a.command == "train":  # --strategy: the mode, and its family's algorithm unless --algo says
        a.mode, argv = guide.apply_strategy(getattr(a, "strategy", None), getattr(a, "mode", None), argv, typed)
    flags, rest = tyro.cli(TrainFlags, args=argv, prog=prog, return_unknown_args=True)
    try:  # checked here, not inside tyro: a value the config refuses is one line (exit 2 in main)
        a.train = TrainConfig.from_flags(flags)
        a.streams = tyro.cli(PrepareConfig, args=rest, prog=prog,
                             default=PrepareConfig.for_algo(a.train.algo, policy_id=a.train.policy_id))
    except ValueError as e:  # a value the config itself refuses (an unknown --algo, --total-steps 0)
        raise SystemExit(f"{prog}: {e}") from None
    if a.train.algo not in TRAINABLE:
        raise SystemExit(f"{prog}: --algo {a.train.algo!r} is not trained online; choose from {list(TRAINABLE)}")
    if a.command == "train":  # before anything is created: an env or device this machine cannot run
        guide.check_runs_here(a.train.env_id, a.train.device, a.train.learners, a.mode, typed)


class _Parser(argparse.ArgumentParser):
    """The top-level parser: training commands hand the flags it does not know to ``parse_training``."""

    def parse_known_args(self, args=None, namespace=None):
        a, rest = super().parse_known_args(args, namespace)
        a.given_argv = list(sys.argv[1:] if args is None else args)  # as typed (the guide's equivalents)
        if getattr(a, "env", None) is None:
            a.env = Environment.read()  # the one read of the environment; handlers take it from here
        if getattr(a, "command", None) in TRAINING_COMMANDS:
            parse_training(a, rest)
            rest = []
        return a, rest


def _add_time_travel(sub) -> None:
    """``verify``, ``fork`` and ``lineage`` (logtools.timetravel): tools over a recorded run."""
    def run_args(p: argparse.ArgumentParser, report: bool = True) -> None:
        _add_common(p)
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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rlstream", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=argparse.ArgumentParser)

    p = sub.add_parser("train", help="train (co-located by default)", add_help=False, allow_abbrev=False)
    p.add_argument("--mode", choices=["colocated", "decoupled"], default=None, help="default: colocated")
    p.add_argument("--strategy", choices=["on-policy", "off-policy"], default=None,
                   help="the deployment guide's: on-policy is --mode colocated with an on-policy algorithm "
                        "(--algo ppo unless given), off-policy --mode decoupled with an off-policy one (agro)")
    p.add_argument("--json", action="store_true",
                   help="print the run's summary as JSON (<run-dir>/summary.json) instead of the short one")
    _add_common(p)
    _add_training(p)

    p = sub.add_parser("actor", help="decoupled actor process", add_help=False, allow_abbrev=False)
    _add_common(p)
    _add_training(p)
    p.add_argument("--index", type=int, default=None,
                   help="actor index (its id is actor-<index>); default: <host>-<generation>, the "
                        "generation registered on the rl.actors topic (actor.identity)")

    p = sub.add_parser("learner", help="decoupled learner process", add_help=False, allow_abbrev=False)
    _add_common(p)
    _add_training(p)
    for role in ("actor", "learner"):
        sub.choices[role].add_argument(
            "--config", type=Path, default=None, metavar="PATH",
            help="take every setting from this run config file (<run-dir>/config.json; env RLSTREAM_CONFIG) "
                 "instead of the flags")

    p = sub.add_parser("serve", help="policy server following PolicyVersion events")
    _add_common(p)
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
    _add_common(p)
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
    _add_common(p)
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
    _add_common(p)
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

    p = sub.add_parser("validate", help="the deployment guide's go-live check of a finished run")
    p.add_argument("run", type=Path, nargs="?", default=Path("runs/latest"), help="run directory (default: runs/latest)")
    p.add_argument("--json", action="store_true", help="JSON instead of the table")
    p.add_argument("--no-plot", action="store_true", help="do not plot latency and freshness over time")
    p.add_argument("--report-only", action="store_true",
                   help="exit 0 whatever the verdicts (default: exit 1 when a threshold fails, to gate a pipeline; "
                        "2: not a usable run directory)")

    p = sub.add_parser("prune", help="remove run directories (logs, TensorBoard, event log) older than a bound")
    p.add_argument("runs_dir", type=Path, nargs="?", default=Path("runs"), metavar="RUNS_DIR",
                   help="directory of run directories (default: runs); runs/latest's target is never removed")
    p.add_argument("--older-than", default=DEFAULT_OLDER_THAN, metavar="AGE",
                   help=f"age of a run's newest file past which it goes: {DEFAULT_OLDER_THAN} (default), 12h, 90m, ...")
    p.add_argument("--yes", action="store_true", help="remove them (default: a dry run that only lists them)")

    p = sub.add_parser("runs", help="list the runs in a folder: id, mode, algorithm, env, steps, return, status")
    p.add_argument("runs_dir", type=Path, nargs="?", default=RUNS_ROOT, metavar="RUNS_DIR",
                   help="folder of run directories (default: runs)")
    p.add_argument("--json", action="store_true", help="one JSON object per run instead of the table")

    _add_time_travel(sub)
    sub.add_parser("broker", help="local Apache Kafka broker (start|stop|status|fetch)", add_help=False)
    assert set(sub.choices) == set(KNOWN_COMMANDS), "CLI and runtime.ports.KNOWN_COMMANDS disagree"
    return parser


def run_dir_of(a: argparse.Namespace, run_id: str, resume: bool) -> tuple[Path, str]:
    """The run directory of a training command and its run id: ``--run-dir``, else ``runs/<run-id>``
    for a new run, else (``--resume``) the run ``runs/latest`` points at, under its recorded id."""
    from runtime.rundir import RunDir

    if a.run_dir is not None:
        path = a.run_dir
    elif resume:
        latest = LATEST_RUN
        if not latest.exists():
            _refuse(f"--resume: no run to resume ({latest} does not exist); give the run with --run-dir")
        target = Path(os.readlink(latest)) if latest.is_symlink() else latest
        path = target if target.is_absolute() or not latest.is_symlink() else RUNS_ROOT / target
    else:
        path = RUNS_ROOT / run_id
    info = RunDir(path).info() if resume else None
    return path, (info.run_id if info is not None else run_id)


def claim_run_dir(cfg, *, join: bool, adopt: bool = False):
    """Make ``cfg.run_dir`` this run's (``runtime.rundir.RunDir.claim``; refused: exit 2), point
    ``latest`` at it where runs live (``runs/``, or a folder that already has a ``latest``), and
    return ``cfg`` with the run id the directory holds."""
    from runtime.rundir import LATEST, RunDir, RunDirError

    rd = RunDir(cfg.run_dir)
    fresh = rd.info() is None
    try:
        run_id = rd.claim(cfg.run_id, mode=cfg.mode, resume=cfg.resume, join=join, adopt=adopt, algo=cfg.algo,
                          env_id=cfg.env_id, namespace=cfg.bus.namespace if cfg.mode == "decoupled" else "")
    except RunDirError as e:
        _refuse(str(e))
    parent = rd.path.parent
    if (fresh or cfg.resume) and (parent.resolve() == RUNS_ROOT.resolve() or (parent / LATEST).is_symlink()):
        rd.point_latest()
    return cfg if run_id == cfg.run_id else replace(cfg, run_id=run_id)


def _refuse(message: str):
    """One line on stderr and exit code 2: input the command cannot use."""
    print(f"rlstream: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def train_namespace(given: str, flag: str | None, run_id: str, run_dir: Path, resume: bool) -> str:
    """The namespace of ``train --mode decoupled``: the flag, else RLSTREAM_NAMESPACE, else (resume)
    the one ``run_dir`` recorded, else the run id, so every new run has its own topics and groups."""
    if flag is not None or given:
        return given
    from config.bus import run_namespace

    recorded = run_namespace(run_dir) if resume else None
    if recorded is not None:  # "" too: a run in the legacy unscoped names stays there
        return recorded
    from streams.topics import Namespace

    return Namespace.derive(run_id).name


def train_config(a: argparse.Namespace, default_bus: str = "memory"):
    """The ``TrainConfig`` of a parsed training command: the generated flags' ``a.train`` with the
    entry-point fields resolved (run id and directory, bus and namespace, wrappers, overrides).
    Nothing is written: ``claim_run_dir`` makes the directory the run's once it is checked."""
    from config import BusConfig

    env: Environment = a.env
    base = a.train
    mode = a.mode if a.command == "train" else "decoupled"
    if base.overlap and mode != "colocated":
        from config.train import OVERLAP_COLOCATED_ONLY

        raise SystemExit(f"error: {OVERLAP_COLOCATED_ONLY}")
    bus = BusConfig.from_environment(env, kind=a.bus or None, bootstrap=a.bootstrap, log_dir=a.log_dir,
                                     namespace=a.namespace, learner_group=a.learner_group)
    run_id = a.run_id or env.run_id or ""
    if not run_id and a.command != "train" and bus.namespace:
        run_id = bus.namespace  # the roles of a run started one by one share its namespace's directory
    run_dir, run_id = run_dir_of(a, run_id or uuid.uuid4().hex[:12], base.resume)
    if a.partitions is not None:
        bus = replace(bus, partitions=a.partitions)
    if a.command == "train" and mode == "decoupled":
        bus = replace(bus, namespace=train_namespace(bus.namespace, a.namespace, run_id, run_dir, base.resume))
    if mode == "colocated" and (a.bus or "memory") == "memory":
        log_dir = Path(a.log_dir) if a.log_dir else run_dir / "log"
        if not base.resume and (log_dir / "_topics.json").exists():
            _refuse(f"{run_dir} already holds a run's event log; pass --resume to continue it, "
                    "or choose another --run-dir")
        if base.resume and not (log_dir / "_topics.json").exists():
            _refuse(f"--resume: no run to resume in {run_dir} (no event log at {log_dir})")
        bus = replace(bus, kind="memory", log_dir=str(log_dir))
    elif a.bus is None and default_bus == "kafka":
        bus = replace(bus, kind="kafka", log_dir=None)
    from actor.envs import check_env_id

    try:  # before any process starts: an env that cannot load fails here, with the fix
        check_env_id(base.env_id)
    except ValueError as e:
        raise SystemExit(f"--env: {e}") from None
    tensorboard = None if a.tensorboard == "off" else (a.tensorboard or str(run_dir / "tb"))
    try:  # the config checks itself again with --set's overrides (e.g. --overlap against one of them)
        return replace(base, mode=mode, wrappers=_names(a.wrappers), tensorboard=tensorboard,
                       algo_overrides=_kv(a.set), run_dir=run_dir, run_id=run_id, metrics_port=a.metrics_port,
                       streams=a.streams, bus=bus, snapshot_store=base.snapshot_store or env.snapshot_store,
                       object_store=ObjectStoreConfig.from_environment(env),
                       redis_url=base.redis_url or env.redis_url,
                       blob_cache=base.blob_cache if base.blob_cache is not None else env.blob_cache)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def handler(signum, frame) -> None:
        stop.set()

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, handler)
    return stop


def _serve_metrics(metrics, port: int | None, role: str, env: Environment):
    from runtime.http import HealthChecks, MetricsServer

    if port == -1:
        return None, HealthChecks()
    health = HealthChecks()
    server = MetricsServer(metrics, health, host="127.0.0.1" if role == "colocated" else "0.0.0.0",
                           port=metrics_port(role, env) if port is None else port)
    try:
        server.start()
    except OSError as e:
        print(f"warning: metrics server not started on port {port}: {e}", file=sys.stderr)
        return None, health
    return server, health


def cmd_train(a: argparse.Namespace) -> int:
    from runtime.logging import configure_logging, get_logger
    from runtime.metrics import Metrics

    cfg = train_config(a, default_bus="kafka" if a.mode == "decoupled" else "memory")
    from rlstream.guide import check_redis

    check_redis(cfg.snapshot_store, cfg.redis_url)  # before the run directory: a Redis that is not there
    cfg = claim_run_dir(cfg, join=False)
    configure_logging(role=cfg.mode, run_id=cfg.effective_run_id(), level=a.log_level, json=a.log_json)
    log = get_logger("rlstream.train")
    preset = cfg.preset_name()
    log.info("preset", env=cfg.env_id, algo=cfg.algo, preset=preset or "none",
             **({"overrides": cfg.algo_overrides} if preset else {}))
    stop = _stop_on_signals()
    if cfg.mode == "colocated":
        from rlstream.colocated import run_colocated

        metrics = Metrics(role="colocated")
        server, _ = _serve_metrics(metrics, cfg.metrics_port, "colocated", a.env)
        try:
            summary = run_colocated(cfg, log=log, stop=stop, metrics=metrics)
        finally:
            if server is not None:
                server.stop()
    else:
        from rlstream.decoupled import run_decoupled
        from rlstream.supervisor import ChildExited

        try:
            summary = run_decoupled(cfg, log=log, stop=stop, env=a.env)
        except ChildExited as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 1
    from runtime.progress import short_summary, verdict

    if a.json:  # for scripts; a person gets a few lines (the whole summary is in the run's summary.json)
        print(json.dumps({"summary": summary}, indent=2))
    else:
        print(short_summary(summary, cfg.effective_run_id(), cfg.run_dir))
    print(verdict(summary), flush=True)
    return 0


def cmd_role(a: argparse.Namespace) -> int:
    from rlstream import processes
    from config import read_config
    from runtime.logging import configure_logging, get_logger
    from runtime.metrics import Metrics

    from learner import distributed

    env: Environment = a.env
    config = a.config or env.config_path
    cfg = read_config(config, env) if config else train_config(a, default_bus="kafka")
    if config and getattr(a, "train", None) is not None and a.train.resume:
        cfg = replace(cfg, resume=True)  # a supervised restart: the run's config, resumed
    if config and a.metrics_port is not None:
        cfg = replace(cfg, metrics_port=a.metrics_port)  # this process's own port (the run's file has none)
    role = a.command
    if role == "learner" and cfg.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():  # say so, rather than torch's traceback at the first tensor
            print(f"rlstream learner: error: --device {cfg.device}, but no GPU is visible to this process "
                  f"(torch.cuda.is_available() is False; {env.visible_devices()}). Run it where the NVIDIA "
                  "runtime passes a GPU in (docs/deploy.md), or use --device cpu", file=sys.stderr, flush=True)
            return 2
    # a role joins its run's directory (one it was not told the id of: by mode and namespace);
    # another run's is refused
    cfg = claim_run_dir(cfg, join=True, adopt=not (config or a.run_id or env.run_id))
    world = len(distributed.parse_devices(cfg.device, cfg.learners)) if role == "learner" else 1
    ranks = env.rank()
    if world > 1 and not ranks.launched:  # the launcher: one process per rank
        same = ["--run-id", cfg.effective_run_id(), "--run-dir", str(cfg.run_dir)]  # one run for every rank
        code = distributed.launch_ranks(["-m", "rlstream.cli", *a.argv, *same], world, env.child())
        return code if code >= 0 else 1
    rank = ranks.rank
    configure_logging(role=role, run_id=cfg.effective_run_id(), level=a.log_level, json=a.log_json)
    log = get_logger(f"rlstream.{role}")
    stop = _stop_on_signals()
    metrics = Metrics(role=role)
    server, health = _serve_metrics(metrics, cfg.metrics_port if rank == 0 else -1, role, env)
    try:
        if role == "actor":
            summary = processes.run_actor(cfg, a.index, log=log, stop=stop, metrics=metrics, health=health,
                                          host=env.hostname)
        else:
            summary = processes.run_learner(cfg, log=log, stop=stop, metrics=metrics, health=health, rank=ranks)
    except distributed.PeerLost as e:
        log.error("peer_lost", error=str(e), note="the group stops; a restart resumes from its last snapshot")
        return distributed.EXIT_PEER_LOST
    finally:
        if server is not None:
            server.stop()
    print(json.dumps({"summary" if rank == 0 else "rank_summary": summary}))
    return 0


def _tool_bus(a: argparse.Namespace):
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

    bus = _tool_bus(a)
    stop = _stop_on_signals()
    for line in follow(bus, a.what, from_version=a.from_version, count=a.count, idle_timeout=a.timeout, stop=stop):
        print(json.dumps(line), flush=True)
    return 0


def cmd_replay(a: argparse.Namespace) -> int:
    from logtools.replay import run_replay

    if a.log_dir:  # read the run it names now, before a new run moves runs/latest
        a.log_dir = str(Path(a.log_dir).resolve())
    bus = _tool_bus(a)
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
        _refuse(str(e))
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

    bus = _tool_bus(a)
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

    wrappers = None if a.wrappers is None else _names(a.wrappers)
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

    bus = _tool_bus(a)
    try:
        at_ms = parse_at(a.at) if a.at else None
        return serve(bus, policy_id=a.policy_id, port=a.port, stop=_stop_on_signals(), version=a.version,
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
        summary = fork.fork(run, a.from_version, a.out or Path("runs") / new_id, overrides=_kv(a.set),
                            train_batch_size=a.train_batch_size, run_id=new_id, parent_snapshots=snapshots)
        print(json.dumps({"fork": summary}, indent=2))
        return 0
    except (record.RunNotFound, verify.ReplayError, fork.ForkError, lineage.LineageError, ValueError) as e:
        print(f"{a.command}: {e}", file=sys.stderr)
        return 2


def cmd_validate(a: argparse.Namespace) -> int:
    """Exit 0 when no threshold fails (absent figures do not), 1 when one does (0 with
    --report-only), 2 when the run directory is unusable."""
    from runtime import golive

    try:
        report = golive.check(a.run, plot=not a.no_plot)
    except golive.RunUnusable as e:
        print(f"validate: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if a.json else golive.render(report), flush=True)
    failed = golive.failed(report)
    if failed and not a.report_only:
        print(f"validate: {len(failed)} threshold(s) failed ({', '.join(failed)}): exit 1 "
              "(--report-only exits 0)", file=sys.stderr, flush=True)
        return 1
    return 0


def cmd_prune(a: argparse.Namespace) -> int:
    """List (dry run) or remove (--yes) the run directories older than --older-than."""
    from config.bus import parse_duration_ms
    from runtime.prune import prune

    try:
        older_s = parse_duration_ms(a.older_than) / 1000
        entries = prune(a.runs_dir, older_s, yes=a.yes)
    except (ValueError, FileNotFoundError) as e:  # NoRuns included: not a runs folder
        print(f"prune: {e}", file=sys.stderr)
        return 2
    verb = "removed" if a.yes else "would remove"
    for e in entries:
        print(f"{verb} {e.path}  ({e.age_s / 86400:.1f} days old, {e.bytes / 2**20:.1f} MiB)")
    total = sum(e.bytes for e in entries) / 2**20
    print(f"{verb} {len(entries)} entries older than {a.older_than}, {total:.1f} MiB"
          + ("" if a.yes else "; run again with --yes to remove them"), flush=True)
    return 0


def cmd_runs(a: argparse.Namespace) -> int:
    """The runs of a folder, newest first (``runtime.rundir``): a table, or JSON lines."""
    import time

    from runtime.rundir import LATEST, RunDir, find_runs

    if not a.runs_dir.is_dir():
        print(f"runs: no directory {a.runs_dir}", file=sys.stderr)
        return 2
    rows = sorted((RunDir(p).overview() for p in find_runs(a.runs_dir)), key=lambda r: -r["created"])
    latest = a.runs_dir / LATEST
    newest = latest.resolve() if latest.is_symlink() else None
    if a.json:
        for r in rows:
            print(json.dumps({**r, "latest": newest is not None and Path(r["path"]).resolve() == newest}))
        return 0
    if not rows:
        print(f"no runs in {a.runs_dir}")
        return 0

    def cell(v: Any, digits: int = 1) -> str:
        return "-" if v is None or v == "" else (f"{v:.{digits}f}" if isinstance(v, float) else str(v))

    header = ("run id", "mode", "algo", "env", "steps", "return", "status", "started")
    table = [header] + [(("* " if newest is not None and Path(r["path"]).resolve() == newest else "  ")
                         + r["run_id"], r["mode"], cell(r["algo"]), cell(r["env"]), cell(r["steps"]),
                         cell(r["return"]), r["status"],
                         time.strftime("%Y-%m-%d %H:%M", time.localtime(r["created"]))) for r in rows]
    table[0] = ("  " + header[0],) + header[1:]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    print(f"{len(rows)} run(s) in {a.runs_dir}; * is {latest}")
    return 0


def _refused(message: str, command: str) -> int:
    """A ``SystemExit`` with a message (input the command cannot use): that line on stderr, exit 2."""
    message = message.strip()
    prefix = "" if message.startswith("rlstream") else f"rlstream {command}: ".replace("  ", " ")
    print(f"{prefix}{message}", file=sys.stderr, flush=True)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "broker":
        from localkafka.cli import main as broker_main

        return broker_main(argv[1:])
    try:
        a = build_parser().parse_args(argv)
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        return _refused(e.code, argv[0] if argv else "")
    a.argv = argv
    handlers = {"train": cmd_train, "actor": cmd_role, "learner": cmd_role, "subscribe": cmd_subscribe,
                "replay": cmd_replay, "rollback": cmd_rollback, "serve": cmd_serve, "eval": cmd_eval,
                "verify": cmd_time_travel, "fork": cmd_time_travel, "lineage": cmd_time_travel,
                "validate": cmd_validate, "prune": cmd_prune, "lag": cmd_lag, "runs": cmd_runs}
    from streams.bus.base import BusError, ReplicationError

    try:
        return handlers[a.command](a)
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        return _refused(e.code, a.command)
    except (BusError, ValueError) as e:  # a setting or input to fix, not a fault: one line, no traceback
        from streams.bus.kafka import NoBrokerError, TopicNotFoundError

        from learner.snapshots.format import ResumeError

        fix: tuple[type, ...] = (ReplicationError, NoBrokerError, TopicNotFoundError, ResumeError)
        if a.command == "replay":
            from logtools.replay import ReplayError

            fix += (ReplayError,)
        if not isinstance(e, fix):
            raise
        print(f"rlstream {a.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
