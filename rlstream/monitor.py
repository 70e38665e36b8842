"""What the parent of a decoupled run reports: progress lines and ``timeline.json`` from the
children's state files and the groups' lags (``RunMonitor``), the metrics ports and scrape
targets of the children, and the run's learning over every actor (``run_learning``)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from config import TrainConfig
from runtime.progress import TIMELINE_FILE, Progress, quantiles_ms, read_state
from runtime.rundir import RunDir, write_json_atomic
from streams.topics import SAMPLES_PREPARED, SAMPLES_RAW, STREAMS_GROUP


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
            st = read_state(RunDir(self.cfg.run.run_dir).state_file(name)) or {}
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
        states = {n: read_state(RunDir(self.cfg.run.run_dir).state_file(n)) or {} for n in self.actors}
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
            "pct": round(100.0 * steps / max(1, self.cfg.run.total_steps), 1),
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
        return read_state(RunDir(self.cfg.run.run_dir).state_file("learner")) or {}

    def learner_updates(self) -> int:
        """The learner's update count from its state file (no broker call)."""
        return int(self._learner_state().get("updates", 0))

    def log_line(self) -> dict[str, Any]:
        fields = self.fields()
        self.timeline.append({"t_s": round(time.perf_counter() - self.started, 3), **fields})
        write_json_atomic(self.cfg.run.run_dir / TIMELINE_FILE, self.timeline, indent=None)
        if self.log is not None:
            self.log.info("progress", **fields)
            if fields["stalled"]:
                self.log.warning("run_stalled", actors=fields["stalled"], updates=fields["updates"],
                                 note="actors wait: the learner's policy version has not advanced")
        else:
            print(json.dumps({"event": "progress", **fields}), file=sys.stderr, flush=True)
        return fields


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
    process and run labels, for a Prometheus ``file_sd_configs`` entry (docs/howto/operate.md)."""
    targets = [{"targets": [f"{host}:{port}"],
                "labels": {"role": name.split("-")[0], "process": name, "run_id": cfg.effective_run_id(),
                           "namespace": cfg.bus.namespace}}
               for name, port in sorted(ports.items())]
    return write_json_atomic(cfg.run.run_dir / TARGETS_FILE, targets)


def run_learning(cfg: TrainConfig, actors: list[str], summaries: dict[str, dict]) -> dict[str, Any]:
    """The run's learning over every actor: their episodes merged in one curve (each episode placed
    at its actor's share of the run's steps, as the actors ran side by side), its first and last
    returns, and one plot, ``<run_dir>/returns.png``."""
    merged: list[tuple[float, float]] = []
    total = sum(int(summaries.get(n, {}).get("steps") or 0) for n in actors)
    for name in actors:
        steps = int(summaries.get(name, {}).get("steps") or 0)
        try:
            curve = json.loads((cfg.run.run_dir / name / "curve.json").read_text())
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
    learned.update(progress.write(cfg.run.run_dir, cfg.run.plot,
                                  f"{cfg.run.algo} on {cfg.run.env_id} (decoupled, {len(actors)} actor(s))"))
    return learned
