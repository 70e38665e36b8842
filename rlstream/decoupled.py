"""Decoupled mode: actors, the Faust stream processors and the learner as separate processes
over Kafka. ``run_actor``/``run_learner`` are the process bodies of ``rlstream actor`` and
``rlstream learner``; ``run_decoupled`` starts all of them locally (``rlstream train --mode
decoupled``) and stops them when the learner has spent its budget."""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rlstream import wiring
from config import TrainConfig, write_config
from runtime.gpu import GpuSampler
from runtime.logging import bind_policy_version
from runtime.metrics import Metrics
from config.env import (
    ENV_BLOB_CACHE,
    ENV_CONFIG,
    ENV_KAFKA_BROKERS,
    ENV_METRICS_PORT,
    ENV_NAMESPACE,
    ENV_PROCESS,
    ENV_REDIS_URL,
    ENV_RUN_DIR,
    Environment,
    RankEnv,
)
from runtime.ports import LIVENESS_PROBE, STARTUP_PROBE, Probe
from runtime.progress import TIMELINE_FILE, Progress, quantiles_ms, read_state
from runtime.roles import Slot, clear_summaries, drive, read_summaries, summary_path, write_summary
from runtime.tensorboard import TensorBoardRun
from config.runfile import CONFIG_FILE
from runtime.rundir import RunDir, write_json_atomic
from config.train import OVERLAP_COLOCATED_ONLY
from streams.topics import SAMPLES_PREPARED, SAMPLES_RAW, STREAMS_GROUP

#: An actor's state file carries its newest policy latencies, at most this many (with their
#: running count): the supervisor takes those of each progress window (``RunMonitor``). A window
#: with more adoptions than this per actor is reported on the newest ones.
RECENT_LATENCIES = 256


def _consumer_lag_gauge(metrics: Metrics, bus, group: str, topic: str):
    def lag() -> float:
        value = float(bus.group_lag(group, topic))
        metrics.set_consumer_lag(group, topic, value)
        return value
    return lag


def _set_threads(cfg: TrainConfig) -> None:
    import torch

    torch.set_num_threads(cfg.torch_threads or 1)


def state_path(cfg: TrainConfig, name: str) -> Path:
    """Where role ``name`` (``learner``, ``actor-<i>``) writes its progress fields."""
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    return cfg.run_dir / f"{name}.state.json"


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
                        state_path=state_path(cfg, name))
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
    if rank.world_size > 1:  # one of N data-parallel ranks (docs/learners.md)
        device = distributed.parse_devices(cfg.device, cfg.learners or rank.world_size)[rank.local_rank]
        cfg = replace(cfg, device=device, tensorboard=cfg.tensorboard if rank.rank == 0 else None)
    bus = wiring.build_bus(cfg.bus)
    events = wiring.build_events(bus, metrics)
    info = wiring.env_info(cfg)
    algo = wiring.build_algo(cfg, info.obs_dim, info.act_dim, info.nvec)
    parallel = None
    if rank.world_size > 1:
        parallel = distributed.DataParallel.from_env(algo, rank, cfg.grad_compression, stop=stop.is_set)
    last_update = [time.monotonic()]
    gpu = GpuSampler()  # the learner is the role that holds the GPU

    def idle() -> dict[str, Any]:  # a learner without data for long is the sign of a stalled run
        gpu.sample()
        return {"idle_s": round(time.monotonic() - last_update[0], 1)}

    progress = Progress(total_steps=cfg.total_steps, log_every_s=cfg.log_every_s, log=log, extra=idle,
                        state_path=state_path(cfg, role))
    breaker = wiring.build_backlog_breaker(cfg, metrics)
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


def child_config(cfg: TrainConfig) -> TrainConfig:
    """The config every child of ``run_decoupled`` reads from ``<run_dir>/config.json``: ``cfg``
    resolved (``TrainConfig.resolved``), each actor's budget and lead fixed, no metrics servers
    (many roles on one host; the parent reads their state files instead)."""
    return replace(cfg.resolved(), mode="decoupled", actor_steps=cfg.actor_budget(),
                   max_steps_ahead=cfg.steps_ahead_bound(), metrics_port=-1)


def child_commands(cfg: TrainConfig, config_path: Path) -> dict[str, list[str]]:
    """Process name -> argv of every child of a decoupled run; all read ``config_path`` (the
    Faust worker through ``RLSTREAM_CONFIG``, see ``child_env``)."""
    def role(name: str, *extra: str) -> list[str]:
        return [sys.executable, "-m", "rlstream.cli", name, "--config", str(config_path), "--log-json", *extra]

    cmds = {"learner": role("learner"),
            "streams": streams_cmd(cfg, 0)}
    cmds.update({f"streams-{i}": streams_cmd(cfg, i) for i in range(1, max(1, cfg.stream_workers))})
    cmds.update({f"actor-{i}": role("actor", "--index", str(i)) for i in range(cfg.num_actors)})
    return cmds


def child_env(cfg: TrainConfig, config_path: Path, env: Environment) -> dict[str, str]:
    """The environment of the children: this one's (``env``), with the run's config file, bus
    and claim-check store."""
    return env.child({ENV_METRICS_PORT: None, ENV_CONFIG: str(config_path), ENV_KAFKA_BROKERS: cfg.bus.bootstrap,
                      ENV_NAMESPACE: cfg.bus.namespace, ENV_RUN_DIR: str(cfg.run_dir),
                      ENV_BLOB_CACHE: cfg.blob_cache_dir() or "off", ENV_REDIS_URL: cfg.redis()})


def write_effective_config(cfg: TrainConfig, name: str) -> Path:
    """Record the config role ``name`` runs with (``<run_dir>/<name>.config.json``)."""
    return write_config(cfg, cfg.run_dir / f"{name}.config.json")


class ChildExited(RuntimeError):
    """A process of a decoupled run died; the message names its log file and exit code."""

    def __init__(self, name: str, code: int, log_path: Path, note: str = "") -> None:
        tail = _tail(log_path, 5)
        super().__init__(f"{name} exited with code {code}{' ' + note if note else ''}; see its log {log_path}"
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
    (``Progress.state_path``) and the groups' lags on the bus.

    Each line also carries the go-live figures of its window (since the line before), as a
    co-located run's do: ``policy_latency_p99_ms`` over every actor's policy latencies of the window
    (their state files' newest latencies and running count), and ``freshness``, the fresh share of
    the samples the stream workers (``streams``: their names) checked in the window (their state
    files' running counts; a child restarted, another ``pid``, counts again from 0). Every line is kept,
    with its time since the start (``t_s``), in ``<run_dir>/timeline.json`` (rewritten at each
    line), what ``rlstream validate`` plots."""

    def __init__(self, cfg: TrainConfig, bus: Any, actors: list[str], log: Any = None,
                 restarts: dict[str, int] | None = None, streams: list[str] = ()) -> None:
        self.cfg, self.bus, self.actors, self.log = cfg, bus, actors, log
        self.streams = list(streams)
        self.restarts = restarts if restarts is not None else {}  # role -> restarts so far (live)
        self._last = (time.perf_counter(), 0)
        self.started = time.perf_counter()
        self.timeline: list[dict[str, Any]] = []
        self._latency_seen: dict[str, tuple[Any, int]] = {}  # actor -> (pid, latencies counted so far)
        self._fresh_seen: dict[str, tuple[Any, int, int]] = {}  # stream worker -> (pid, fresh, checked)

    def _window_latency_p99(self, states: dict[str, dict[str, Any]]) -> float | None:
        window: list[float] = []
        for name, st in states.items():
            count, recent = st.get("policy_latency_count"), st.get("policy_latency_recent_ms") or []
            if not isinstance(count, int):
                continue
            pid, seen = self._latency_seen.get(name, (None, 0))
            new = count - seen if st.get("pid") == pid else count  # another process: restarted, from 0
            self._latency_seen[name] = (st.get("pid"), count)
            if new > 0:
                window += recent[-new:]
        return quantiles_ms([ms / 1e3 for ms in window]).get("p99")

    def _window_freshness(self) -> float | None:
        fresh = checked = 0
        for name in self.streams:
            st = read_state(self.cfg.run_dir / f"{name}.state.json") or {}
            f, c = st.get("fresh_samples"), st.get("checked_samples")
            if not (isinstance(f, int) and isinstance(c, int)):
                continue
            pid, f0, c0 = self._fresh_seen.get(name, (None, 0, 0))
            if st.get("pid") != pid:  # another process: restarted, its counts start from 0
                f0 = c0 = 0
            self._fresh_seen[name] = (st.get("pid"), f, c)
            fresh, checked = fresh + f - f0, checked + c - c0
        return round(fresh / checked, 4) if checked else None

    def _lag(self, group: str, topic: str) -> int | None:
        try:
            return int(self.bus.group_lag(group, topic))
        except Exception:  # the broker may be restarting: a missing figure, not a failed run
            return None

    def fields(self) -> dict[str, Any]:
        states = {n: read_state(state_path(self.cfg, n)) or {} for n in self.actors}
        learner = self._learner_state()
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
            "consumer_lag_prepared": self._lag(self.cfg.bus.learner_group, SAMPLES_PREPARED),
            "stalled": sorted(n for n, st in states.items() if st.get("stalled")),
            "learner_idle_s": learner.get("idle_s"),
            "restarts": {n: k for n, k in sorted(self.restarts.items()) if k},
            "policy_latency_p99_ms": self._window_latency_p99(states),
            "freshness": self._window_freshness(),
        }

    def _learner_state(self) -> dict[str, Any]:
        return read_state(state_path(self.cfg, "learner")) or {}

    def learner_updates(self) -> int:
        """The learner's update count from its state file (no broker call)."""
        return int(self._learner_state().get("updates", 0))

    def log_line(self) -> dict[str, Any]:
        fields = self.fields()
        self.timeline.append({"t_s": round(time.perf_counter() - self.started, 3), **fields})
        write_json_atomic(self.cfg.run_dir / TIMELINE_FILE, self.timeline, indent=None)
        if self.log is not None:
            self.log.info("progress", **fields)
            if fields["stalled"]:
                self.log.warning("run_stalled", actors=fields["stalled"], updates=fields["updates"],
                                 note="actors wait: the learner's policy version has not advanced")
        else:
            print(json.dumps({"event": "progress", **fields}), file=sys.stderr, flush=True)
        return fields


#: Probes go straight to the child, never through a proxy the environment names (as the kubelet's).
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


#: ``http_probe``'s details when the child's server is closed or closing (a child on its way
#: out): nothing listens on the port, or it dropped the connection unanswered.
REFUSED = "connection refused (no server on the port)"
RESET = "connection reset (its server closed it unanswered)"


def http_probe(url: str, timeout_s: float) -> tuple[bool, str]:
    """One ``httpGet`` probe as the kubelet runs it: ``(ok, detail)``, ok on a 2xx or 3xx answer
    within ``timeout_s``; a refused connection (``REFUSED``), a time-out or another status fails."""
    try:
        with _DIRECT.open(url, timeout=timeout_s) as resp:
            return 200 <= resp.status < 400, f"HTTP {resp.status}"
    except urllib.error.HTTPError as e:
        body = e.read(300).decode(errors="replace").strip()
        return False, f"HTTP {e.code}" + (f": {body}" if body else "")
    except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out
        reason = getattr(e, "reason", e)
        if isinstance(reason, ConnectionRefusedError):
            return False, REFUSED
        if isinstance(reason, ConnectionResetError):  # http.client.RemoteDisconnected too
            return False, RESET
        return False, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


@dataclass
class _ProbeState:
    url: str
    next_at: float  # monotonic time of the next probe
    answered: bool = False  # started: a probe has passed once
    failures: int = 0  # liveness failures in a row
    refused_since: float | None = None  # monotonic time its server stopped answering (``REFUSED``)


class Supervisor:
    """The children of a local decoupled run, restarted as Kubernetes would: a role that dies is
    started again after a backoff (``BACKOFF_S``, doubling up to ``BACKOFF_MAX_S``), at most
    ``max_restarts`` times per role; one more death raises ``ChildExited`` naming its log.
    An actor that exits 0 has spent its budget and stays down; a restarted learner resumes from
    its newest snapshot and committed offsets (``--resume``); its log files are appended to.

    A child spawned with a ``health_url`` is probed as the manifests' probes do
    (``runtime.ports``): every ``startup.period_s`` until it first answers, then every
    ``liveness.period_s``; ``liveness.failure_threshold`` failed probes in a row (no 2xx/3xx
    within ``liveness.timeout_s``: hung, stopped, or its ``/healthz`` says it is unhealthy, as
    ``rlstream serve``'s does when ``/act`` is slow) kill its process group (SIGKILL: a hung
    process does not act on SIGTERM), and it is restarted like a child that died, with the
    reason logged and in ``reasons``. Unlike a startupProbe, a child that never answers is not
    killed (it may have lost its port to a race and runs without a server). ``liveness=None``:
    no probes. ``check`` runs the probes that are due, one after another, on the caller's thread.

    A child that has exited is not probed, and one whose server refuses or resets connections after
    it answered (it closed its server on its way out: a learner past its last snapshot) has
    ``EXIT_GRACE_S`` to exit before those refusals count as failures: a clean finish logs no
    ``liveness_probe_failed``."""

    BACKOFF_S = 1.0
    BACKOFF_MAX_S = 30.0
    EXIT_GRACE_S = 20.0

    def __init__(self, env: dict[str, str], log_dir: Path, max_restarts: int, log: Any = None,
                 liveness: Probe | None = LIVENESS_PROBE, startup: Probe = STARTUP_PROBE) -> None:
        self.env, self.log_dir, self.max_restarts, self.log = env, log_dir, max_restarts, log
        self.liveness, self.startup = liveness, startup
        self.procs: dict[str, subprocess.Popen] = {}
        self.cmds: dict[str, list[str]] = {}
        self.envs: dict[str, dict[str, str]] = {}
        self.restarts: dict[str, int] = {}
        self.pending: dict[str, float] = {}  # role -> monotonic time of its restart
        self.health_urls: dict[str, str] = {}
        self.probes: dict[str, _ProbeState] = {}
        self.killed: dict[str, str] = {}  # role -> why the supervisor killed it (until restarted)
        self.reasons: list[dict[str, Any]] = []  # every restart: role, restart, reason

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None,
              health_url: str | None = None) -> None:
        """Start ``name`` (again: same command, same ``env`` over the run's, log appended; probed
        at ``health_url``, given once)."""
        self.cmds[name] = cmd
        if env is not None:
            self.envs[name] = env
        if health_url is not None:
            self.health_urls[name] = health_url
        mode = "a" if name in self.procs else "w"
        self.procs[name] = subprocess.Popen(cmd, stdout=self.log_path(name).open(mode), stderr=subprocess.STDOUT,
                                            env={**self.env, **self.envs.get(name, {}), ENV_PROCESS: name},
                                            start_new_session=True)
        if name in self.health_urls:
            self.probes[name] = _ProbeState(self.health_urls[name], next_at=time.monotonic() + self.startup.period_s)

    def probe(self) -> None:
        """Run each due probe; kill a child that has failed ``liveness.failure_threshold`` in a row."""
        if self.liveness is None:
            return
        for name, st in self.probes.items():
            p = self.procs[name]
            if name in self.pending or name in self.killed or p.poll() is not None or time.monotonic() < st.next_at:
                continue
            ok, detail = http_probe(st.url, (self.liveness if st.answered else self.startup).timeout_s)
            if not st.answered:
                st.answered = ok
                st.next_at = time.monotonic() + (self.liveness if ok else self.startup).period_s
                continue
            now = time.monotonic()
            st.next_at = now + self.liveness.period_s
            if ok:
                st.failures, st.refused_since = 0, None
                continue
            if p.poll() is not None:  # it exited while asked: ``check`` deals with an exit
                continue
            if detail in (REFUSED, RESET):  # its server is closed: on its way out, unless it stays past the grace
                st.refused_since = now if st.refused_since is None else st.refused_since
                if now - st.refused_since < self.EXIT_GRACE_S:
                    continue
            st.failures += 1
            if self.log is not None:
                self.log.warning("liveness_probe_failed", role=name, failures=st.failures,
                                 failure_threshold=self.liveness.failure_threshold, url=st.url, detail=detail)
            if st.failures >= self.liveness.failure_threshold:
                self.killed[name] = (f"liveness probe failed {st.failures} times in a row "
                                     f"(every {self.liveness.period_s:g} s, timeout {self.liveness.timeout_s:g} s): "
                                     f"{st.url}: {detail}")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=10)

    def check(self, done_ok: set[str]) -> None:
        """Probe the children that have a health URL (``probe``), schedule a restart of each role
        that died or was killed (exit 0 of a role in ``done_ok`` is done), and start those whose
        backoff is over; raises ``ChildExited`` past the bound."""
        self.probe()
        now = time.monotonic()
        for name, p in self.procs.items():
            code = p.poll()
            killed = self.killed.get(name)
            if code is None or name in self.pending or (code == 0 and name in done_ok and killed is None):
                continue
            reason = killed or f"exited with code {code}"
            n = self.restarts.get(name, 0) + 1
            if n > self.max_restarts:
                raise ChildExited(name, code, self.log_path(name),
                                  note=f"{f'({killed}) ' if killed else ''}after {n - 1} restart(s) (--max-restarts {self.max_restarts})")
            delay = min(self.BACKOFF_MAX_S, self.BACKOFF_S * 2 ** (n - 1))
            self.restarts[name] = n
            self.pending[name] = now + delay
            self.reasons.append({"role": name, "restart": n, "reason": reason})
            if self.log is not None:
                self.log.warning("role_restarting", role=name, exit_code=code, restart=n, reason=reason,
                                 max_restarts=self.max_restarts, backoff_s=delay, log=str(self.log_path(name)))
        for name, at in list(self.pending.items()):
            if now >= at:
                del self.pending[name]
                self.killed.pop(name, None)
                cmd = self.cmds[name]
                if name == "learner" and "--resume" not in cmd:
                    cmd = cmd + ["--resume"]  # continue from the newest snapshot, not from version 0
                self.spawn(name, cmd)

    def alive(self, name: str) -> bool:
        return name in self.pending or self.procs[name].poll() is None

    def stop(self, finishing: tuple[str, ...] = (), grace_s: float = 20.0) -> None:
        """End every child: first wait up to ``grace_s`` for the ``finishing`` ones (their work
        done, they are exiting on their own: a SIGTERM would record a clean end as -15), then
        SIGTERM the rest, and SIGKILL what is left after 30 s."""
        deadline = time.monotonic() + grace_s
        for name in finishing:
            try:
                self.procs[name].wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def streams_cmd(cfg: TrainConfig, index: int) -> list[str]:
    """The Faust worker ``index`` of a local run (its own data dir; its web server, /metrics and
    /healthz, on the port ``RLSTREAM_METRICS_PORT`` gives it: ``metrics_ports``)."""
    data = cfg.run_dir / ("streams-data" if index == 0 else f"streams-data-{index}")
    return [sys.executable, "-m", "faust", "-A", "streams", "--datadir", str(data), "worker", "-l", "warn"]


#: The file-based service discovery file of a decoupled run (Prometheus ``file_sd_configs``).
TARGETS_FILE = "prometheus.targets.json"


def metrics_ports(names: list[str], host: str = "127.0.0.1") -> dict[str, int]:
    """A free port on ``host`` for each child's metrics server (many roles share one host; the
    ports are free when asked, and a child that loses one to a race logs it and runs without)."""
    import socket

    socks, ports = [], {}
    try:
        for name in names:  # all held open at once, so no two children get the same one
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
            ports[name] = s.getsockname()[1]
    finally:
        for s in socks:
            s.close()
    return ports


def write_scrape_targets(cfg: TrainConfig, ports: dict[str, int], host: str = "127.0.0.1") -> Path:
    """``<run_dir>/prometheus.targets.json``: every child's metrics endpoint with its role,
    process and run labels, for a Prometheus ``file_sd_configs`` entry (docs/decoupled.md)."""
    targets = [{"targets": [f"{host}:{port}"],
                "labels": {"role": name.split("-")[0], "process": name, "run_id": cfg.effective_run_id(),
                           "namespace": cfg.bus.namespace}}
               for name, port in sorted(ports.items())]
    return write_json_atomic(cfg.run_dir / TARGETS_FILE, targets)


#: How often the parent checks whether the learner has drained the actors' last samples.
DRAIN_CHECK_S = 1.0


def run_decoupled(cfg: TrainConfig, log: Any = None, stop: threading.Event | None = None,
                  env: Environment | None = None) -> dict[str, Any]:
    """Start the learner, ``stream_workers`` Faust workers and ``num_actors`` actors in
    ``cfg.bus.namespace``; print progress every ``log_every_s``; wait for the learner. Actors stop
    at their budget; once all have, the learner trains on what is left until it makes no more
    progress for ``drain_s``. A role that dies or fails its liveness probe is restarted (``Supervisor``) up to
    ``max_restarts`` times, then ``ChildExited`` is raised. The children get ``env`` (the entry
    point's ``Environment``; None: this process's, read now) with the run's settings on top."""
    if cfg.overlap:
        raise ValueError(OVERLAP_COLOCATED_ONLY)
    stop = stop or threading.Event()
    env = env if env is not None else Environment.read()
    RunDir(cfg.run_dir).claim(cfg.run_id, mode="decoupled", resume=cfg.resume, join=True, algo=cfg.algo,
                              env_id=cfg.env_id, namespace=cfg.bus.namespace)
    RunDir(cfg.run_dir).record_namespace(cfg.bus.namespace)
    for old in [*cfg.run_dir.glob("*.state.json"), *cfg.run_dir.glob(TIMELINE_FILE)]:
        old.unlink()  # a previous run's figures are not this run's
    clear_summaries(cfg.run_dir)
    config_path = write_config(child_config(cfg), cfg.run_dir / CONFIG_FILE)
    sup = Supervisor(child_env(cfg, config_path, env), cfg.run_dir, cfg.max_restarts, log,
                     liveness=LIVENESS_PROBE if cfg.liveness_probes else None)
    procs = sup.procs

    bus = wiring.build_bus(cfg.bus)  # create the topics before anyone subscribes; read lags from it
    actors = [f"actor-{i}" for i in range(cfg.num_actors)]
    commands = child_commands(cfg, config_path)
    monitor = RunMonitor(cfg, bus, actors, log, restarts=sup.restarts,
                         streams=[n for n in commands if n.startswith("streams")])
    drain_s = max(30.0, 3 * min(cfg.log_every_s, 60.0))  # children write their state every second
    rc, ended = None, "stopped"  # why the run ended: learner_done, drained or stopped (a signal)
    try:
        ports = metrics_ports(list(commands))
        for name, cmd in commands.items():
            health = f"http://127.0.0.1:{ports[name]}{LIVENESS_PROBE.path}"  # every child serves /healthz
            if name.startswith("streams"):  # the Faust worker takes its web port from the environment
                sup.spawn(name, cmd, env={ENV_METRICS_PORT: str(ports[name])}, health_url=health)
            else:
                sup.spawn(name, [*cmd, "--metrics-port", str(ports[name])], health_url=health)
        write_scrape_targets(cfg, ports)
        if log is not None:
            log.info("decoupled_started", processes=sorted(procs), logs=str(cfg.run_dir),
                     namespace=cfg.bus.namespace or "(legacy)", partitions=cfg.bus.partitions,
                     max_restarts=cfg.max_restarts, liveness_probes=cfg.liveness_probes)
        next_line = time.monotonic() + cfg.log_every_s
        next_check = time.monotonic() + DRAIN_CHECK_S
        drained: tuple[int, float] | None = None  # (learner updates, since) once every actor is done
        while not stop.is_set():
            if "learner" not in sup.pending and procs["learner"].poll() == 0:
                rc, ended = 0, "learner_done"
                break
            sup.check(done_ok={"learner", *actors})  # 0: the learner or an actor spent its budget
            if time.monotonic() >= next_check:  # drain checks do not wait for progress lines
                next_check = time.monotonic() + DRAIN_CHECK_S
                if time.monotonic() >= next_line:
                    next_line = time.monotonic() + cfg.log_every_s
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
                        ended = "drained"
                        break
            stop.wait(0.5)
        monitor.log_line()
    finally:
        bus.close()
        # an actor that wrote its summary has spent its budget and is on its way out
        sup.stop(finishing=tuple(n for n in actors if not stop.is_set() and summary_path(cfg.run_dir, n).exists()))
    summaries = read_summaries(cfg.run_dir, procs)
    summary = {"mode": "decoupled", "run_id": cfg.run_id, "algo": cfg.algo, "env": cfg.env_id,
               "namespace": cfg.bus.namespace, "ended": ended, "learner_exit": rc,
               **run_learning(cfg, actors, summaries),
               "processes": summaries, "restarts": dict(sup.restarts), "restart_reasons": list(sup.reasons),
               "exit_codes": {n: p.returncode for n, p in procs.items()}}
    RunDir(cfg.run_dir).write_summary(summary)
    return summary


def run_learning(cfg: TrainConfig, actors: list[str], summaries: dict[str, dict]) -> dict[str, Any]:
    """The run's learning over every actor: their episodes merged in one curve (each episode placed
    at its actor's share of the run's steps, as the actors ran side by side), its first and last
    returns, and one plot, ``<run_dir>/returns.png``."""
    merged: list[tuple[float, float]] = []
    total = sum(int(summaries.get(n, {}).get("steps") or 0) for n in actors)
    for name in actors:
        steps = int(summaries.get(name, {}).get("steps") or 0)
        try:
            curve = json.loads((cfg.run_dir / name / "curve.json").read_text())
        except (OSError, ValueError):
            continue
        for s, r in zip(curve.get("steps", []), curve.get("returns", [])):
            merged.append((total * s / steps if steps else float(s), float(r)))
    merged.sort(key=lambda p: p[0])
    progress = Progress(total_steps=max(1, total))
    progress.steps, progress.episodes = total, len(merged)
    for s, r in merged:
        progress.curve.append((int(s), r))
        progress.recent_returns.append(r)
    learned = {k: v for k, v in progress.summary().items()
               if k in ("steps", "episodes", "return_mean20", "first_returns_mean")}
    learned.update(progress.write(cfg.run_dir, cfg.plot,
                                  f"{cfg.algo} on {cfg.env_id} (decoupled, {len(actors)} actor(s))"))
    return learned
