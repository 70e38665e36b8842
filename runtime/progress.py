"""Progress of a training run: periodic log lines (SPS, episode return, policy lag), the
return-vs-steps curve, a final summary and an optional PNG plot. With ``state_path`` every line
is also written there as JSON (what ``rlstream train --mode decoupled`` reads from its children)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.rundir import RunDir, write_json_atomic


#: A run's progress lines over time (``Progress.record_timeline``).
TIMELINE_FILE = "timeline.json"


@dataclass
class Progress:
    total_steps: int
    log_every_s: float = 5.0
    log: Any = None  # a structlog logger (or None: print)
    steps: int = 0
    episodes: int = 0
    updates: int = 0
    version: int = 0
    recent_returns: deque = field(default_factory=lambda: deque(maxlen=20))
    curve: list[tuple[int, float]] = field(default_factory=list)
    lags: deque = field(default_factory=lambda: deque(maxlen=200))
    started: float = field(default_factory=time.perf_counter)
    extra: Callable[[], dict] | None = None
    """More fields for each line (e.g. a stalled actor's ``stalled_s``)."""
    state_path: Path | None = None
    """Write each line's fields here too (atomically), for a supervisor to read."""
    state_every_s: float = 1.0
    """The state file is written at least this often, however rarely lines are logged."""
    record_timeline: bool = False
    """Keep every logged line, with its time since the start (``t_s``); ``write`` saves them as
    ``<run_dir>/timeline.json`` (what ``rlstream validate`` plots over time)."""
    timeline: list[dict[str, Any]] = field(default_factory=list)
    _last_log: float = 0.0
    _last_state: float = 0.0
    _last_steps: int = 0
    _last_t: float = field(default_factory=time.perf_counter)

    def on_batch(self, n_steps: int, returns: list[float], policy_lag: int) -> None:
        self.steps += n_steps
        for r in returns:
            self.episodes += 1
            self.recent_returns.append(r)
            self.curve.append((self.steps, r))
        self.lags.append(policy_lag)

    def mean_return(self) -> float | None:
        return sum(self.recent_returns) / len(self.recent_returns) if self.recent_returns else None

    def sps(self) -> float:
        return self.steps / max(1e-9, time.perf_counter() - self.started)

    def maybe_log(self, force: bool = False) -> None:
        now = time.perf_counter()
        log_due = force or now - self._last_log >= self.log_every_s
        state_due = self.state_path is not None and now - self._last_state >= self.state_every_s
        if not (log_due or state_due):
            return
        recent_sps = (self.steps - self._last_steps) / max(1e-9, now - self._last_t)
        if log_due:
            self._last_log, self._last_steps, self._last_t = now, self.steps, now
        ret = self.mean_return()
        fields = {
            "steps": self.steps,
            "pct": round(100.0 * self.steps / max(1, self.total_steps), 1),
            "sps": round(recent_sps),
            "episodes": self.episodes,
            "return_mean20": None if ret is None else round(ret, 1),
            "updates": self.updates,
            "policy_version": self.version,
            "policy_lag_max": max(self.lags) if self.lags else 0,
        }
        if self.extra is not None:
            fields.update(self.extra())
        if self.state_path is not None:
            write_state(self.state_path, fields)
            self._last_state = now
        if not log_due:
            return
        if self.record_timeline:
            self.timeline.append({"t_s": round(now - self.started, 3), **fields})
        if self.log is not None:
            self.log.info("progress", **fields)
        else:
            print(json.dumps({"event": "progress", **fields}), file=sys.stderr, flush=True)

    def summary(self) -> dict[str, Any]:
        elapsed = time.perf_counter() - self.started
        ret = self.mean_return()
        return {
            "steps": self.steps,
            "episodes": self.episodes,
            "updates": self.updates,
            "final_policy_version": self.version,
            "elapsed_s": round(elapsed, 2),
            "sps": round(self.steps / max(1e-9, elapsed), 1),
            "return_mean20": None if ret is None else round(ret, 2),
            "first_returns_mean": _mean([r for _, r in self.curve[:10]]),
        }

    def write(self, run_dir: Path, plot: bool, title: str) -> dict[str, str]:
        run_dir.mkdir(parents=True, exist_ok=True)
        out = {}
        curve_path = write_json_atomic(run_dir / "curve.json", {"steps": [s for s, _ in self.curve],
                                                                "returns": [r for _, r in self.curve]}, indent=None)
        out["curve"] = str(curve_path)
        if self.timeline:
            timeline_path = write_json_atomic(run_dir / TIMELINE_FILE, self.timeline, indent=None)
            out["timeline"] = str(timeline_path)
        if plot and self.curve:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            xs = [s for s, _ in self.curve]
            ys = [r for _, r in self.curve]
            k = max(1, len(ys) // 50)
            smooth = [sum(ys[max(0, i - k): i + 1]) / len(ys[max(0, i - k): i + 1]) for i in range(len(ys))]
            fig, ax = plt.subplots(figsize=(7, 4))
            ax.plot(xs, ys, alpha=0.3, label="episode return")
            ax.plot(xs, smooth, label=f"moving mean ({k + 1})")
            ax.set_xlabel("environment steps")
            ax.set_ylabel("episode return")
            ax.set_title(title)
            ax.legend()
            fig.tight_layout()
            png = run_dir / "returns.png"
            fig.savefig(png, dpi=100)
            plt.close(fig)
            out["plot"] = str(png)
        return out


def write_state(path: Path, fields: dict[str, Any]) -> None:
    """``fields`` as JSON at ``path``, replaced atomically (a reader never sees half a file)."""
    write_json_atomic(path, {"t": time.time(), "pid": os.getpid(), **fields}, indent=None)


def read_state(path: Path) -> dict[str, Any] | None:
    """What ``write_state`` wrote (None: nothing yet)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def verdict(summary: dict[str, Any]) -> str:
    """One line: mean return of the first episodes -> of the last 20, and where the plot is.
    ``summary``: a co-located run's, or a decoupled one's (over all its actors)."""
    src = summary  # a decoupled run's summary carries its actors' merged figures (decoupled.run_learning)
    first, last = src.get("first_returns_mean"), src.get("return_mean20")
    if first is None or last is None:
        learned = "no episode finished: raise --total-steps to see learning"
    else:
        learned = f"return {first:.1f} (first episodes) -> {last:.1f} (last 20 episodes)"
    where = f"plot: {src['plot']}" if src.get("plot") else "no plot (--plot)"
    return f"verdict: {learned}; {where}"


def short_summary(summary: dict[str, Any], run_id: str, run_dir: Path) -> str:
    """What ``rlstream train`` prints before its verdict (``verdict``: returns and plot): the
    run, where its files are, steps, wall time and steps/s. The whole summary stays in
    ``<run_dir>/summary.json`` (``--json`` prints it)."""
    learner = summary.get("processes", {}).get("learner", {})  # decoupled: the learner's figures
    steps = summary.get("steps")
    wall = summary.get("elapsed_s") or learner.get("wall_s")
    updates = summary.get("updates", learner.get("updates"))
    version = summary.get("final_policy_version", learner.get("final_version"))
    what = ", ".join(str(x) for x in (f"{summary.get('algo')} on {summary.get('env')}" if summary.get("algo") else None,
                                       summary.get("mode")) if x)
    lines = [f"run {run_id}" + (f" ({what})" if what else "") + f": {run_dir}"]
    if steps is not None:
        timing = f" in {wall:.1f} s ({steps / wall:,.0f} steps/s)" if wall else ""
        trained = f", {updates} updates to policy version {version}" if updates is not None else ""
        lines.append(f"{steps:,} env steps{timing}{trained}")
    lines.append(f"summary: {RunDir(run_dir).summary_file()} (--json prints it)")
    return "\n".join(lines)


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 2) if xs else None


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
