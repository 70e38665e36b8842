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
from dataclasses import replace
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
    ENV_NAMESPACE,
    ENV_POLICY_ID,
    ENV_STALENESS_K,
    ENV_STALENESS_MODE,
    ENV_STALENESS_MS,
)
from rlstream.progress import Progress, read_state
from streams.topics import LEARNER_GROUP, SAMPLES_PREPARED, SAMPLES_RAW, STREAMS_GROUP

#: File in a decoupled run's directory naming its namespace (``--resume`` reads it).
NAMESPACE_FILE = "namespace"


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


def state_path(cfg: TrainConfig, name: str) -> Path:
    """Where role ``name`` (``learner``, ``actor-<i>``) writes its progress fields."""
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    return cfg.run_dir / f"{name}.state.json"


def run_actor(cfg: TrainConfig, index: int, log: Any = None, stop: threading.Event | None = None,
              metrics: Metrics | None = None, health: Any = None) -> dict[str, Any]:
    """Collect and publish fragments until ``stop`` or until the actor's step budget
    (``cfg.actor_budget()``) is spent, under the algorithm's flow control (``wiring.build_flow``):
    the loop heartbeats while it waits for a policy version, room, or a stalled learner."""
    _set_threads(cfg)
    stop = stop or threading.Event()
    metrics = metrics or Metrics(role="actor")
    bus = wiring.build_bus(cfg.bus)
    events = wiring.build_events(bus, metrics)
    flow = wiring.build_flow(cfg, bus, metrics, log)

    def stall() -> dict[str, Any]:
        return {"stalled": flow.stalled, "stalled_s": round(flow.stalled_for(), 1),
                "steps_ahead": flow.gate.steps_ahead, "budget": flow.budget}

    progress = Progress(total_steps=cfg.actor_budget(), log_every_s=cfg.log_every_s, log=log, extra=stall,
                        state_path=state_path(cfg, f"actor-{index}"))
    latencies: deque[float] = deque(maxlen=100_000)
    tb = TensorBoardRun(cfg.tensorboard, cfg.effective_run_id(), f"actor-{index}")

    def on_batch(batch, seconds: float) -> None:
        progress.on_batch(batch.size, batch.episode_returns, 0)
        progress.version = batch.policy_version
        bind_policy_version(batch.policy_version)
        tb.episodes(progress.steps, batch.episode_returns, batch.episode_lengths)
        tb.sps(progress.steps)

    actor = wiring.build_actor(cfg, events, metrics, index, on_batch=on_batch, log=log, flow=flow,
                               on_latency=latencies.append)
    if health is not None:
        health.register("policy", lambda: (actor.subscriber.policy is not None,
                                           {"version": actor.subscriber.version}))
        health.register("learner_progress", lambda: (not flow.stalled, stall()))
    try:
        while not stop.is_set() and not flow.exhausted:
            batch = actor.step(policy_timeout=0.5 if actor.subscriber.policy is None else 0.0)
            if health is not None:
                health.heartbeat("loop")  # waiting for a version or for room is alive, too
            if batch is not None:
                bus.flush()
            progress.maybe_log()
        progress.maybe_log(force=True)
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
    from learner import distributed
    from learner.circuit_breaker import CircuitBreaker

    _set_threads(cfg)
    stop = stop or threading.Event()
    metrics = metrics or Metrics(role="learner")
    rank = distributed.RankEnv.from_environ()
    if rank.world_size > 1:  # one of N data-parallel ranks (docs/learners.md)
        device = distributed.parse_devices(cfg.device, cfg.learners or rank.world_size)[rank.local_rank]
        cfg = replace(cfg, device=device, tensorboard=cfg.tensorboard if rank.rank == 0 else None)
    bus = wiring.build_bus(cfg.bus)
    events = wiring.build_events(bus, metrics)
    info = wiring.env_info(cfg)
    algo = wiring.build_algo(cfg, info.obs_dim, info.act_dim, info.nvec)
    parallel = None
    if rank.world_size > 1:
        parallel = distributed.DataParallel.from_env(algo, cfg.grad_compression, stop=stop.is_set)
    last_update = [time.monotonic()]

    def idle() -> dict[str, Any]:  # a learner without data for long is the sign of a stalled run
        return {"idle_s": round(time.monotonic() - last_update[0], 1)}

    progress = Progress(total_steps=cfg.total_steps, log_every_s=cfg.log_every_s, log=log, extra=idle,
                        state_path=state_path(cfg, "learner" if rank.rank == 0 else f"learner-rank{rank.rank}"))
    breaker = CircuitBreaker(open_above=cfg.breaker_open_above, close_below=cfg.breaker_close_below,
                             min_open_s=1.0, on_change=metrics.circuit_breaker_hook())
    lag = _consumer_lag_gauge(metrics, bus, STREAMS_GROUP, SAMPLES_RAW)
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
                                   lag_signal=lag, parallel=parallel)
    learner.start(resume=cfg.resume)
    bind_policy_version(learner.version)
    if health is not None:
        health.register("policy_published", lambda: (learner.version >= 0, {"version": learner.version}))
        health.register("breaker", lambda: (True, {"state": breaker.state.name, "trips": breaker.trips}))
        health.register("training", lambda: (True, {"updates": learner.stats.updates, **idle()}))
    started = time.perf_counter()
    max_updates = max(1, cfg.total_steps // cfg.train_batch_size)
    try:
        while not (parallel.stopping if parallel else stop.is_set()) and learner.stats.updates < max_updates:
            learner.step(0.2)
            if health is not None:
                health.heartbeat("loop")  # a learner paused by its breaker or waiting for data is alive
            progress.maybe_log()
        progress.maybe_log(force=True)
    finally:
        if learner.stats.updates and not (parallel and parallel.broken):  # a lost peer: the last snapshot stands
            learner.snapshot()
        learner.close()
        bus.flush()
        bus.close()
        tb.close()
        distributed.close_group()
    return {"role": "learner", "rank": rank.rank, "world_size": rank.world_size,
            "uneven_updates": parallel.uneven_updates if parallel else 0,
            "updates": learner.stats.updates, "final_version": learner.version,
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
            "--run-id", cfg.effective_run_id(), "--namespace", cfg.bus.namespace,
            "--actor-steps", str(cfg.actor_budget()), "--max-steps-ahead", str(cfg.steps_ahead_bound()),
            "--metrics-port", "-1", "--log-json"]
    base += ["--wrappers", ",".join(cfg.wrappers), "--tensorboard", cfg.tensorboard or "off"]
    if cfg.fragment_steps:
        base += ["--fragment-steps", str(cfg.fragment_steps)]
    if cfg.max_batches_per_version:
        base += ["--max-batches-per-version", str(cfg.max_batches_per_version)]
    if not cfg.dynamic_fragments:
        base += ["--fixed-fragments"]
    if cfg.torch_threads:
        base += ["--torch-threads", str(cfg.torch_threads)]
    if role == "learner":
        base += ["--device", cfg.device, "--grad-compression", cfg.grad_compression]
        base += ["--learners", str(cfg.learners)] if cfg.learners else []
    for k, v in cfg.algo_overrides.items():
        base += ["--set", f"{k}={json.dumps(v)}"]
    return base + extra


class ChildExited(RuntimeError):
    """A process of a decoupled run died; the message names its log file and exit code."""

    def __init__(self, name: str, code: int, log_path: Path) -> None:
        tail = _tail(log_path, 5)
        super().__init__(f"{name} exited with code {code}; see its log {log_path}"
                         + ("\n  last lines:\n    " + "\n    ".join(tail) if tail else ""))
        self.name, self.code, self.log_path = name, code, log_path


def _tail(path: Path, n: int) -> list[str]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line[:300] for line in lines[-n:]]


class RunMonitor:
    """Progress lines of a decoupled run, like co-located mode's, from the children's state files
    (``Progress.state_path``) and the groups' lags on the bus."""

    def __init__(self, cfg: TrainConfig, bus: Any, actors: list[str], log: Any = None) -> None:
        self.cfg, self.bus, self.actors, self.log = cfg, bus, actors, log
        self._last = (time.perf_counter(), 0)

    def _lag(self, group: str, topic: str) -> int | None:
        try:
            return int(self.bus.group_lag(group, topic))
        except Exception:  # the broker may be restarting: a missing figure, not a failed run
            return None

    def fields(self) -> dict[str, Any]:
        states = {n: read_state(state_path(self.cfg, n)) or {} for n in self.actors}
        learner = read_state(state_path(self.cfg, "learner")) or {}
        steps = sum(int(st.get("steps", 0)) for st in states.values())
        now = time.perf_counter()
        t0, s0 = self._last
        self._last = (now, steps)
        returns = [st["return_mean20"] for st in states.values() if st.get("return_mean20") is not None]
        version = int(learner.get("policy_version", 0))
        actor_versions = [int(st["policy_version"]) for st in states.values() if "policy_version" in st]
        return {
            "steps": steps,
            "pct": round(100.0 * steps / max(1, self.cfg.total_steps), 1),
            "sps": round((steps - s0) / max(1e-9, now - t0)),
            "episodes": sum(int(st.get("episodes", 0)) for st in states.values()),
            "return_mean20": round(sum(returns) / len(returns), 1) if returns else None,
            "updates": int(learner.get("updates", 0)),
            "policy_version": version,
            # versions the slowest actor is behind the newest (the learner's state may be older)
            "policy_lag": max(version, *actor_versions) - min(actor_versions) if actor_versions else None,
            "consumer_lag_raw": self._lag(STREAMS_GROUP, SAMPLES_RAW),
            "consumer_lag_prepared": self._lag(LEARNER_GROUP, SAMPLES_PREPARED),
            "stalled": sorted(n for n, st in states.items() if st.get("stalled")),
            "learner_idle_s": learner.get("idle_s"),
        }

    def log_line(self) -> dict[str, Any]:
        fields = self.fields()
        if self.log is not None:
            self.log.info("progress", **fields)
            if fields["stalled"]:
                self.log.warning("run_stalled", actors=fields["stalled"], updates=fields["updates"],
                                 note="actors wait: the learner's policy version has not advanced")
        else:
            print(json.dumps({"event": "progress", **fields}), file=sys.stderr, flush=True)
        return fields


def run_decoupled(cfg: TrainConfig, log: Any = None, stop: threading.Event | None = None) -> dict[str, Any]:
    """Start the learner, the Faust worker and ``num_actors`` actors in ``cfg.bus.namespace``;
    print progress every ``log_every_s``; wait for the learner. Actors stop at their budget;
    once all have, the learner trains on what is left until it makes no more progress for
    ``drain_s``. Any other exit raises ``ChildExited``."""
    stop = stop or threading.Event()
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    (cfg.run_dir / NAMESPACE_FILE).write_text(cfg.bus.namespace + "\n")
    for old in cfg.run_dir.glob("*.state.json"):
        old.unlink()  # a previous run's figures are not this run's
    env = dict(os.environ)
    env[ENV_KAFKA_BROKERS] = cfg.bus.bootstrap
    env.pop(ENV_METRICS_PORT, None)
    env.update(streams_env(cfg))
    procs: dict[str, subprocess.Popen] = {}

    def log_path(name: str) -> Path:
        return cfg.run_dir / f"{name}.log"

    def spawn(name: str, cmd: list[str]) -> None:
        procs[name] = subprocess.Popen(cmd, stdout=log_path(name).open("w"), stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)

    bus = wiring.build_bus(cfg.bus)  # create the topics before anyone subscribes; read lags from it
    actors = [f"actor-{i}" for i in range(cfg.num_actors)]
    monitor = RunMonitor(cfg, bus, actors, log)
    drain_s = max(30.0, 3 * cfg.log_every_s)
    rc, ended = None, "stopped"  # why the run ended: learner_done, drained or stopped (a signal)
    try:
        spawn("learner", _role_cmd("learner", cfg, []))
        spawn("streams", [sys.executable, "-m", "faust", "-A", "streams", "--datadir",
                          str(cfg.run_dir / "streams-data"), "worker", "-l", "warn", "--without-web"])
        for i, name in enumerate(actors):
            spawn(name, _role_cmd("actor", cfg, ["--index", str(i)]))
        if log is not None:
            log.info("decoupled_started", processes=sorted(procs), logs=str(cfg.run_dir),
                     namespace=cfg.bus.namespace or "(legacy)")
        next_line = time.monotonic() + cfg.log_every_s
        drained: tuple[int, float] | None = None  # (learner updates, since) once every actor is done
        while not stop.is_set():
            rc = procs["learner"].poll()
            if rc is not None:
                if rc != 0:
                    raise ChildExited("learner", rc, log_path("learner"))
                ended = "learner_done"
                break
            for name, p in procs.items():
                code = p.poll()
                if code is not None and not (name in actors and code == 0):  # 0: spent its budget
                    raise ChildExited(name, code, log_path(name))
            if time.monotonic() >= next_line:
                next_line = time.monotonic() + cfg.log_every_s
                updates = monitor.log_line()["updates"]
                if all(procs[n].poll() == 0 for n in actors):
                    if drained is None or drained[0] != updates:
                        drained = (updates, time.monotonic())
                    elif time.monotonic() - drained[1] > drain_s:
                        if log is not None:
                            log.info("learner_drained", updates=updates,
                                     note=f"actors spent their budget; no update for {drain_s:.0f}s")
                        ended = "drained"
                        break
            stop.wait(0.5)
        monitor.log_line()
    finally:
        bus.close()
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
        text = log_path(name).read_text(errors="replace")
        for line in reversed(text.splitlines()):
            if line.startswith('{"summary"'):
                summaries[name] = json.loads(line)["summary"]
                break
    summary = {"mode": "decoupled", "namespace": cfg.bus.namespace, "ended": ended, "learner_exit": rc,
               "processes": summaries,
               "exit_codes": {n: p.returncode for n, p in procs.items()}}
    (cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def streams_env(cfg: TrainConfig) -> dict[str, str]:
    """Settings the Faust worker reads (it is started by faust's own CLI, so they go by env)."""
    p = cfg.prepare_config()
    out = {ENV_ALGO: cfg.algo, ENV_STALENESS_K: str(p.max_versions), ENV_STALENESS_MODE: p.staleness_mode,
           ENV_STALENESS_MS: "none" if p.max_ms is None else str(p.max_ms), ENV_POLICY_ID: cfg.policy_id,
           ENV_NAMESPACE: cfg.bus.namespace}
    return out
