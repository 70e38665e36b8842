"""What the learner node's sample cache (``--replay``, ``learner/replay.py``) does to learning:
AGRO (or TBA) on HalfCheetah-v5, co-located, replay off vs on, a few seeds each; return per
environment step and per second (wall and CPU). Writes a JSON to bench/results/ and a plot to
docs/. Not a test: minutes of CPU per run.

    nice -n 5 python bench/replay.py --steps 300000 --seeds 0 1 2 \\
        --out bench/results/replay_agro_halfcheetah.json --plot docs/replay_agro_halfcheetah.png

With ``--jobs 2`` each seed's two arms run side by side (same contention for both).
Both arms use the same fragments (``--fragment-steps``, so that they fit the cache) and batch;
the "on" arm adds replay with ``--capacity``/``--spi``/``--max-reuse``. Each run is one process
with single-threaded torch; on a shared machine wall time is noisy, CPU time
(``time.process_time``) less so: both are recorded per progress line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench.common

from bench.common import binned_mean, pyplot, save_figure, stop_resource_tracker  # noqa: E402
from config import BusConfig, TrainConfig  # noqa: E402
from rlstream.colocated import run_colocated  # noqa: E402


class Quiet:
    """A log that keeps warnings and errors, and notes each progress line's steps and return
    with the wall and CPU seconds since the run began."""

    def __init__(self) -> None:
        self.w0, self.c0 = time.perf_counter(), time.process_time()
        self.lines: list[dict] = []

    def info(self, event: str, **k) -> None:
        if event == "progress":
            self.lines.append({"wall_s": round(time.perf_counter() - self.w0, 2),
                               "cpu_s": round(time.process_time() - self.c0, 2),
                               "steps": k.get("steps"), "return_mean20": k.get("return_mean20")})

    def warning(self, event: str, **k) -> None:
        print(json.dumps({"warning": event, **{x: str(y) for x, y in k.items()}}))

    error = warning


def one(args: argparse.Namespace, seed: int, replay: bool) -> dict:
    run_dir = Path(args.runs) / f"{args.algo}-{'on' if replay else 'off'}-s{seed}-{int(time.time())}"
    cfg = TrainConfig(algo=args.algo, env_id=args.env, total_steps=args.steps, seed=seed, run_dir=run_dir,
                      fragment_steps=args.fragment_steps, plot=False, log_every_s=args.log_every,
                      snapshot_every=0, replay=replay, replay_capacity=args.capacity,
                      replay_samples_per_insert=args.spi, replay_max_reuse=args.max_reuse,
                      bus=BusConfig(log_dir=str(run_dir / "log")))
    torch.set_num_threads(1)
    log = Quiet()
    summary = run_colocated(cfg, log=log)
    wall, cpu = time.perf_counter() - log.w0, time.process_time() - log.c0
    curve = json.loads((run_dir / "curve.json").read_text())
    learner = json.loads((run_dir / "learner.summary.json").read_text()) if (run_dir / "learner.summary.json").exists() else {}
    rets = np.asarray(curve["returns"], float)
    return {"seed": seed, "replay": replay, "steps": summary["steps"], "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
            "final_return_last20": round(float(rets[-20:].mean()), 1) if rets.size else None,
            "curve": curve, "timeline": log.lines,
            "replay_stats": learner.get("replay"), "updates": learner.get("updates")}


def plot(result: dict, path: Path) -> None:
    fig, axes = pyplot().subplots(1, 3, figsize=(16, 4.2))
    edges = np.linspace(0, result["steps"], 21)
    for arm, colour in (("off", "tab:blue"), ("on", "tab:red")):
        runs = [r for r in result["runs"] if r["replay"] == (arm == "on")]
        curves = np.array([binned_mean(np.asarray(r["curve"]["steps"]), np.asarray(r["curve"]["returns"], float), edges)
                           for r in runs])
        x = (edges[1:] + edges[:-1]) / 2
        mean = np.nanmean(curves, axis=0)
        axes[0].plot(x, mean, color=colour, label=f"replay {arm} (mean of {len(runs)} seeds)")
        axes[0].fill_between(x, np.nanmin(curves, axis=0), np.nanmax(curves, axis=0), color=colour, alpha=0.2)
        for r in runs:
            tl = [p for p in r["timeline"] if p["return_mean20"] is not None]
            for ax, key in ((axes[1], "wall_s"), (axes[2], "cpu_s")):
                ax.plot([p[key] for p in tl], [p["return_mean20"] for p in tl], color=colour, alpha=0.7,
                        label=f"replay {arm} (one line per seed)" if r is runs[0] else None)
    axes[0].set(xlabel="environment steps", ylabel="episode return (binned; band: min..max over seeds)",
                title="return per environment step")
    axes[1].set(xlabel="wall seconds (2 cores shared with other jobs)", ylabel="return (mean of last 20 episodes)",
                title="return per wall-second")
    axes[2].set(xlabel="CPU seconds of the run's process", ylabel="return (mean of last 20 episodes)",
                title="return per CPU-second")
    for a in axes:
        a.grid(alpha=0.3)
        a.legend()
    s = result["settings"]
    fig.suptitle(f"{s['algo'].upper()} on {s['env']}, co-located: sample cache off vs on "
                 f"(capacity {s['capacity']}, SPI {s['spi']}, max reuse {s['max_reuse']})")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path, dpi=110)


def at_equal_compute(runs: list[dict]) -> dict:
    """Each replay-on run's return (mean of the last 20 episodes) at the wall and CPU seconds the
    replay-off run of its seed took in all: the comparison per second rather than per step."""
    out = {}
    for on in (r for r in runs if r["replay"]):
        off = next(r for r in runs if not r["replay"] and r["seed"] == on["seed"])
        tl = [p for p in on["timeline"] if p["return_mean20"] is not None]
        row = {"off_final": off["final_return_last20"]}
        for key in ("wall_s", "cpu_s"):
            seen = [p for p in tl if p[key] <= off[key]]
            row[f"on_at_off_{key}"] = seen[-1]["return_mean20"] if seen else None
            row[f"on_steps_at_off_{key}"] = seen[-1]["steps"] if seen else None
        out[str(on["seed"])] = row
    return out


def stats(xs: list[float]) -> dict:
    a = np.asarray([x for x in xs if x is not None], float)
    return {"mean": round(float(a.mean()), 1), "std": round(float(a.std()), 1), "values": [round(float(x), 1) for x in a]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--algo", default="agro", choices=("agro", "tba"))
    ap.add_argument("--env", default="HalfCheetah-v5")
    ap.add_argument("--steps", type=int, default=300_000)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--fragment-steps", type=int, default=256)
    ap.add_argument("--capacity", type=int, default=4096)
    ap.add_argument("--spi", type=float, default=2.0)
    ap.add_argument("--max-reuse", type=int, default=2)
    ap.add_argument("--log-every", type=float, default=2.0)
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (2: each seed's off and on arms side by side)")
    ap.add_argument("--runs", default="runs/bench-replay")
    ap.add_argument("--out", type=Path, default=Path("bench/results/replay_agro_halfcheetah.json"))
    ap.add_argument("--plot", type=Path, default=Path("docs/replay_agro_halfcheetah.png"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    todo = [(seed, replay) for seed in args.seeds for replay in (False, True)]
    runs = []
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for r in pool.map(one, [args] * len(todo), *zip(*todo)):
            print(json.dumps({k: v for k, v in r.items() if k not in ("curve", "timeline")}), flush=True)
            runs.append(r)
    stop_resource_tracker()
    arms = {}
    for arm in ("off", "on"):
        rs = [r for r in runs if r["replay"] == (arm == "on")]
        finals = [r["final_return_last20"] for r in rs]
        arms[arm] = {"final_return_last20": stats(finals), "wall_s": stats([r["wall_s"] for r in rs]),
                     "cpu_s": stats([r["cpu_s"] for r in rs]),
                     "return_per_1k_steps_final": round(float(np.mean(finals)) / (args.steps / 1000), 3),
                     "sps_wall": stats([r["steps"] / r["wall_s"] for r in rs]),
                     "sps_cpu": stats([r["steps"] / r["cpu_s"] for r in rs])}
    result = {"bench": "replay", "steps": args.steps, "seeds": args.seeds,
              "settings": {"algo": args.algo, "env": args.env, "fragment_steps": args.fragment_steps,
                           "train_batch_size": TrainConfig(algo=args.algo).train_batch_size,
                           "capacity": args.capacity, "spi": args.spi, "max_reuse": args.max_reuse,
                           "torch_threads": 1, "host": "2 shared CPU cores, no GPU"},
              "arms": arms, "at_equal_compute": at_equal_compute(runs), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.plot)
    print(json.dumps({"arms": arms, "at_equal_compute": result["at_equal_compute"], "out": str(args.out),
                      "plot": str(args.plot)}, indent=1))


if __name__ == "__main__":
    main()
