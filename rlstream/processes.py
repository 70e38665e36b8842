"""The process bodies of ``rlstream actor`` and ``rlstream learner`` (decoupled mode): each role
built by ``wiring`` into its process's harness (``rlstream.harness.RoleProcess``: progress,
state file, TensorBoard run, health checks and summary) and driven by it."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from rlstream import wiring
from config import TrainConfig, write_config
from config.env import RankEnv
from rlstream.guide import check_redis
from rlstream.harness import RoleProcess
from runtime.logging import bind_policy_version
from runtime.metrics import Metrics
from runtime.roles import Slot
from runtime.rundir import RunDir


#: An actor's state file carries its newest policy latencies, at most this many (with their
#: running count): the supervisor takes those of each progress window (``RunMonitor``). A window
#: with more adoptions than this per actor is reported on the newest ones.
RECENT_LATENCIES = 256


def run_actor(cfg: TrainConfig, index: int | None, log: Any = None, stop: threading.Event | None = None,
              metrics: Metrics | None = None, health: Any = None, host: str = "actor") -> dict[str, Any]:
    """Collect and publish fragments until ``stop`` or until the actor's step budget
    (``cfg.actor_budget()``) is spent, under the algorithm's flow control (``wiring.build_flow``):
    the loop heartbeats while it waits for a policy version, room, or a stalled learner.
    ``index`` None: the id is ``<host>-<generation>`` (``actor.identity.register``)."""
    wiring.set_threads(cfg)
    check_redis(None, cfg.deploy.redis_url, unreachable_ok=True)  # a wrong password: one line, exit 2
    metrics = metrics or Metrics(role="actor")
    bus = wiring.build_bus(cfg.bus)
    if index is None:
        from actor.identity import register

        ident = register(bus, host)
        name, index = ident.actor_id, ident.generation
        if log is not None:
            log.info("actor_registered", actor_id=name, host=ident.host, generation=ident.generation)
    else:
        name = f"actor-{index}"
    write_effective_config(cfg, name)
    events = wiring.build_events(bus, metrics)
    flow = wiring.build_flow(cfg, bus, metrics, log)
    proc = RoleProcess(cfg, name, total_steps=cfg.actor_budget(), log=log, health=health, state=True, flush=bus)
    proc.on_close(lambda: (bus.flush(), bus.close()))

    def stall() -> dict[str, Any]:
        return {"stalled": flow.stalled, "stalled_s": round(flow.stalled_for(), 1),
                "steps_ahead": flow.gate.steps_ahead, "budget": flow.budget}

    # the supervisor's timeline takes each window's latencies from these
    proc.progress.extra = lambda: {**stall(), "policy_latency_count": proc.latencies.count,
                                   "policy_latency_recent_ms": proc.latencies.newest_ms(RECENT_LATENCIES)}
    with proc:
        actor = wiring.add_actor(proc, cfg, events, metrics, index, name=name, flow=flow)
        proc.check("policy", lambda: (actor.subscriber.policy is not None, {"version": actor.subscriber.version}))
        proc.check("learner_progress", lambda: (not flow.stalled, stall()))
        # waiting for a version or for room is alive, too (the harness heartbeats every round)
        proc.drive([Slot(actor, timeout=0.5)], done=lambda: flow.exhausted, stop=stop)
    progress = proc.progress
    learning = {k: v for k, v in progress.summary().items() if k in ("return_mean20", "first_returns_mean")}
    learning.update(progress.write(cfg.run.run_dir / name, cfg.run.plot, f"{cfg.run.algo} on {cfg.run.env_id} (decoupled, {name})"))
    summary = {**actor.summary(), "actor_id": actor.config.actor_id, "steps": progress.steps, **learning,
               "collect_s": round(proc.collect_s, 3),
               "flow": flow.stats(), "policy_latency_ms": proc.latencies.quantiles_ms()}
    proc.write_summary(name, summary)
    return summary


def run_learner(cfg: TrainConfig, log: Any = None, stop: threading.Event | None = None,
                metrics: Metrics | None = None, health: Any = None, rank: RankEnv | None = None) -> dict[str, Any]:
    """Train on the prepared samples until the run's budget of samples is trained, ``stop``, or
    (ranks) the group stops; ``rank``: one of N data-parallel ranks, each with its own files."""
    rank = rank or RankEnv()
    role = "learner" if rank.rank == 0 else f"learner-rank{rank.rank}"  # each rank its own files
    write_effective_config(cfg, role)
    wiring.set_threads(cfg)
    stop = stop or threading.Event()
    metrics = metrics or Metrics(role="learner")
    metrics.set_learner_fenced(False)  # (rlstream.cli: 1 once a newer learner of this run and rank fenced it)
    cfg = wiring.rank_config(cfg, rank)
    check_redis(cfg.snapshot_url(), cfg.deploy.redis_url, unreachable_ok=True)  # a wrong password: one line, exit 2
    # the learner's writes are transactions of its identity (group, policy, rank): a restarted
    # learner fences the one before it, whose late writes the broker then refuses (docs/explanation/guarantees.md)
    bus = wiring.build_bus(cfg.bus, writer=f"{cfg.bus.learner_group}.{cfg.run.policy_id}.rank{rank.rank}")
    events = wiring.build_events(bus, metrics)
    # the learner is the role that holds the GPU
    proc = RoleProcess(cfg, role, total_steps=cfg.run.total_steps, log=log, health=health, state=True, gpu=True)
    proc.on_close(bus.close)  # (flushes, except where a newer learner fenced this one)

    def idle() -> dict[str, Any]:  # a learner without data for long is the sign of a stalled run
        proc.gpu.sample()
        return {"idle_s": round(time.monotonic() - proc.last_update, 1)}

    proc.progress.extra = idle
    with proc:
        learner = wiring.add_learner(proc, cfg, events, metrics, name=role, rank=rank, bus=bus, stop=stop)
        bind_policy_version(learner.version)
        ranks, breaker = learner.ranks, learner.breaker
        proc.check("policy_published", lambda: (learner.version >= 0, {"version": learner.version}))
        proc.check("breaker", lambda: (True, {"state": breaker.state.name, "trips": breaker.trips,
                                              "policy_lag": learner.stats.policy_lag,
                                              "policy_lag_breaker": learner.policy_breaker.state.name
                                              if learner.policy_breaker is not None else "off"}))
        proc.check("training", lambda: (True, {"updates": learner.stats.updates, **idle()}))
        started = time.perf_counter()
        parallel = ranks.world > 1
        proc.drive([Slot(learner, timeout=0.2)], stop=None if parallel else stop,  # ranks stop together
                   # done once it has trained the run's budget of samples (AGRO/TBA updates can be
                   # larger than a batch: counting updates would wait for samples that never come)
                   done=lambda: learner.stats.samples_trained >= cfg.run.total_steps or ranks.stopping)
    summary = {**learner.summary(), "wall_s": round(time.perf_counter() - started, 3),
               "breaker_trips": breaker.trips, "rank": rank.rank, "world_size": rank.world_size,
               "uneven_updates": ranks.uneven_updates, "gpu": proc.gpu.summary()}
    proc.write_summary(role, summary)
    return summary


def write_effective_config(cfg: TrainConfig, name: str) -> Path:
    """Record the config role ``name`` runs with (``<run_dir>/<name>.config.json``)."""
    return write_config(cfg, RunDir(cfg.run.run_dir).config_file(name))
