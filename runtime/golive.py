"""The deployment guide's go-live check over a finished run's directory (``rlstream validate RUN``).

Each metric of the run's mode, with the guide's threshold, the measured value and where it was
read; a figure the run did not record is ``absent`` (said, not guessed)::

    report = golive.check(Path("runs/latest"))     # RunUnusable: not a run directory
    print(golive.render(report))

Where the figures live:

Policy latency is the guide's: from the learner publishing a version to an actor that was acting
with an older one using it. An actor's first adoption (of whichever version is newest when it
starts, however long ago that was published) ends its start-up; the summaries keep it apart
(``startup_adoption_ms``) and the row's note shows it.

* co-located (``summary.json``): ``policy_latency_ms.p99``, ``gpu``, ``sps``, ``streams.freshness``;
* decoupled: ``actor-<i>.summary.json`` (``policy_latency_ms``: the worst actor's p99),
  ``learner.summary.json`` (``gpu``; throughput = ``samples_trained / wall_s``), and
  ``streams*.summary.json`` (freshness over all workers' checked samples); the state files
  (``*.state.json``) only when a role wrote no summary (a run stopped early).

``timeline.json`` (one line per progress line, with the window's ``policy_latency_p99_ms`` and
``freshness``: a co-located run's from its ``Progress``, a decoupled run's from its supervisor,
``rlstream.monitor.RunMonitor``, over the children's state files) is plotted over time when it
holds latency or freshness; no run's figures over time are made up where it does not.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from runtime.progress import TIMELINE_FILE
from runtime.rundir import STATE_SUFFIX, SUMMARY_FILE, SUMMARY_SUFFIX, RunDir

#: metric -> mode -> (kind, bound(s)). ``max``: value < bound; ``min``: value >= bound;
#: ``above``: value > bound; ``range``: lo <= value <= hi. Percentages are 0..100.
THRESHOLDS: dict[str, dict[str, tuple[str, tuple[float, ...]]]] = {
    "policy_latency_p99_ms": {"colocated": ("max", (10.0,)), "decoupled": ("max", (100.0,))},
    "gpu_utilization_pct": {"colocated": ("range", (60.0, 80.0)), "decoupled": ("range", (85.0, 95.0))},
    "throughput_sps": {"colocated": ("min", (5000.0,)), "decoupled": ("min", (12000.0,))},
    "freshness_pct": {"colocated": ("above", (95.0,)), "decoupled": ("above", (70.0,))},
}
LABELS = {"policy_latency_p99_ms": ("policy latency p99", "ms"),
          "gpu_utilization_pct": ("GPU utilisation", "%"),
          "throughput_sps": ("throughput", "samples/s"),
          "freshness_pct": ("sample freshness", "%")}
PASS, FAIL, ABSENT = "pass", "fail", "absent"
PLOT_FILE = "golive.png"


class RunUnusable(Exception):
    """The directory is not a run ``rlstream validate`` can read (missing, or no summary)."""


@dataclass
class Row:
    metric: str
    label: str
    value: float | str | None
    unit: str
    threshold: str
    status: str
    source: str
    note: str = ""


def threshold_text(kind: str, bounds: tuple[float, ...], unit: str) -> str:
    if kind == "range":
        return f"{bounds[0]:g}-{bounds[1]:g} {unit}"
    sign = {"max": "<", "min": ">=", "above": ">"}[kind]
    return f"{sign} {bounds[0]:g} {unit}"


def judge(kind: str, bounds: tuple[float, ...], value: float) -> bool:
    if kind == "max":
        return value < bounds[0]
    if kind == "min":
        return value >= bounds[0]
    if kind == "above":
        return value > bounds[0]
    return bounds[0] <= value <= bounds[1]


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise RunUnusable(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise RunUnusable(f"{path}: not a JSON object")
    return data


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _gpu(block: Any, source: str) -> tuple[float | str | None, str, str]:
    """(value, source, note) of a role's ``gpu`` summary block."""
    if not isinstance(block, dict):
        return None, source, "the run recorded no GPU figure (a run from before GPU summaries)"
    if block.get("status") != "ok":
        return "no GPU", f"{source} gpu.status", str(block.get("reason", ""))
    mean = _num(block.get("utilization_pct_mean"))
    if mean is None:
        return None, f"{source} gpu", "a GPU, but no utilisation sample was taken"
    return mean, f"{source} gpu.utilization_pct_mean", f"{block.get('samples', 0)} samples"


def _startup(ms: Any) -> str:
    """The note on the actors' first adoptions, which end their start-up and are not policy latency."""
    return "" if _num(ms) is None else f"; start-up adoption {ms:g} ms apart, not counted"


def colocated_figures(run: Path, summary: dict[str, Any]) -> dict[str, tuple[Any, str, str]]:
    lat = summary.get("policy_latency_ms") or {}
    p99 = _num(lat.get("p99"))
    streams = summary.get("streams") or {}
    fresh = _num(streams.get("freshness"))
    checked = streams.get("checked_samples")
    return {
        "policy_latency_p99_ms": (p99, f"{SUMMARY_FILE} policy_latency_ms.p99",
                                  f"{lat.get('count', 0)} adoptions{_startup(summary.get('startup_adoption_ms'))}"
                                  if p99 is not None else
                                  "no policy latency recorded (no version adopted, or a run from before it was)"),
        "gpu_utilization_pct": _gpu(summary.get("gpu"), SUMMARY_FILE),
        "throughput_sps": (_num(summary.get("sps")), f"{SUMMARY_FILE} sps", "env steps / run wall time"),
        "freshness_pct": (None if fresh is None or checked == 0 else 100.0 * fresh, f"{SUMMARY_FILE} streams.freshness",
                          "" if fresh is not None and checked != 0 else "no sample was checked for staleness"),
    }


def _roles(run: Path, prefix: str) -> dict[str, dict[str, Any]]:
    """Role -> summary, of the roles whose name starts with ``prefix``."""
    out = {}
    for path in RunDir(run).summary_files(prefix):
        data = _read(path)
        if data is not None:
            out[path.name[: -len(SUMMARY_SUFFIX)]] = data
    return out


def decoupled_figures(run: Path) -> dict[str, tuple[Any, str, str]]:
    rd = RunDir(run)
    actors = _roles(run, "actor-")
    learner = _read(rd.summary_file("learner"))
    learner_summary = rd.summary_file("learner").name
    streams = _roles(run, "streams")
    out: dict[str, tuple[Any, str, str]] = {}

    p99s = {n: _num((s.get("policy_latency_ms") or {}).get("p99")) for n, s in actors.items()}
    p99s = {n: v for n, v in p99s.items() if v is not None}
    if p99s:
        worst = max(p99s, key=p99s.__getitem__)
        startups = [v for s in actors.values() if (v := _num(s.get("startup_adoption_ms"))) is not None]
        out["policy_latency_p99_ms"] = (p99s[worst], f"{worst}{SUMMARY_SUFFIX} policy_latency_ms.p99",
                                        f"worst of {len(p99s)} actor(s), "
                                        f"{(actors[worst].get('policy_latency_ms') or {}).get('count', 0)} adoptions"
                                        f"{_startup(max(startups) if startups else None)}")
    else:
        out["policy_latency_p99_ms"] = (None, f"actor-*{SUMMARY_SUFFIX}", "no actor recorded a policy latency")

    if learner is not None:
        out["gpu_utilization_pct"] = _gpu(learner.get("gpu"), learner_summary)
        trained, wall = _num(learner.get("samples_trained")), _num(learner.get("wall_s"))
        out["throughput_sps"] = ((trained / wall if trained is not None and wall else None),
                                 f"{learner_summary} samples_trained / wall_s", "samples trained per learner second")
    else:
        state = _read(rd.state_file("learner"))
        note = "the learner wrote no summary" + (f" (its last state: {state.get('steps')} samples)" if state else "")
        out["gpu_utilization_pct"] = (None, learner_summary, note)
        out["throughput_sps"] = (None, learner_summary, note)

    fresh = checked = 0.0
    weighted = total = 0.0
    for s in streams.values():
        if _num(s.get("checked_samples")) is not None and _num(s.get("fresh_samples")) is not None:
            fresh += s["fresh_samples"]
            checked += s["checked_samples"]
        elif _num(s.get("freshness")) is not None and _num(s.get("received_samples")):
            weighted += s["freshness"] * s["received_samples"]
            total += s["received_samples"]
    names = ", ".join(f"{n}{SUMMARY_SUFFIX}" for n in streams) or f"streams*{SUMMARY_SUFFIX}"
    if checked or total:
        value = 100.0 * (fresh + weighted) / (checked + total)
        out["freshness_pct"] = (value, f"{names} fresh/checked samples", f"{len(streams)} worker(s)")
    else:
        out["freshness_pct"] = (None, names, "no stream worker recorded a checked sample")
    return out


def detect_mode(run: Path) -> tuple[str, dict[str, Any] | None]:
    """(mode, the run's summary.json or None); ``RunUnusable`` when neither mode's files exist."""
    if not run.is_dir():
        raise RunUnusable(f"{run}: no such run directory")
    rd = RunDir(run)
    summary = _read(rd.summary_file())
    if summary is not None and summary.get("mode") in THRESHOLDS["throughput_sps"]:
        return summary["mode"], summary
    config = _read(rd.config_file())
    if (config or {}).get("mode") == "decoupled" or rd.summary_files() or rd.state_files():
        return "decoupled", summary
    if summary is not None:
        raise RunUnusable(f"{run}/{SUMMARY_FILE} names no mode (colocated or decoupled)")
    raise RunUnusable(f"{run}: no {SUMMARY_FILE}, *{SUMMARY_SUFFIX} or *{STATE_SUFFIX}: not a run directory, "
                      "or the run has not written its figures yet")


def check(run: Path, plot: bool = True) -> dict[str, Any]:
    """The go-live report of the run in ``run`` (see the module docstring)."""
    run = Path(run)
    mode, summary = detect_mode(run)
    figures = colocated_figures(run, summary) if mode == "colocated" and summary else decoupled_figures(run)
    rows = []
    for metric, (value, source, note) in figures.items():
        kind, bounds = THRESHOLDS[metric][mode]
        label, unit = LABELS[metric]
        if isinstance(value, (int, float)):
            status = PASS if judge(kind, bounds, float(value)) else FAIL
            value = round(float(value), 3)
        else:
            status = ABSENT
        rows.append(Row(metric, label, value, unit, threshold_text(kind, bounds, unit), status, source, note))
    report: dict[str, Any] = {"run": str(run), "mode": mode, "rows": [asdict(r) for r in rows]}
    report.update(plot_timeline(run, mode) if plot else {"plot": None, "plot_note": "not asked for"})
    return report


def failed(report: dict[str, Any]) -> list[str]:
    """The metrics of ``report`` that failed their threshold (absent ones are not failures:
    ``rlstream validate`` exits 1 on a failure, to gate a pipeline)."""
    return [r["metric"] for r in report["rows"] if r["status"] == FAIL]


def plot_timeline(run: Path, mode: str) -> dict[str, Any]:
    """Latency and freshness over time from the run's ``timeline.json``, as ``<run>/golive.png``."""
    lines = _read_list(run / TIMELINE_FILE)
    series = {k: [(ln["t_s"], ln[k]) for ln in lines if _num(ln.get("t_s")) is not None and _num(ln.get(k)) is not None]
              for k in ("policy_latency_p99_ms", "freshness")}
    if not any(series.values()):
        why = "no timeline.json" if not lines else "timeline.json holds no latency or freshness"
        return {"plot": None, "plot_note": f"no figures over time in this run ({why}); nothing plotted"}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    for ax, key, bound, ylabel in (
            (axes[0], "policy_latency_p99_ms", THRESHOLDS["policy_latency_p99_ms"][mode][1][0], "policy latency p99 (ms)"),
            (axes[1], "freshness", THRESHOLDS["freshness_pct"][mode][1][0] / 100.0, "sample freshness")):
        pts = series[key]
        if pts:
            ax.plot([t for t, _ in pts], [v for _, v in pts], marker=".")
        else:
            ax.text(0.5, 0.5, "not recorded", transform=ax.transAxes, ha="center")
        ax.axhline(bound, color="red", linestyle="--", label="go-live threshold")
        ax.set_ylabel(ylabel)
        ax.legend(loc="best")
    axes[1].set_xlabel("seconds since the start (one point per progress line)")
    axes[0].set_title(f"go-live figures over time: {run.name} ({mode})")
    fig.tight_layout()
    out = run / PLOT_FILE
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return {"plot": str(out), "plot_note": f"{sum(map(len, series.values()))} points from {TIMELINE_FILE}"}


def _read_list(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [x for x in data if isinstance(x, dict)] if isinstance(data, list) else []


def render(report: dict[str, Any]) -> str:
    """The report as a table, one line per metric, then the plot's path or why there is none."""
    head = ("metric", "measured", "threshold", "result", "source")
    rows = []
    for r in report["rows"]:
        value = r["value"]
        shown = "-" if value is None else (value if isinstance(value, str) else f"{value:g} {r['unit']}")
        rows.append((r["label"], shown, r["threshold"], r["status"].upper(), r["source"]
                     + (f" ({r['note']})" if r["note"] else "")))
    widths = [max(len(str(x[i])) for x in [head, *rows]) for i in range(4)]
    lines = [f"go-live check: {report['run']} ({report['mode']})"]
    for row in [head, *rows]:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4])
    failed = sum(r["status"] == FAIL for r in report["rows"])
    absent = sum(r["status"] == ABSENT for r in report["rows"])
    lines.append(f"{len(report['rows']) - failed - absent} pass, {failed} fail, {absent} absent")
    lines.append(f"plot: {report['plot']}" if report.get("plot") else f"plot: none: {report.get('plot_note')}")
    return "\n".join(lines)
