"""The deployment guide's two example runs, as rlstream runs them, and the guide's argument for
decoupling put to the test: does decoupled AGRO (actors, a Faust worker and the learner as
processes over Kafka, importance sampling on) reach co-located PPO's return sooner in wall time
at the same step budget?

Arms, each run alone on the machine, one after another (a fair wall clock):

- ``ppo-colocated``: ``rlstream train --algo ppo --env <task> --total-steps N`` (the task's preset);
- ``agro-decoupled``: ``rlstream train --mode decoupled --algo agro --env <task> --total-steps N``
  against a broker this bench starts on a free port (or ``--bootstrap``).

Per run: a deterministic evaluation of the final PolicyVersion (10 episodes seeded 10000 + i),
wall time, samples/s, freshness and policy lag (the run's own summary and timeline), and the
timeline of training return against wall time. The table gives, per arm, the wall time at which
the training return (mean of the last 20 episodes) first reached ``--reach`` of co-located PPO's
final training return.

    python bench/guide_runs.py --env Ant-v5 --steps 2000000 --seeds 0 1 2
    python bench/guide_runs.py --env HalfCheetah-v5 --steps 1000000 --arms ppo-colocated
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.algorithms import episodes_of, policy_versions  # noqa: E402
from bench.common import mean_std, private_broker, pyplot, save_figure, write_json  # noqa: E402
from config import BusConfig, TrainConfig  # noqa: E402
from config.algos import env_preset  # noqa: E402
from streams.policies import load_policy  # noqa: E402

ARMS = ("ppo-colocated", "agro-decoupled")
LOG_EVERY_S = 15.0


def _newest_kafka_version(cfg: TrainConfig):
    from rlstream import wiring
    from streams.policy.tail import newest_version

    bus = wiring.build_bus(cfg.bus)
    try:
        return newest_version(wiring.build_events(bus), cfg.policy_id)
    finally:
        bus.close()


def run_arm(arm: str, env_id: str, steps: int, seed: int, out: Path, bootstrap: str | None, episodes: int) -> dict:
    import torch

    torch.set_num_threads(1)
    run_dir = out / f"{arm}-seed{seed}"
    common = dict(env_id=env_id, total_steps=steps, seed=seed, run_dir=run_dir, log_every_s=LOG_EVERY_S,
                  snapshot_every=0, metrics_port=-1, plot=False)
    t0 = time.perf_counter()
    if arm == "ppo-colocated":
        from rlstream.colocated import run_colocated

        cfg = TrainConfig(algo="ppo", bus=BusConfig(log_dir=str(run_dir / "log")), **common)
        summary = run_colocated(cfg)
        wall = time.perf_counter() - t0
        versions = policy_versions(run_dir / "log")
        final = versions[max(versions)]
        freshness = summary["streams"]["freshness"]
        lag = summary["streams"]["lag_versions"]
        samples = summary["steps"]
    else:
        from rlstream.decoupled import run_decoupled

        cfg = TrainConfig(mode="decoupled", algo="agro", bus=BusConfig(
            kind="kafka", bootstrap=bootstrap, namespace=f"guide-{seed}-{uuid.uuid4().hex[:6]}"), **common)
        summary = run_decoupled(cfg)
        wall = time.perf_counter() - t0
        final = _newest_kafka_version(cfg)
        procs = summary["processes"]
        streams = procs.get("streams", {})
        freshness, lag = streams.get("freshness"), streams.get("lag_versions")
        samples = sum(int(p.get("steps", 0)) for n, p in procs.items() if n.startswith("actor"))
    how = behaviour(load_policy(final), env_id, episodes, cfg.run.env_kwargs)
    ev = how.pop("returns")
    timeline = json.loads((run_dir / "timeline.json").read_text())
    return {"arm": arm, "env": env_id, "seed": seed, "steps": samples, "final_version": final.version,
            "eval": float(np.mean(ev)), "eval_std": float(np.std(ev)), "wall_s": round(wall, 1),
            "sps": round(samples / wall, 1), "freshness": freshness, "lag_versions": lag,
            "preset": cfg.preset_name(), "eval_behaviour": how,
            "timeline": [{k: e.get(k) for k in ("t_s", "steps", "return_mean20", "freshness", "policy_lag",
                                                 "policy_lag_max", "policy_latency_p99_ms")} for e in timeline]}


def behaviour(policy, env_id: str, episodes: int, env_kwargs: dict | None = None) -> dict:
    """The evaluation's returns, and how the episodes went: mean length, the share that ended in
    a fall and the mean x distance (a return under the walkers' 1,000 healthy bonus can be a
    walker that falls or one that stands still; these tell which)."""
    eps = episodes_of(policy, env_id, episodes, env_kwargs)
    dxs = [e["dx"] for e in eps if e["dx"] is not None]
    return {"returns": [e["return"] for e in eps], "length": float(np.mean([e["length"] for e in eps])),
            "fell": float(np.mean([e["fell"] for e in eps])), "dx": float(np.mean(dxs)) if dxs else None}


def time_to(run: dict, target: float) -> float | None:
    """Wall seconds until the run's training return (mean of 20) first reached ``target``."""
    return next((e["t_s"] for e in run["timeline"] if (e.get("return_mean20") or -np.inf) >= target), None)


def label(run: dict) -> str:
    """The arm, with the preset it ran with (runs of one arm under two presets are two rows)."""
    return f"{run['arm']} ({run['preset']})" if run.get("preset") else run["arm"]


def table(runs: list[dict], reach: float) -> tuple[list[dict], str, float | None]:
    """Rows per arm and preset; the time column's target is ``reach`` of the final training return
    of co-located PPO under the task's default preset today (any PPO run if none has it)."""
    ppo = [r for r in runs if r["arm"] == "ppo-colocated"]
    default = (env_preset("ppo", runs[0]["env"]) or (None,))[0] if runs else None
    ppo = [r for r in ppo if r.get("preset") == default] or ppo
    finals = [r["timeline"][-1].get("return_mean20") for r in ppo if r["timeline"]]
    finals = [f for f in finals if f is not None]
    target = reach * float(np.mean(finals)) if finals else None
    rows, lines = [], [
        "| arm | seeds | eval return | eval length / fell / x distance | wall s | samples/s | freshness "
        f"| lag (versions, mean / max) | wall s to {reach:.0%} of PPO's ({default or 'no preset'}) final return |",
        "|---|---|---|---|---|---|---|---|---|"]
    for arm in dict.fromkeys(label(r) for r in runs):
        rs = [r for r in runs if label(r) == arm]
        reached = [time_to(r, target) for r in rs] if target is not None else []
        row = {"arm": arm, "seeds": [r["seed"] for r in rs], "eval": mean_std([r["eval"] for r in rs]),
               "wall_s": mean_std([r["wall_s"] for r in rs]), "sps": mean_std([r["sps"] for r in rs]),
               "freshness": mean_std([r["freshness"] for r in rs]),
               "lag_mean": mean_std([(r["lag_versions"] or {}).get("mean") for r in rs]),
               "lag_max": max(((r["lag_versions"] or {}).get("max") or 0) for r in rs),
               "time_to_target_s": mean_std(reached), "reached": sum(x is not None for x in reached),
               "behaviour": {k: mean_std([(r.get("eval_behaviour") or {}).get(k) for r in rs])
                             for k in ("length", "fell", "dx")}}
        rows.append(row)
        tt = row["time_to_target_s"]
        tts = f"{tt['mean']:.0f} ± {tt['std']:.0f} ({row['reached']}/{len(rs)} reached)" if tt else f"never (0/{len(rs)})"
        b = row["behaviour"]
        how = " / ".join("-" if not b[k] else fmt.format(b[k]["mean"])
                         for k, fmt in (("length", "{:.0f}"), ("fell", "{:.0%}"), ("dx", "{:.1f} m")))
        lines.append(f"| {arm} | {len(rs)} | {row['eval']['mean']:.0f} ± {row['eval']['std']:.0f} | {how} "
                     f"| {row['wall_s']['mean']:.0f} | {row['sps']['mean']:.0f} | {row['freshness'].get('mean', '-')} "
                     f"| {row['lag_mean'].get('mean', '-')} / {row['lag_max']} | {tts} |")
    return rows, "\n".join(lines), target


def plot(runs: list[dict], target: float | None, path: Path) -> None:
    fig, ax = pyplot().subplots(figsize=(7, 4))
    labels = list(dict.fromkeys(label(r) for r in runs))
    colours = dict(zip(labels, ("tab:orange", "tab:blue", "tab:green", "tab:red", "tab:purple")))
    named: set[str] = set()
    for r in runs:
        pts = [(e["t_s"], e["return_mean20"]) for e in r["timeline"] if e.get("return_mean20") is not None]
        if pts:
            t, y = zip(*pts)
            name = label(r)
            ax.plot(t, y, color=colours.get(name), lw=1, alpha=0.8, label=None if name in named else name)
            named.add(name)
    if target is not None:
        ax.axhline(target, ls="--", color="k", lw=0.8, label="target")
    ax.set(xlabel="wall seconds", ylabel="training return (mean of 20 episodes)", title=runs[0]["env"])
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=80)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default="Ant-v5")
    ap.add_argument("--steps", type=int, default=2_000_000)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--reach", type=float, default=0.9, help="share of PPO's final return for the time column")
    ap.add_argument("--eval-episodes", type=int, default=10)
    ap.add_argument("--bootstrap", default=None, help="a broker to use (default: one started for the bench)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench-guide"))
    ap.add_argument("--render", action="store_true", help="only rebuild the table and plot from --out")
    a = ap.parse_args()
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not a.render:
        need_kafka = "agro-decoupled" in a.arms and a.bootstrap is None
        broker = private_broker() if need_kafka else contextlib.nullcontext(a.bootstrap)
        with broker as bootstrap:
            for seed in a.seeds:
                for arm in a.arms:
                    f = out / f"{arm}-seed{seed}.json"
                    if f.exists():
                        continue
                    r = run_arm(arm, a.env, a.steps, seed, out, bootstrap, a.eval_episodes)
                    write_json(f, r)
                    print(json.dumps({k: r[k] for k in ("arm", "seed", "eval", "wall_s", "sps", "freshness")}),
                          flush=True)
    runs = [json.loads(f.read_text()) for f in sorted(out.glob("*-seed*.json"))]
    rows, md, target = table(runs, a.reach)
    doc = {"bench": "guide_runs", "env": a.env, "steps_per_run": a.steps, "reach": a.reach, "target_return": target,
           "rows": rows, "runs": runs,
           "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "threads_per_process": 1}}
    write_json(out / "guide.json", doc)
    (out / "guide.md").write_text(md + "\n")
    plot(runs, target, out / "guide.png")
    print(md)


if __name__ == "__main__":
    main()
