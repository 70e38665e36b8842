"""The process bodies of ``rlstream actor`` and ``rlstream learner`` (decoupled mode): each role
built by ``wiring``, driven by ``runtime.roles.drive``, with its progress, state file,
TensorBoard run, health checks and summary."""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Any

from rlstream import wiring
from config import TrainConfig, write_config
from runtime.gpu import GpuSampler
from runtime.logging import bind_policy_version
from runtime.metrics import Metrics
from config.env import (
    RankEnv,
)
from runtime.progress import Progress, quantiles_ms
from runtime.roles import Slot, drive, write_summary
from runtime.rundir import RunDir
from runtime.tensorboard import TensorBoardRun
from streams.topics import SAMPLES_RAW, STREAMS_GROUP


#: An actor's state file carries its newest policy latencies, at most this many (with their
#: running count): the supervisor takes those of each progress window (``RunMonitor``). A window
#: with more adoptions than this per actor is reported on the newest ones.
RECENT_LATENCIES = 256


def _set_threads(cfg: TrainConfig) -> None:
    import torch

    torch.set_num_threads(cfg.torch_threads or 1)


def run_actor(cfg: TrainConfig, index: int | None, log: Any = None, stop: threading.Event | None = None,
              metrics: Metrics | None = None, health: Any = None, host: str = "actor") -> dict[str, Any]:
    """Collect and publish fragments until ``stop`` or until the actor's step budget
    (``cfg.actor_budget()``) is spent, under the algorithm's flow control (``wiring.build_flow``):
    the loop heartbeats while it waits for a policy version, room, or a stalled learner.
    ``index`` None: the id is ``<host>-<generation>`` (``actor.identity.register``)."""
    _set_threads(cfg)
    stop = stop or threading.Event()
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

    latencies: deque[float] = deque(maxlen=100_000)
    counted = [0]  # policy latencies so far (the deque keeps the newest)

    def on_latency(s: float) -> None:
        latencies.append(s)
        counted[0] += 1

    def stall() -> dict[str, Any]:
        return {"stalled": flow.stalled, "stalled_s": round(flow.stalled_for(), 1),
                "steps_ahead": flow.gate.steps_ahead, "budget": flow.budget}

    def live() -> dict[str, Any]:  # the supervisor's timeline takes each window's latencies from these
        return {**stall(), "policy_latency_count": counted[0],
                "policy_latency_recent_ms": [round(x * 1e3, 3) for x in
                                             reversed(list(itertools.islice(reversed(latencies), RECENT_LATENCIES)))]}

    progress = Progress(total_steps=cfg.actor_budget(), log_every_s=cfg.log_every_s, log=log, extra=live,
                        state_path=RunDir(cfg.run_dir).state_file(name))
    tb = TensorBoardRun(cfg.tensorboard, cfg.effective_run_id(), name)

    collect_s = [0.0]  # time spent collecting and publishing (waits left out): the actor's own rate

    def on_batch(batch, seconds: float) -> None:
        collect_s[0] += seconds
        progress.on_batch(batch.size, batch.episode_returns, 0)
        progress.version = batch.policy_version
        bind_policy_version(batch.policy_version)
        tb.episodes(progress.steps, batch.episode_returns, batch.episode_lengths)
        tb.sps(progress.steps)

    actor = wiring.build_actor(cfg, events, metrics, index, on_batch=on_batch, log=log, flow=flow,
                               on_latency=on_latency, actor_id=name)
    if health is not None:
        health.register("policy", lambda: (actor.subscriber.policy is not None,
                                           {"version": actor.subscriber.version}))
        health.register("learner_progress", lambda: (not flow.stalled, stall()))
    try:
        drive([Slot(actor, timeout=0.5)], done=lambda: flow.exhausted, stop=stop,
              on_round=_round(bus, health, progress))  # waiting for a version or for room is alive, too
        progress.maybe_log(force=True)
    finally:
        actor.close()
        bus.flush()
        bus.close()
        tb.close()
    learning = {k: v for k, v in progress.summary().items() if k in ("return_mean20", "first_returns_mean")}
    learning.update(progress.write(cfg.run_dir / name, cfg.plot,
                                   f"{cfg.algo} on {cfg.env_id} (decoupled, {name})"))
    summary = {**actor.summary(), "actor_id": actor.config.actor_id, "steps": progress.steps, **learning,
               "collect_s": round(collect_s[0], 3),
               "flow": flow.stats(), "policy_latency_ms": quantiles_ms(latencies)}
    write_summary(cfg.run_dir, name, summary)
    return summary


def _round(flush: Any, health: Any, progress: Progress):
    """What a decoupled child does after each round of its role: flush what it produced (an
    actor's fragment), heartbeat (a role waiting for data, a version or room is alive) and log
    progress."""
    def after() -> None:
        if flush is not None:
            flush.flush()
        if health is not None:
            health.heartbeat("loop")
        progress.maybe_log()
    return after


def run_learner(cfg: TrainConfig, log: Any = None, stop: threading.Event | None = None,
                metrics: Metrics | None = None, health: Any = None, rank: RankEnv | None = None) -> dict[str, Any]:
    from learner import distributed

    rank = rank or RankEnv()
    role = "learner" if rank.rank == 0 else f"learner-rank{rank.rank}"  # each rank its own files
    write_effective_config(cfg, role)
    _set_threads(cfg)
    stop = stop or threading.Event()
    metrics = metrics or Metrics(role="learner")
    if rank.world_size > 1:  # one of N data-parallel ranks (docs/explanation/learner-ranks.md)
        device = distributed.parse_devices(cfg.device, cfg.learners or rank.world_size)[rank.local_rank]
        cfg = replace(cfg, device=device, tensorboard=cfg.tensorboard if rank.rank == 0 else None)
    bus = wiring.build_bus(cfg.bus)
    events = wiring.build_events(bus, metrics)
    info = wiring.env_info(cfg)
    algo = wiring.build_algo(cfg, info.obs_dim, info.act_dim, info.nvec)
    parallel = wiring.build_data_parallel(cfg, algo, rank, stop)
    last_update = [time.monotonic()]
    gpu = GpuSampler()  # the learner is the role that holds the GPU

    def idle() -> dict[str, Any]:  # a learner without data for long is the sign of a stalled run
        gpu.sample()
        return {"idle_s": round(time.monotonic() - last_update[0], 1)}

    progress = Progress(total_steps=cfg.total_steps, log_every_s=cfg.log_every_s, log=log, extra=idle,
                        state_path=RunDir(cfg.run_dir).state_file(role))
    breaker = wiring.build_backlog_breaker(cfg, metrics)
    lag = wiring.consumer_lag_gauge(metrics, bus, STREAMS_GROUP, SAMPLES_RAW)
    tb = TensorBoardRun(cfg.tensorboard, cfg.effective_run_id(), "learner")

    def on_update(learner, m, seconds) -> None:
        progress.updates = learner.stats.updates
        progress.version = learner.version
        progress.steps = learner.stats.samples_trained
        last_update[0] = time.monotonic()
        bind_policy_version(learner.version)
        tb.losses(progress.steps, m)
        tb.sps(progress.steps)

    learner = wiring.build_learner(cfg, events, metrics, algo, on_update=on_update, breaker=breaker,
                                   lag_signal=lag, parallel=parallel, gpu_util=gpu.utilization)
    learner.start(resume=cfg.resume)
    bind_policy_version(learner.version)
    if health is not None:
        health.register("policy_published", lambda: (learner.version >= 0, {"version": learner.version}))
        health.register("breaker", lambda: (True, {"state": breaker.state.name, "trips": breaker.trips,
                                                   "policy_lag": learner.stats.policy_lag,
                                                   "policy_lag_breaker": learner.policy_breaker.state.name
                                                   if learner.policy_breaker is not None else "off"}))
        health.register("training", lambda: (True, {"updates": learner.stats.updates, **idle()}))
    started = time.perf_counter()
    try:
        drive([Slot(learner, timeout=0.2)], stop=None if parallel else stop,  # ranks stop together
              # done once it has trained the run's budget of samples (AGRO/TBA updates can be
              # larger than a batch: counting updates would wait for samples that never come)
              done=lambda: learner.stats.samples_trained >= cfg.total_steps or bool(parallel and parallel.stopping),
              on_round=_round(None, health, progress))
        progress.maybe_log(force=True)
    finally:
        if learner.stats.updates and not (parallel and parallel.broken):  # a lost peer: the last snapshot stands
            learner.snapshot()
        learner.close()
        bus.flush()
        bus.close()
        tb.close()
        distributed.close_group()
    summary = {**learner.summary(), "wall_s": round(time.perf_counter() - started, 3),
               "breaker_trips": breaker.trips, "rank": rank.rank, "world_size": rank.world_size,
               "uneven_updates": parallel.uneven_updates if parallel else 0, "gpu": gpu.summary()}
    write_summary(cfg.run_dir, role, summary)
    return summary


def write_effective_config(cfg: TrainConfig, name: str) -> Path:
    """Record the config role ``name`` runs with (``<run_dir>/<name>.config.json``)."""
    return write_config(cfg, cfg.run_dir / f"{name}.config.json")
