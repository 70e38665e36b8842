"""Decoupled mode: ``run_decoupled`` (``rlstream train --mode decoupled``) writes the run's
config once and starts the learner, the Faust workers and the actors as processes over Kafka
(``rlstream.supervisor``), reports their progress (``rlstream.monitor``) and stops them when the
learner has spent its budget. The process bodies are ``rlstream.processes``."""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from rlstream import wiring
from config import TrainConfig, write_config
from config.env import (
    ENV_BLOB_CACHE,
    ENV_CONFIG,
    ENV_KAFKA_BROKERS,
    ENV_METRICS_PORT,
    ENV_NAMESPACE,
    ENV_REDIS_URL,
    ENV_RUN_DIR,
    Environment,
)
from runtime.ports import LIVENESS_PROBE
from runtime.progress import TIMELINE_FILE
from runtime.roles import clear_summaries, read_summaries, summary_path
from config.runfile import CONFIG_FILE
from runtime.rundir import RunDir
from rlstream.monitor import RunMonitor, metrics_ports, run_learning, write_scrape_targets
from rlstream.supervisor import Supervisor


def child_config(cfg: TrainConfig) -> TrainConfig:
    """The config every child of ``run_decoupled`` reads from ``<run_dir>/config.json``: ``cfg``
    resolved (``TrainConfig.resolved``), each actor's budget and lead fixed, no metrics servers
    (many roles on one host; the parent reads their state files instead)."""
    r = cfg.resolved()
    return replace(r, mode="decoupled", run=replace(r.run, metrics_port=-1),
                   actor=replace(r.actor, actor_steps=cfg.actor_budget(), max_steps_ahead=cfg.steps_ahead_bound()))


def child_commands(cfg: TrainConfig, config_path: Path) -> dict[str, list[str]]:
    """Process name -> argv of every child of a decoupled run; all read ``config_path`` (the
    Faust worker through ``RLSTREAM_CONFIG``, see ``child_env``)."""
    def role(name: str, *extra: str) -> list[str]:
        return [sys.executable, "-m", "rlstream.cli", name, "--config", str(config_path), "--log-json", *extra]

    cmds = {"learner": role("learner"),
            "streams": streams_cmd(cfg, 0)}
    cmds.update({f"streams-{i}": streams_cmd(cfg, i) for i in range(1, max(1, cfg.deploy.stream_workers))})
    cmds.update({f"actor-{i}": role("actor", "--index", str(i)) for i in range(cfg.actor.num_actors)})
    return cmds


def child_env(cfg: TrainConfig, config_path: Path, env: Environment) -> dict[str, str]:
    """The environment of the children: this one's (``env``), with the run's config file, bus
    and claim-check store."""
    return env.child({ENV_METRICS_PORT: None, ENV_CONFIG: str(config_path), ENV_KAFKA_BROKERS: cfg.bus.bootstrap,
                      ENV_NAMESPACE: cfg.bus.namespace, ENV_RUN_DIR: str(cfg.run.run_dir),
                      ENV_BLOB_CACHE: cfg.blob_cache_dir() or "off", ENV_REDIS_URL: cfg.redis()})


def streams_cmd(cfg: TrainConfig, index: int) -> list[str]:
    """The Faust worker ``index`` of a local run (its own data dir; its web server, /metrics and
    /healthz, on the port ``RLSTREAM_METRICS_PORT`` gives it: ``metrics_ports``)."""
    data = cfg.run.run_dir / ("streams-data" if index == 0 else f"streams-data-{index}")
    return [sys.executable, "-m", "faust", "-A", "streams", "--datadir", str(data), "worker", "-l", "warn"]


#: How often the parent checks whether the learner has drained the actors' last samples.
DRAIN_CHECK_S = 1.0


def _spawn(cfg: TrainConfig, sup: Supervisor, commands: dict[str, list[str]], log: Any) -> None:
    """Start every child, each with its metrics and ``/healthz`` port, and list the ports for
    Prometheus (``write_scrape_targets``)."""
    ports = metrics_ports(list(commands))
    for name, cmd in commands.items():
        health = f"http://127.0.0.1:{ports[name]}{LIVENESS_PROBE.path}"  # every child serves /healthz
        if name.startswith("streams"):  # the Faust worker takes its web port from the environment
            sup.spawn(name, cmd, env={ENV_METRICS_PORT: str(ports[name])}, health_url=health)
        else:
            sup.spawn(name, [*cmd, "--metrics-port", str(ports[name])], health_url=health)
    write_scrape_targets(cfg, ports)
    if log is not None:
        log.info("decoupled_started", processes=sorted(sup.procs), logs=str(cfg.run.run_dir),
                 namespace=cfg.bus.namespace or "(legacy)", partitions=cfg.bus.partitions,
                 max_restarts=cfg.deploy.max_restarts, liveness_probes=cfg.deploy.liveness_probes)


def _wait(cfg: TrainConfig, sup: Supervisor, monitor: RunMonitor, actors: list[str], stop: threading.Event,
          log: Any) -> tuple[int | None, str]:
    """Supervise the children, with a progress line every ``log_every_s``, until the learner
    exits 0 (``learner_done``), it has trained nothing for ``drain_s`` after every actor spent its
    budget (``drained``) or ``stop`` (``stopped``); returns the learner's exit code and why."""
    procs = sup.procs
    drain_s = max(30.0, 3 * min(cfg.run.log_every_s, 60.0))  # children write their state every second
    next_line = time.monotonic() + cfg.run.log_every_s
    next_check = time.monotonic() + DRAIN_CHECK_S
    drained: tuple[int, float] | None = None  # (learner updates, since) once every actor is done
    while not stop.is_set():
        if "learner" not in sup.pending and procs["learner"].poll() == 0:
            return 0, "learner_done"
        sup.check(done_ok={"learner", *actors})  # 0: the learner or an actor spent its budget
        if time.monotonic() >= next_check:  # drain checks do not wait for progress lines
            next_check = time.monotonic() + DRAIN_CHECK_S
            if time.monotonic() >= next_line:
                next_line = time.monotonic() + cfg.run.log_every_s
                updates = monitor.log_line()["updates"]
            else:
                updates = monitor.learner_updates()
            if not any(sup.alive(n) for n in actors):
                if drained is None or drained[0] != updates:
                    drained = (updates, time.monotonic())
                elif time.monotonic() - drained[1] > drain_s:
                    if log is not None:
                        log.info("learner_drained", updates=updates,
                                 note=f"actors spent their budget; no update for {drain_s:.0f}s")
                    return None, "drained"
        stop.wait(0.5)
    return None, "stopped"


def run_decoupled(cfg: TrainConfig, log: Any = None, stop: threading.Event | None = None,
                  env: Environment | None = None) -> dict[str, Any]:
    """Start the learner, ``stream_workers`` Faust workers and ``num_actors`` actors in
    ``cfg.bus.namespace``; print progress every ``log_every_s``; wait for the learner. Actors stop
    at their budget; once all have, the learner trains on what is left until it makes no more
    progress for ``drain_s``. A role that dies or fails its liveness probe is restarted (``Supervisor``) up to
    ``max_restarts`` times, then ``ChildExited`` is raised. The children get ``env`` (the entry
    point's ``Environment``; None: this process's, read now) with the run's settings on top."""
    cfg = cfg if cfg.mode == "decoupled" else replace(cfg, mode="decoupled")  # (its checks: TrainConfig's)
    stop = stop or threading.Event()
    env = env if env is not None else Environment.read()
    RunDir(cfg.run.run_dir).claim(cfg.run.run_id, mode="decoupled", resume=cfg.run.resume, join=True, algo=cfg.run.algo,
                              env_id=cfg.run.env_id, namespace=cfg.bus.namespace)
    for old in [*RunDir(cfg.run.run_dir).state_files(), *cfg.run.run_dir.glob(TIMELINE_FILE)]:
        old.unlink()  # a previous run's figures are not this run's
    clear_summaries(cfg.run.run_dir)
    config_path = write_config(child_config(cfg), cfg.run.run_dir / CONFIG_FILE)
    sup = Supervisor(child_env(cfg, config_path, env), cfg.run.run_dir, cfg.deploy.max_restarts, log,
                     liveness=LIVENESS_PROBE if cfg.deploy.liveness_probes else None)
    procs = sup.procs

    bus = wiring.build_bus(cfg.bus)  # create the topics before anyone subscribes; read lags from it
    actors = [f"actor-{i}" for i in range(cfg.actor.num_actors)]
    commands = child_commands(cfg, config_path)
    monitor = RunMonitor(cfg, bus, actors, log, restarts=sup.restarts,
                         streams=[n for n in commands if n.startswith("streams")])
    rc, ended = None, "stopped"  # why the run ended: learner_done, drained or stopped (a signal)
    try:
        _spawn(cfg, sup, commands, log)
        rc, ended = _wait(cfg, sup, monitor, actors, stop, log)
        monitor.log_line()
    finally:
        bus.close()
        # an actor that wrote its summary has spent its budget and is on its way out
        sup.stop(finishing=tuple(n for n in actors if not stop.is_set() and summary_path(cfg.run.run_dir, n).exists()))
    summaries = read_summaries(cfg.run.run_dir, procs)
    summary = {"mode": "decoupled", "run_id": cfg.run.run_id, **wiring.task(cfg),
               "namespace": cfg.bus.namespace, "ended": ended, "learner_exit": rc,
               **run_learning(cfg, actors, summaries),
               "processes": summaries, "restarts": dict(sup.restarts), "restart_reasons": list(sup.reasons),
               "exit_codes": {n: p.returncode for n, p in procs.items()}}
    RunDir(cfg.run.run_dir).write_summary(summary)
    return summary
