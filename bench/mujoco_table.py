"""The MuJoCo table: co-located PPO (or AGRO, TBA) at a fixed step budget on the v5 locomotion tasks, several
seeds, each run as ``rlstream train --env <task>`` runs it (the task's preset from
``config.algos.ENV_PRESETS``, no flags), set beside the published figures of the two references
people compare with.

Each (task, seed) is one ``bench.algorithms.train_one`` run (``run_colocated``, then a
deterministic evaluation of the final PolicyVersion on 10 episodes seeded 10000 + i). Runs go to
``--jobs`` worker processes (one torch thread each); a run whose result file exists is not run
again, so an interrupted table resumes. ``--render`` only rebuilds the table and plot.

References (training return of the stochastic policy for CleanRL, a deterministic evaluation
for the zoo; both at 1M steps on the v4 / v3 tasks, which have the same dynamics and rewards as
v5 up to the contact-force terms):

- CleanRL ``ppo_continuous_action.py``, Open RL Benchmark tag ``pr-424`` (MuJoCo v4, 3 seeds),
  as printed in docs/rl-algorithms/ppo.md of vwxyzjn/cleanrl;
- RL Baselines3 Zoo ``benchmark.md`` (commit 0088472, one tuned run per task, MuJoCo v3).

``--algo agro`` (or ``tba``) runs that algorithm's rows instead, at its own run defaults (no
preset); its results sit beside PPO's in the same ``--out``, one row per (task, algorithm).

    python bench/mujoco_table.py --envs Hopper-v5 Walker2d-v5 Ant-v5 Humanoid-v5 --seeds 0 1 2
    python bench/mujoco_table.py --algo agro --envs HalfCheetah-v5 --seeds 0 1 2
    python bench/mujoco_table.py --render runs/bench-mujoco

``--append FILE --section NAME`` merges the runs of ``--out`` into section NAME of a results file
(``bench/results/mujoco_ppo_1M.json``: ``cleanrl_settings``, ``zoo_preset``, or a new section for a
trial preset), keeping the runs it already holds (a run of the same task, preset and seed is
replaced), recomputes that section's rows, and rewrites the file's ``.md`` beside it with every
section: mean ± sample std (n - 1), the 95 % t-interval of the mean, per-seed values and wall time.

    python bench/mujoco_table.py --envs Hopper-v5 --seeds 3 4 --preset none --jobs 2 --out runs/mj-cleanrl \
        --append bench/results/mujoco_ppo_1M.json --section cleanrl_settings
"""

from __future__ import annotations

import argparse
import ast
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    mean_std, pyplot, running_mean, save_figure, stop_resource_tracker, write_json)

#: task family -> (mean, std) of the published PPO figure at 1M steps; None: not published.
CLEANRL_PPO = {"HalfCheetah": (1442.64, 46.03), "Hopper": (2382.86, 271.74), "Walker2d": (2287.95, 571.78),
               "Humanoid": (716.11, 49.08), "Ant": None}
ZOO_PPO = {"HalfCheetah": (5819.10, 663.53), "Hopper": (2410.44, 10.03), "Walker2d": (3478.80, 821.71),
           "Ant": (1327.16, 451.58), "Humanoid": None}
SOURCES = {"cleanrl": "CleanRL ppo_continuous_action.py, Open RL Benchmark tag pr-424, MuJoCo v4, 1M steps, "
                      "training episodic return, 3 seeds (vwxyzjn/cleanrl docs/rl-algorithms/ppo.md)",
           "zoo": "RL Baselines3 Zoo benchmark.md @0088472, PPO, MuJoCo v3, 1M steps, deterministic evaluation "
                  "of one tuned run (std over its evaluation episodes)"}


def _one(job: tuple[str, str, int, int, str, int, str, dict, dict]) -> dict:
    algo, env_id, seed, steps, out, episodes, preset, sets, env_kwargs = job
    import torch
    torch.set_num_threads(1)
    from bench import algorithms
    from bench.algorithms import train_one
    from config import TrainConfig

    if sets:  # algorithm fields over the preset, as ``rlstream train --set`` gives them
        name, run, overrides = algorithms.CASES[algo]
        algorithms.CASES[algo] = (name, run, {**overrides, **sets})

    path = _result_file(Path(out), algo, env_id, seed)
    load_before, commit = round(os.getloadavg()[0], 2), _commit()  # the tree the run imports
    result = train_one(algo, env_id, steps, seed, path.parent, episodes, preset=preset, env_kwargs=env_kwargs)
    result.update(env=env_id, preset=TrainConfig(algo=algo, env_id=env_id, preset=preset).preset_name())
    if sets:
        result["preset"] = f"{result['preset'] or 'cleanrl'}+" + ",".join(f"{k}={v}" for k, v in sets.items())
        result["set"] = sets
    if env_kwargs:  # another env (a reward or an observation changed): its rows apart from the task's own
        result["preset"] = f"{result['preset'] or 'cleanrl'}+env:" + ",".join(f"{k}={v}" for k, v in env_kwargs.items())
    learner = path.parent / f"{algo}-seed{seed}" / "learner.summary.json"
    if learner.exists():  # which update path ran (captured or eager), and its compile time
        result["capture"] = json.loads(learner.read_text()).get("capture")
    result["loadavg_1m"] = {"start": load_before, "end": round(os.getloadavg()[0], 2)}
    result["commit"] = commit
    write_json(path, result)
    return result


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                              capture_output=True, text=True, check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def _result_file(out: Path, algo: str, env_id: str, seed: int) -> Path:
    from config.algos import env_family
    return out / env_family(env_id) / f"{algo}-seed{seed}.json"


def collect(out: Path) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted(out.glob("*/*-seed*.json"))]



def _ref(table: dict, family: str) -> str:
    v = table.get(family)
    return f"{v[0]:.0f} ± {v[1]:.0f}" if v else "-"


def render(runs: list[dict], steps: int) -> tuple[list[dict], str]:
    rows, lines = [], [
        "| task | algo | preset | seeds | eval return (deterministic) | train return (last 20) | CleanRL PPO | zoo PPO "
        "| wall s / run | SPS |", "|---|---|---|---|---|---|---|---|---|---|"]
    for env_id, algo in dict.fromkeys((r["env"], r["algo"]) for r in runs):
        rs = [r for r in runs if r["env"] == env_id and r["algo"] == algo]
        family = env_id.rpartition("-")[0]
        row = {"env": env_id, "algo": algo, "preset": rs[0].get("preset"), "seeds": sorted(r["seed"] for r in rs),
               "eval": mean_std([r["eval"] for r in rs]), "train_last20": mean_std([r["train_last20"] for r in rs]),
               "wall_s": mean_std([r["wall_s"] for r in rs]), "sps": mean_std([r["sps"] for r in rs]),
               "cleanrl": CLEANRL_PPO.get(family), "zoo": ZOO_PPO.get(family)}
        rows.append(row)
        lines.append(f"| {env_id} | {algo} | {row['preset'] or ('none (CleanRL)' if algo == 'ppo' else 'none')} | {len(rs)} | {row['eval']['mean']:.0f} ± "
                     f"{row['eval']['std']:.0f} | {row['train_last20']['mean']:.0f} ± {row['train_last20']['std']:.0f} "
                     f"| {_ref(CLEANRL_PPO, family)} | {_ref(ZOO_PPO, family)} | {row['wall_s']['mean']:.0f} "
                     f"| {row['sps']['mean']:.0f} |")
    return rows, "\n".join(lines)


#: two-sided 95 % Student t quantiles by degrees of freedom (n - 1)
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def seed_stats(xs: list[float]) -> dict:
    """Mean, sample std (n - 1), the 95 % t-interval of the mean and the values, over seeds."""
    xs = [float(x) for x in xs]
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return {"mean": round(m, 1), "std": None, "ci95": None, "n": len(xs), "values": [round(x, 1) for x in xs]}
    sd = statistics.stdev(xs)
    half = _T95.get(len(xs) - 1, 1.96) * sd / len(xs) ** 0.5
    return {"mean": round(m, 1), "std": round(sd, 1), "ci95": [round(m - half, 1), round(m + half, 1)],
            "n": len(xs), "values": [round(x, 1) for x in xs]}


def _key(r: dict) -> tuple:
    return (r["env"], r.get("algo", "ppo"), r.get("preset"), r["seed"])


def section_rows(runs: list[dict]) -> list[dict]:
    """One row per (task, algorithm, preset) of a section's runs, seeds in order."""
    rows = []
    for env_id, algo, preset in dict.fromkeys(_key(r)[:3] for r in runs):
        rs = sorted((r for r in runs if _key(r)[:3] == (env_id, algo, preset)), key=lambda r: r["seed"])
        family = env_id.rpartition("-")[0]
        rows.append({"env": env_id, "algo": algo, "preset": preset, "seeds": [r["seed"] for r in rs],
                     "eval": seed_stats([r["eval"] for r in rs]),
                     "train_last20": seed_stats([r["train_last20"] for r in rs]),
                     "wall_s": seed_stats([r["wall_s"] for r in rs]),
                     "cleanrl": CLEANRL_PPO.get(family), "zoo": ZOO_PPO.get(family)})
    return rows


def append(results: Path, section: str, runs: list[dict], note: str = "") -> dict:
    """Merge ``runs`` into ``section`` of the results file (same task, algorithm, preset and seed:
    replaced), recompute its rows, write it and its ``.md``; the document."""
    doc = json.loads(results.read_text())
    sec = doc.setdefault(section, {"runs": []})
    new = {_key(r): r for r in runs}
    sec["runs"] = [r for r in sec.get("runs", []) if _key(r) not in new] + list(new.values())
    sec["rows"] = section_rows(sec["runs"])
    doc["row_stats"] = ("rows: mean, sample std (n - 1) and 95 % t-interval of the mean over seeds, and the "
                        "per-seed values (bench/mujoco_table.py seed_stats)")
    if note:
        sec.setdefault("notes", []).append(note)
    write_json(results, doc)
    results.with_suffix(".md").write_text(render_results(doc, results.parent) + "\n")
    return doc


def _pm(st: dict) -> str:
    if st["std"] is None:
        return f"{st['mean']:,.0f}"
    return f"{st['mean']:,.0f} ± {st['std']:,.0f} [{st['ci95'][0]:,.0f}, {st['ci95'][1]:,.0f}]"


def render_results(doc: dict, results_dir: Path) -> str:
    """The MuJoCo PPO table of a results file (every section with runs, and HalfCheetah's two rows
    from the files its ``halfcheetah`` entries name): mean ± sample std [95 % interval], per seed."""
    runs = [dict(r, section=name) for name, sec in doc.items() if isinstance(sec, dict)
            for r in sec.get("runs", [])]
    for name, fname in (("cleanrl_settings", "ppo_halfcheetah_1M_3seeds.json"),
                        ("zoo_preset", "mujoco_ppo_halfcheetah_zoo_1M.json")):
        f = results_dir / fname
        if f.exists() and not any(r["env"] == "HalfCheetah-v5" and r["section"] == name for r in runs):
            for r in json.loads(f.read_text())["runs"]:
                runs.append(dict(r, env="HalfCheetah-v5", section=name, preset=r.get("preset")))
    order = ["HalfCheetah", "Hopper", "Walker2d", "Ant", "Humanoid"]
    lines = ["| task (v5) | preset | seeds | train return (last 20) | eval return (deterministic) "
             "| train per seed | eval per seed | CleanRL PPO @1M (v4, train) | zoo PPO @1M (v3, eval) | wall s / run |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    groups = dict.fromkeys((r["env"], r["section"], r.get("preset")) for r in runs)
    for env_id, section, preset in sorted(groups, key=lambda g: (order.index(g[0].rpartition("-")[0])
                                                                  if g[0].rpartition("-")[0] in order else 99,
                                                                  g[1] != "cleanrl_settings", g[1])):
        rs = sorted((r for r in runs if (r["env"], r["section"], r.get("preset")) == (env_id, section, preset)),
                    key=lambda r: r["seed"])
        family = env_id.rpartition("-")[0]
        name = preset or ("cleanrl" if section == "cleanrl_settings" else section)
        if section not in ("cleanrl_settings", "zoo_preset"):
            name = f"{name} ({section})"
        tr, ev = seed_stats([r["train_last20"] for r in rs]), seed_stats([r["eval"] for r in rs])
        lines.append(f"| {family} | {name} | {', '.join(str(r['seed']) for r in rs)} | {_pm(tr)} | {_pm(ev)} "
                     f"| {', '.join(f'{v:,.0f}' for v in tr['values'])} | {', '.join(f'{v:,.0f}' for v in ev['values'])} "
                     f"| {_ref(CLEANRL_PPO, family)} | {_ref(ZOO_PPO, family)} "
                     f"| {statistics.fmean(r['wall_s'] for r in rs):,.0f} |")
    return "\n".join(lines)


def plot(runs: list[dict], out: Path, steps: int, path: Path) -> None:
    """One panel per task: training return (mean of 20 episodes) against env steps, one line per seed, and the
    published references as dashed lines."""
    envs = list(dict.fromkeys(r["env"] for r in runs))
    fig, axes = pyplot().subplots(1, len(envs), figsize=(4 * len(envs), 3.6), squeeze=False)
    for ax, env_id in zip(axes[0], envs):
        family = env_id.rpartition("-")[0]
        for r in (r for r in runs if r["env"] == env_id):
            algo = r["algo"]
            curve = out / family / f"{algo}-seed{r['seed']}" / "curve.json"
            if curve.exists():
                c = json.loads(curve.read_text())
                k = min(20, len(c["returns"]))  # mean of the last 20 episodes, as the table's "train"
                smooth = running_mean(c["returns"], k)[k - 1:]  # full windows only
                ax.plot(c["steps"][k - 1:], smooth, lw=1, label=f"{algo} seed {r['seed']}")
        for name, table, style in (("CleanRL", CLEANRL_PPO, "--"), ("zoo", ZOO_PPO, ":")):
            if table.get(family):
                ax.axhline(table[family][0], ls=style, color="k", lw=1, label=f"{name} PPO @1M")
        ax.set(title=env_id, xlabel="env steps")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("training return (mean of 20 episodes)")
    save_figure(fig, path, dpi=80)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--envs", nargs="+", default=["Hopper-v5", "Walker2d-v5", "Ant-v5", "Humanoid-v5"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--algo", default="ppo", choices=["ppo", "agro", "tba"],
                    help="the algorithm of the rows run (the references are PPO's)")
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--eval-episodes", type=int, default=10)
    ap.add_argument("--preset", default="auto", help="auto (each task's default preset), none (CleanRL's "
                    "settings, PPO's own row), or a preset name")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an algorithm field over the preset (a Python literal: --set 'hidden=(256, 256)'); "
                         "the row's preset is named <preset>+KEY=VALUE; use its own --out")
    ap.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="a gymnasium.make keyword for every task, as `rlstream train --env-arg` (a Python "
                         "literal: --env-arg contact_cost_weight=0.0); recorded in each run's env_kwargs; use its own --out")
    ap.add_argument("--out", type=Path, default=Path("runs/bench-mujoco"))
    ap.add_argument("--render", action="store_true", help="only rebuild the table and plot from --out")
    ap.add_argument("--name", default=None, help="write <name>.json/.md/.png beside the runs (default: table)")
    ap.add_argument("--append", type=Path, default=None, help="merge the runs of --out into this results file "
                    "(module doc) and rewrite its .md")
    ap.add_argument("--section", default="cleanrl_settings", help="with --append: the section of the file")
    ap.add_argument("--note", default="", help="with --append: a note kept in the section (machine, load)")
    a = ap.parse_args()
    out = a.out.resolve()
    t0 = time.perf_counter()
    if not a.render:
        # seed-major order: every task gets its first seed before any gets its second
        sets = {k: ast.literal_eval(v) for k, _, v in (kv.partition("=") for kv in a.set)}
        env_kwargs = {k: ast.literal_eval(v) for k, _, v in (kv.partition("=") for kv in a.env_arg)}
        jobs = [(a.algo, e, s, a.steps, str(out), a.eval_episodes, a.preset, sets, env_kwargs)
                for s in a.seeds for e in a.envs
                if not _result_file(out, a.algo, e, s).exists()]
        with mp.get_context("spawn").Pool(max(1, a.jobs), maxtasksperchild=1) as pool:
            for r in pool.imap_unordered(_one, jobs):
                print(json.dumps({"env": r["env"], "seed": r["seed"], "eval": round(r["eval"], 1),
                                  "wall_s": r["wall_s"]}), flush=True)
        stop_resource_tracker()
    runs = collect(out)
    rows, md = render(runs, a.steps)
    name = a.name or "table"
    doc = {"bench": "mujoco_table", "steps_per_run": a.steps, "sources": SOURCES, "rows": rows, "runs": runs,
           "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "jobs": a.jobs, "threads": 1},
           "wall_s": round(time.perf_counter() - t0, 1)}
    write_json(out / f"{name}.json", doc)
    (out / f"{name}.md").write_text(md + "\n")
    plot(runs, out, a.steps, out / f"{name}.png")
    print(md)
    print(json.dumps({"rows": rows}))
    if a.append:
        doc = append(a.append.resolve(), a.section, runs, a.note)
        print(render_results(doc, a.append.resolve().parent))


if __name__ == "__main__":
    main()
