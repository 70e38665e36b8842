"""Decoupled mode: actors, the Faust stream processors and the learner as separate processes
over Kafka. ``run_actor``/``run_learner`` are the process bodies of ``rlstream actor`` and
``rlstream learner``; ``run_decoupled`` starts all of them locally (``rlstream train --mode
decoupled``) and stops them when the learner has spent its budget."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from rlstream import wiring
from rlstream.config import TrainConfig
from rlstream.obs.logging import bind_policy_version
from rlstream.obs.metrics import Metrics
from rlstream.obs.tensorboard import TensorBoardRun
from rlstream.obs.ports import (
    ENV_ALGO,
    ENV_KAFKA_BROKERS,
    ENV_METRICS_PORT,
    ENV_POLICY_ID,
    ENV_STALENESS_K,
    ENV_STALENESS_MODE,
    ENV_STALENESS_MS,
)
from rlstream.progress import Progress
from streams.topics import SAMPLES_RAW, STREAMS_GROUP


def _consumer_lag_gauge(metrics: Metrics, bus, group: str, topic: str):
    def lag() -> float:
        value = float(bus.group_lag(group, topic))
        metrics.set_consumer_lag(group, topic, value)
        return value
    return lag


def quantiles_ms(values, qs=(0.5, 0.9, 0.99)) -> dict[str, Any]:
    """Exact quantiles (ms) of latencies in seconds, for summaries and benchmarks."""
    xs = sorted(values)
    if not xs:
        return {"count": 0}
    out: dict[str, Any] = {"count": len(xs)}
    for q in qs:
        out[f"p{round(q * 100)}"] = round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 3)
    out["max"] = round(xs[-1] * 1e3, 3)
    return out


def _set_threads(cfg: TrainConfig) -> None:
    import torch

    torch.set_num_threads(cfg.torch_threads or 1)


def run_actor(cfg: TrainConfig, index: int, log: Any = None, stop: threading.Event | None = None,
              metrics: Metrics | None = None, health: Any = None) -> dict[str, Any]:
    """Collect and publish fragments until ``stop``, under the algorithm's flow control
    (``wiring.build_flow``): the loop heartbeats while it waits for a policy version or room."""
    _set_threads(cfg)
    stop = stop or threading.Event()
    metrics = metrics or Metrics(role="actor")
    bus = wiring.build_bus(cfg.bus)
    events = wiring.build_events(bus, metrics)
    progress = Progress(total_steps=cfg.total_steps, log_every_s=cfg.log_every_s, log=log)
    latencies: deque[float] = deque(maxlen=100_000)
    tb = TensorBoardRun(cfg.tensorboard, cfg.effective_run_id(), f"actor-{index}")

    def on_batch(batch, seconds: float) -> None:
        progress.on_batch(batch.size, batch.episode_returns, 0)
        progress.version = batch.policy_version
        bind_policy_version(batch.policy_version)
        tb.episodes(progress.steps, batch.episode_returns, batch.episode_lengths)
        tb.sps(progress.steps)

    flow = wiring.build_flow(cfg, bus, metrics, log)
    actor = wiring.build_actor(cfg, events, metrics, index, on_batch=on_batch, log=log, flow=flow,
                               on_latency=latencies.append)
    if health is not None:
        health.register("policy", lambda: (actor.subscriber.policy is not None,
                                           {"version": actor.subscriber.version}))
    try:
        while not stop.is_set():
            batch = actor.step(policy_timeout=0.5 if actor.subscriber.policy is None else 0.0)
            if health is not None:
                health.heartbeat("loop")  # waiting for a version or for room is alive, too
            if batch is not None:
                bus.flush()
            progress.maybe_log()
    finally:
        actor.close()
        bus.flush()
        bus.close()
        tb.close()
    learning = {k: v for k, v in progress.summary().items() if k in ("return_mean20", "first_returns_mean")}
    learning.update(progress.write(cfg.run_dir / f"actor-{index}", cfg.plot,
                                   f"{cfg.algo} on {cfg.env_id} (decoupled, actor-{index})"))
    return {"role": "actor", "actor_id": actor.config.actor_id, "steps": progress.steps, "seq": actor.seq, **learning,
            "rejected_fragments": actor.rejected, "policy_versions_adopted": actor.subscriber.adopted,
            "flow": flow.stats(), "policy_latency_ms": quantiles_ms(latencies)}


def run_learner(cfg: TrainConfig, log: Any = None, stop: threading.Event | None = None,
                metrics: Metrics | None = None, health: Any = None) -> dict[str, Any]:
    from learner.circuit_breaker import CircuitBreaker

    _set_threads(cfg)
    stop = stop or threading.Event()
    metrics = metrics or Metrics(role="learner")
    bus = wiring.build_bus(cfg.bus)
    events = wiring.build_events(bus, metrics)
    info = wiring.env_info(cfg)
    algo = wiring.build_algo(cfg, info.obs_dim, info.act_dim, info.nvec)
    progress = Progress(total_steps=cfg.total_steps, log_every_s=cfg.log_every_s, log=log)
    breaker = CircuitBreaker(open_above=cfg.breaker_open_above, close_below=cfg.breaker_close_below,
                             min_open_s=1.0, on_change=metrics.circuit_breaker_hook())
    lag = _consumer_lag_gauge(metrics, bus, STREAMS_GROUP, SAMPLES_RAW)
    tb = TensorBoardRun(cfg.tensorboard, cfg.effective_run_id(), "learner")

    def on_update(learner, m, seconds) -> None:
        progress.updates = learner.stats.updates
        progress.version = learner.version
        progress.steps = learner.stats.samples_trained
        bind_policy_version(learner.version)
        tb.losses(progress.steps, m)
        tb.sps(progress.steps)

    learner = wiring.build_learner(cfg, events, metrics, algo, on_update=on_update, breaker=breaker,
                                   lag_signal=lag)
    learner.start(resume=cfg.resume)
    bind_policy_version(learner.version)
    if health is not None:
        health.register("policy_published", lambda: (learner.version >= 0, {"version": learner.version}))
        health.register("breaker", lambda: (True, {"state": breaker.state.name, "trips": breaker.trips}))
    started = time.perf_counter()
    max_updates = max(1, cfg.total_steps // cfg.train_batch_size)
    try:
        while not stop.is_set() and learner.stats.updates < max_updates:
            learner.step(0.2)
            if health is not None:
                health.heartbeat("loop")  # a learner paused by its breaker or waiting for data is alive
            progress.maybe_log()
        progress.maybe_log(force=True)
    finally:
        if learner.stats.updates:
            learner.snapshot()
        learner.close()
        bus.flush()
        bus.close()
        tb.close()
    return {"role": "learner", "updates": learner.stats.updates, "final_version": learner.version,
            "policy_id": cfg.policy_id, "wall_s": round(time.perf_counter() - started, 3),
            "samples_trained": learner.stats.samples_trained,
            "duplicates_skipped": learner.stats.duplicates_skipped,
            "breaker_trips": breaker.trips,
            "last_metrics": learner.stats.last_metrics}


def _role_cmd(role: str, cfg: TrainConfig, extra: list[str]) -> list[str]:
    base = [sys.executable, "-m", "rlstream.cli", role, "--bus", "kafka", "--bootstrap", cfg.bus.bootstrap,
            "--algo", cfg.algo, "--env", cfg.env_id, "--total-steps", str(cfg.total_steps),
            "--num-envs", str(cfg.num_envs), "--num-actors", str(cfg.num_actors),
            "--train-batch-size", str(cfg.train_batch_size), "--group-size", str(cfg.group_size),
            "--policy-id", cfg.policy_id,
            "--policy-wait", str(cfg.policy_wait_s), "--max-backlog", str(cfg.max_backlog),
            "--seed", str(cfg.seed), "--run-dir", str(cfg.run_dir), "--log-every", str(cfg.log_every_s),
            "--run-id", cfg.effective_run_id(), "--metrics-port", "-1", "--log-json"]
    base += ["--wrappers", ",".join(cfg.wrappers), "--tensorboard", cfg.tensorboard or "off"]
    if cfg.fragment_steps:
        base += ["--fragment-steps", str(cfg.fragment_steps)]
    if cfg.max_batches_per_version:
        base += ["--max-batches-per-version", str(cfg.max_batches_per_version)]
    if not cfg.dynamic_fragments:
        base += ["--fixed-fragments"]
    if cfg.torch_threads:
        base += ["--torch-threads", str(cfg.torch_threads)]
    for k, v in cfg.algo_overrides.items():
        base += ["--set", f"{k}={json.dumps(v)}"]
    return base + extra


def run_decoupled(cfg: TrainConfig, log: Any = None, stop: threading.Event | None = None) -> dict[str, Any]:
    """Start the learner, the Faust worker and ``num_actors`` actors; wait for the learner."""
    stop = stop or threading.Event()
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env[ENV_KAFKA_BROKERS] = cfg.bus.bootstrap
    env.pop(ENV_METRICS_PORT, None)
    env.update(streams_env(cfg))
    logs: list[Path] = []
    procs: dict[str, subprocess.Popen] = {}

    def spawn(name: str, cmd: list[str]) -> None:
        path = cfg.run_dir / f"{name}.log"
        logs.append(path)
        procs[name] = subprocess.Popen(cmd, stdout=path.open("w"), stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)

    bus = wiring.build_bus(cfg.bus)  # create the topics before anyone subscribes
    bus.close()
    spawn("learner", _role_cmd("learner", cfg, []))
    spawn("streams", [sys.executable, "-m", "faust", "-A", "streams", "--datadir", str(cfg.run_dir / "streams-data"),
                      "worker", "-l", "warn", "--without-web"])
    for i in range(cfg.num_actors):
        spawn(f"actor-{i}", _role_cmd("actor", cfg, ["--index", str(i)]))
    if log is not None:
        log.info("decoupled_started", processes=sorted(procs), logs=str(cfg.run_dir))
    rc = None
    try:
        while not stop.is_set():
            rc = procs["learner"].poll()
            if rc is not None:
                break
            dead = [n for n, p in procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"process(es) {dead} exited early; see their logs in {cfg.run_dir}")
            time.sleep(0.5)
    finally:
        for name, p in procs.items():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for name, p in procs.items():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    summaries = {}
    for name in procs:
        text = (cfg.run_dir / f"{name}.log").read_text(errors="replace")
        for line in reversed(text.splitlines()):
            if line.startswith('{"summary"'):
                summaries[name] = json.loads(line)["summary"]
                break
    summary = {"mode": "decoupled", "learner_exit": rc, "processes": summaries,
               "exit_codes": {n: p.returncode for n, p in procs.items()}}
    (cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def streams_env(cfg: TrainConfig) -> dict[str, str]:
    """Settings the Faust worker reads (it is started by faust's own CLI, so they go by env)."""
    p = cfg.prepare_config()
    out = {ENV_ALGO: cfg.algo, ENV_STALENESS_K: str(p.max_versions), ENV_STALENESS_MODE: p.staleness_mode,
           ENV_STALENESS_MS: "none" if p.max_ms is None else str(p.max_ms), ENV_POLICY_ID: cfg.policy_id}
    return out
