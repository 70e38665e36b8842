"""``rlstream`` command line: parses arguments once into typed config and hands it to a role."""
# (The docstring is ``rlstream --help``'s description.) The training commands live here; the
# commands over a run's event log in ``cli_tools``, those over run directories in ``cli_runs``,
# the flags they share in ``cli_args``.

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

from config.env import Environment
from config.storage import ObjectStoreConfig
from config.bus import LATEST_RUN, RUNS_ROOT
from rlstream import cli_runs, cli_tools
from rlstream.cli_args import add_common, kv, refuse, stop_on_signals, wrapper_names
from runtime.ports import KNOWN_COMMANDS, metrics_port


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
    p.add_argument("--env-arg", action="append", metavar="KEY=VALUE",
                   help="gymnasium.make keyword argument of the env (over the preset's), e.g. "
                        "include_cfrc_ext_in_observation=false")
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
    generated from the dataclasses' fields and docstrings (``--actor.num-envs``, ``--max-versions``...)."""
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

    from config.sections import rewrite_flat_flags

    # the flat flags of before (--num-envs): their section's flag, one deprecation line each
    argv = rewrite_flat_flags(argv)
    typed = rewrite_flat_flags(getattr(a, "given_argv", [a.command, *argv]), warn=lambda line: None)
    if getattr(a, "importance_sampling", False):  # the deployment guide's spelling
        argv = [*argv, "--importance"]
    if a.command == "train":  # --strategy: the mode, and its family's algorithm unless --algo says
        a.mode, argv = guide.apply_strategy(getattr(a, "strategy", None), getattr(a, "mode", None), argv, typed)
    mode = (a.mode or "colocated") if a.command == "train" else "decoupled"
    flags, rest = tyro.cli(TrainFlags, args=argv, prog=prog, return_unknown_args=True)
    try:  # checked here, not inside tyro: a value the config refuses is one line (exit 2 in main)
        a.train = TrainConfig.from_flags(flags, mode=mode)
        a.streams = tyro.cli(PrepareConfig, args=rest, prog=prog,
                             default=PrepareConfig.for_algo(a.train.run.algo, policy_id=a.train.run.policy_id))
    except ValueError as e:  # a value the config itself refuses (an unknown --algo, --total-steps 0)
        raise SystemExit(f"{prog}: {e}") from None
    if a.train.run.algo not in TRAINABLE:
        raise SystemExit(f"{prog}: --algo {a.train.run.algo!r} is not trained online; choose from {list(TRAINABLE)}")
    if a.command == "train":  # before anything is created: an env or device this machine cannot run
        learner = a.train.learner
        guide.check_runs_here(a.train.run.env_id, learner.device, learner.learners, mode, typed,
                              a.train.run.env_kwargs)


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
    add_common(p)
    _add_training(p)

    p = sub.add_parser("actor", help="decoupled actor process", add_help=False, allow_abbrev=False)
    add_common(p)
    _add_training(p)
    p.add_argument("--index", type=int, default=None,
                   help="actor index (its id is actor-<index>); default: <host>-<generation>, the "
                        "generation registered on the rl.actors topic (actor.identity)")

    p = sub.add_parser("learner", help="decoupled learner process", add_help=False, allow_abbrev=False)
    add_common(p)
    _add_training(p)
    for role in ("actor", "learner"):
        sub.choices[role].add_argument(
            "--config", type=Path, default=None, metavar="PATH",
            help="take every setting from this run config file (<run-dir>/config.json; env RLSTREAM_CONFIG) "
                 "instead of the flags")

    cli_tools.add_parsers(sub)
    cli_runs.add_parsers(sub)
    cli_tools.add_time_travel(sub)
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
            refuse(f"--resume: no run to resume ({latest} does not exist); give the run with --run-dir")
        target = Path(os.readlink(latest)) if latest.is_symlink() else latest
        path = target if target.is_absolute() or not latest.is_symlink() else RUNS_ROOT / target
    else:
        path = RUNS_ROOT / run_id
    info = RunDir(path).info() if resume else None
    return path, (info.run_id if info is not None else run_id)


def claim_run_dir(cfg, *, join: bool, adopt: bool = False):
    """Make ``cfg.run.run_dir`` this run's (``runtime.rundir.RunDir.claim``; refused: exit 2), point
    ``latest`` at it where runs live (``runs/``, or a folder that already has a ``latest``), and
    return ``cfg`` with the run id the directory holds."""
    from runtime.rundir import LATEST, RunDir, RunDirError

    rd = RunDir(cfg.run.run_dir)
    fresh = rd.info() is None
    try:
        run_id = rd.claim(cfg.run.run_id, mode=cfg.mode, resume=cfg.run.resume, join=join, adopt=adopt, algo=cfg.run.algo,
                          env_id=cfg.run.env_id, namespace=cfg.bus.namespace if cfg.mode == "decoupled" else "")
    except RunDirError as e:
        refuse(str(e))
    parent = rd.path.parent
    if (fresh or cfg.run.resume) and (parent.resolve() == RUNS_ROOT.resolve() or (parent / LATEST).is_symlink()):
        rd.point_latest()
    return cfg if run_id == cfg.run.run_id else replace(cfg, run_id=run_id)


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
    mode = base.mode  # (checked with the rest of the config when ``parse_training`` made it)
    resume = base.run.resume
    bus = BusConfig.from_environment(env, kind=a.bus or None, bootstrap=a.bootstrap, log_dir=a.log_dir,
                                     namespace=a.namespace, learner_group=a.learner_group)
    run_id = a.run_id or env.run_id or ""
    if not run_id and a.command != "train" and bus.namespace:
        run_id = bus.namespace  # the roles of a run started one by one share its namespace's directory
    run_dir, run_id = run_dir_of(a, run_id or uuid.uuid4().hex[:12], resume)
    if a.partitions is not None:
        bus = replace(bus, partitions=a.partitions)
    if a.command == "train" and mode == "decoupled":
        bus = replace(bus, namespace=train_namespace(bus.namespace, a.namespace, run_id, run_dir, resume))
    if mode == "colocated" and (a.bus or "memory") == "memory":
        log_dir = Path(a.log_dir) if a.log_dir else run_dir / "log"
        if not resume and (log_dir / "_topics.json").exists():
            refuse(f"{run_dir} already holds a run's event log; pass --resume to continue it, "
                    "or choose another --run-dir")
        if resume and not (log_dir / "_topics.json").exists():
            refuse(f"--resume: no run to resume in {run_dir} (no event log at {log_dir})")
        bus = replace(bus, kind="memory", log_dir=str(log_dir))
    elif a.bus is None and default_bus == "kafka":
        bus = replace(bus, kind="kafka", log_dir=None)
    tensorboard = None if a.tensorboard == "off" else (a.tensorboard or str(run_dir / "tb"))
    try:  # the config checks itself again with --set's overrides (e.g. --overlap against one of them)
        run = replace(base.run, wrappers=wrapper_names(a.wrappers), tensorboard=tensorboard,
                      algo_overrides=kv(a.set), env_kwargs=kv(a.env_arg, "--env-arg"), run_dir=run_dir,
                      run_id=run_id, metrics_port=a.metrics_port)
        deploy = replace(base.deploy, redis_url=base.deploy.redis_url or env.redis_url,
                         blob_cache=base.deploy.blob_cache if base.deploy.blob_cache is not None else env.blob_cache)
        learner = replace(base.learner, snapshot_store=base.learner.snapshot_store or env.snapshot_store)
        cfg = replace(base, run=run, deploy=deploy, learner=learner, streams=a.streams, bus=bus,
                      object_store=ObjectStoreConfig.from_environment(env))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    from actor.envs import EnvKwargsError, check_env_id

    # before any process starts: an env that cannot load (with the preset's and --env-arg's
    # keyword arguments) fails here, with the fix; made once
    try:
        check_env_id(cfg.run.env_id, cfg.run.env_kwargs)
    except EnvKwargsError as e:
        raise SystemExit(f"--env-arg: {e}") from None
    except ValueError as e:
        raise SystemExit(f"--env: {e}") from None
    return cfg


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

    check_redis(cfg.learner.snapshot_store, cfg.deploy.redis_url)  # before the run directory: a Redis that is not there
    cfg = claim_run_dir(cfg, join=False)
    configure_logging(role=cfg.mode, run_id=cfg.effective_run_id(), level=a.log_level, json=a.log_json)
    log = get_logger("rlstream.train")
    preset = cfg.preset_name()
    log.info("preset", env=cfg.run.env_id, algo=cfg.run.algo, preset=preset or "none",
             **({"overrides": cfg.run.algo_overrides} if preset else {}))
    stop = stop_on_signals()
    if cfg.mode == "colocated":
        from rlstream.colocated import run_colocated

        metrics = Metrics(role="colocated")
        server, _ = _serve_metrics(metrics, cfg.run.metrics_port, "colocated", a.env)
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
        print(short_summary(summary, cfg.effective_run_id(), cfg.run.run_dir))
    print(verdict(summary), flush=True)
    return 0


def cmd_role(a: argparse.Namespace) -> int:
    from rlstream import processes
    from config import read_config
    from runtime.logging import configure_logging, get_logger
    from runtime.metrics import Metrics

    from learner import distributed
    from streams.bus.base import EXIT_FENCED, WriterFencedError

    env: Environment = a.env
    config = a.config or env.config_path
    cfg = read_config(config, env) if config else train_config(a, default_bus="kafka")
    if config and getattr(a, "train", None) is not None and a.train.run.resume:
        cfg = replace(cfg, run=replace(cfg.run, resume=True))  # a supervised restart: the run's config, resumed
    if config and a.metrics_port is not None:
        cfg = replace(cfg, run=replace(cfg.run, metrics_port=a.metrics_port))  # this process's own port (the run's file has none)
    role = a.command
    if role == "learner" and cfg.learner.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():  # say so, rather than torch's traceback at the first tensor
            print(f"rlstream learner: error: --learner.device {cfg.learner.device}, but no GPU is visible to this process "
                  f"(torch.cuda.is_available() is False; {env.visible_devices()}). Run it where the NVIDIA "
                  "runtime passes a GPU in (docs/deploy.md), or use --learner.device cpu", file=sys.stderr, flush=True)
            return 2
    # a role joins its run's directory (one it was not told the id of: by mode and namespace);
    # another run's is refused
    cfg = claim_run_dir(cfg, join=True, adopt=not (config or a.run_id or env.run_id))
    world = len(distributed.parse_devices(cfg.learner.device, cfg.learner.learners)) if role == "learner" else 1
    ranks = env.rank()
    if world > 1 and not ranks.launched:  # the launcher: one process per rank
        same = ["--run-id", cfg.effective_run_id(), "--run-dir", str(cfg.run.run_dir)]  # one run for every rank
        code = distributed.launch_ranks(["-m", "rlstream.cli", *a.argv, *same], world, env.child())
        if code == EXIT_FENCED and cfg.learner.on_fenced == "wait":  # the launcher waits in the ranks' place
            configure_logging(role=role, run_id=cfg.effective_run_id(), level=a.log_level, json=a.log_json)
            metrics = Metrics(role=role)
            server, health = _serve_metrics(metrics, cfg.run.metrics_port, role, env)
            try:
                why = "a rank of this learner was fenced by a newer learner of its run (its learner_fenced line)"
                return _fenced(why, "wait", log=get_logger(f"rlstream.{role}"), metrics=metrics, health=health,
                               stop=stop_on_signals())
            finally:
                if server is not None:
                    server.stop()
        return code if code >= 0 else 1
    rank = ranks.rank
    configure_logging(role=role, run_id=cfg.effective_run_id(), level=a.log_level, json=a.log_json)
    log = get_logger(f"rlstream.{role}")
    stop = stop_on_signals()
    metrics = Metrics(role=role)
    server, health = _serve_metrics(metrics, cfg.run.metrics_port if rank == 0 else -1, role, env)
    fenced: str | None = None
    try:
        try:
            if role == "actor":
                summary = processes.run_actor(cfg, a.index, log=log, stop=stop, metrics=metrics, health=health,
                                              host=env.hostname)
            else:
                summary = processes.run_learner(cfg, log=log, stop=stop, metrics=metrics, health=health, rank=ranks)
        except distributed.PeerLost as e:
            log.error("peer_lost", error=str(e), note="the group stops; a restart resumes from its last snapshot")
            return distributed.EXIT_PEER_LOST
        except WriterFencedError as e:
            fenced = str(e)  # (handled outside the handler: the traceback, and the learner it holds, go now)
        if fenced is not None:
            return _fenced(fenced, cfg.learner.on_fenced, log=log, metrics=metrics, health=health, stop=stop)
    finally:
        if server is not None:
            server.stop()
    print(json.dumps({"summary" if rank == 0 else "rank_summary": summary}))
    return 0


def _fenced(error: str, on_fenced: str, *, log, metrics, health, stop) -> int:
    """A learner that a newer one of its run and rank has fenced (``WriterFencedError``): it has
    stopped writing and took no snapshot (the store is the newer one's). ``rlstream_learner_fenced``
    is 1 and one ``learner_fenced`` line says so; then it exits ``EXIT_FENCED`` at once (``exit``),
    or (``wait``) stays up until SIGTERM or SIGINT, alive on ``/healthz`` (its loop's heartbeat is
    dropped: the loop ended on purpose) and not ready on ``/readyz`` (check ``fenced``), and exits
    ``EXIT_FENCED`` then: the status says what happened to it, also to a supervisor that reads it
    later. An orchestrator that restarts every exit (Kubernetes, docker compose) so never restarts
    it into fencing the newer learner in turn (ping-pong)."""
    from streams.bus.base import EXIT_FENCED

    metrics.set_learner_fenced(True)
    if on_fenced != "wait":
        log.error("learner_fenced", error=error, exit_code=EXIT_FENCED, on_fenced=on_fenced,
                  note="another learner of this run and rank has taken over; this one stops (the local supervisor "
                       "does not restart exit 4; where every exit is restarted, use --learner.on-fenced wait)")
        return EXIT_FENCED
    since = time.monotonic()
    health.forget_heartbeat("loop")
    health.register("fenced", lambda: (False, {"reason": "fenced", "fenced_for_s": round(time.monotonic() - since, 1)}))
    log.error("learner_fenced", error=error, exit_code=EXIT_FENCED, on_fenced=on_fenced,
              note="another learner of this run and rank has taken over; this one writes nothing more and waits for "
                   "SIGTERM, alive but not ready, so that no restart of it fences the newer one (remove it: its pod, "
                   "its container)")
    while not stop.wait(1.0):
        pass
    log.info("learner_fenced_stopped", exit_code=EXIT_FENCED, fenced_for_s=round(time.monotonic() - since, 1))
    return EXIT_FENCED


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
    handlers = {"train": cmd_train, "actor": cmd_role, "learner": cmd_role, **cli_tools.HANDLERS, **cli_runs.HANDLERS}
    from streams.bus.base import BusAuthenticationError, BusError, ReplicationError

    try:
        rc = handlers[a.command](a)
        sys.stdout.flush()  # inside the try: a reader gone shows here, not as a traceback at exit
        return rc
    except BrokenPipeError:  # `rlstream lineage RUN | head`: the reader left; end quietly, as SIGPIPE would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        return _refused(e.code, a.command)
    except (BusError, ValueError) as e:  # a setting or input to fix, not a fault: one line, no traceback
        from streams.bus.kafka import NoBrokerError, TopicNotFoundError

        from learner.snapshots.format import ResumeError

        # a refused login or TLS handshake too: a wrong password or CA file (docs/howto/security.md)
        fix: tuple[type, ...] = (ReplicationError, NoBrokerError, TopicNotFoundError, ResumeError,
                                 BusAuthenticationError)
        if a.command == "replay":
            from logtools.replay import ReplayError

            fix += (ReplayError,)
        if not isinstance(e, fix):
            raise
        print(f"rlstream {a.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
