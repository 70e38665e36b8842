"""Learning check: does co-located PPO still learn as well as the stored reference?

Trains a few seeds at a short budget (``rlstream train --mode colocated``, one torch thread each,
``--preset none`` (the algorithm's row) unless ``--preset`` names another, as its reference was
recorded) and compares the mean over seeds of each run's ``return_mean20`` (the
mean return of its last 20 training episodes, from ``<run>/summary.json``) with the reference
band stored in ``bench/results/learning_check_<algo>_<env>.json``. It prints one JSON document
with ``"pass": true|false`` and exits 1 when the mean falls below the band, so a drop like issue
29's (a sampling or update change that learns worse at equal steps) shows before it ships.

    nice -n 5 python bench/learning_check.py                 # 3 seeds x 150k, ~10 min on 2 cores
    python bench/learning_check.py --runs runs/a runs/b ...  # judge finished runs, no training
    python bench/learning_check.py --record --seeds 1 2 3 4 5 --note "main abc1234"  # new reference
    python bench/learning_check.py --steps 300000 --compile-update false --out runs/lc-eager  # eager update
    python bench/learning_check.py --env Ant-v5 --preset auto --steps 1000000   # the task's default preset

A reference is per algorithm, env and preset (``learning_check_<algo>_<env>[_<preset>].json``;
none has no suffix): a preset changes hyperparameters and, for Ant, the observation
(``env_kwargs``), so its returns are not comparable with another preset's.

The band: single seeds of HalfCheetah scatter by a few hundred, so the check compares means.
With ``n`` checked seeds and the reference's ``n_ref`` seeds (mean ``m``, std ``s``), the
difference of the two means has std ``s * sqrt(1/n + 1/n_ref)``; the band's ``low`` is ``m``
minus ``z`` (2.0) of those, computed for the default ``n`` when the reference is recorded. A
mean below ``low`` fails; one above ``high`` passes and says the reference may be re-recorded.
Runs with another seed count, budget, env or algorithm are judged against a band recomputed for
them from the stored per-seed returns (``band.recomputed``). Not a test: CI does not run it (its
comparison logic has a smoke test, ``tests/algorithms/test_learning_check.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import write_json  # noqa: E402
from config.env import Environment  # noqa: E402
Z = 2.0
DEFAULT_SEEDS = (1, 2, 3)
DEFAULT_STEPS = 150_000


def reference_path(algo: str, env: str, preset: str = "none") -> Path:
    suffix = "" if preset == "none" else f"_{preset}"
    return ROOT / "bench" / "results" / f"learning_check_{algo}_{env.lower().replace('-', '_')}{suffix}.json"


def what_runs(algo: str, env: str, preset: str) -> dict:
    """What ``--preset`` makes a run of ``algo`` on ``env`` apply: the summary's ``preset`` and
    ``env_kwargs`` fields, as ``rlstream train`` records them."""
    from config import TrainConfig

    cfg = TrainConfig(algo=algo, env_id=env, preset=preset)
    return {"preset": cfg.preset_name(), "env_kwargs": dict(cfg.run.env_kwargs)}


def _mean_std(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    s = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, s


def band_for(ref_returns: list[float], n: int, z: float = Z) -> dict:
    """``{low, high}`` for the mean of ``n`` seeds against the reference's per-seed returns."""
    if len(ref_returns) < 2 or n < 1:
        raise ValueError("a band needs at least 2 reference seeds and 1 checked seed")
    m, s = _mean_std(ref_returns)
    half = z * s * math.sqrt(1.0 / n + 1.0 / len(ref_returns))
    return {"low": round(m - half, 1), "high": round(m + half, 1), "z": z, "n_seeds": n}


def judge(returns: dict[str, float], reference: dict, steps: int, env: str, algo: str, preset: str = "none") -> dict:
    """The verdict for per-seed ``returns`` (seed -> return_mean20) against ``reference``.

    Uses the stored band when the seed count, budget, env and algorithm match the reference's;
    otherwise a band recomputed from the stored per-seed returns (and says so). A budget, env or
    algorithm other than the reference's cannot be judged (ValueError): returns at other
    budgets are not comparable."""
    if not returns:
        raise ValueError("no runs to judge")
    ref = reference["reference"]
    for key, have in (("steps", steps), ("env", env), ("algo", algo), ("preset", preset)):
        recorded = ref.get(key, "none" if key == "preset" else None)  # references before presets: none
        if recorded != have:
            raise ValueError(f"the reference is for {key}={recorded!r}, these runs have {have!r}")
    vals = [float(v) for v in returns.values()]
    if not all(math.isfinite(v) for v in vals):
        raise ValueError(f"non-finite return in {returns}")
    mean, std = _mean_std(vals)
    ref_vals = [float(v) for v in ref["returns"].values()]
    band = dict(reference["band"])
    if band.get("n_seeds") != len(vals):
        band = {**band_for(ref_vals, len(vals), band.get("z", Z)), "recomputed": True}
    ref_mean, ref_std = _mean_std(ref_vals)
    below, above = mean < band["low"], mean > band["high"]
    out = {
        "bench": "learning_check", "algo": algo, "env": env, "steps": steps, "preset": preset,
        "returns": {k: round(float(v), 1) for k, v in returns.items()},
        "mean": round(mean, 1), "std": round(std, 1),
        "reference": {"mean": round(ref_mean, 1), "std": round(ref_std, 1), "n_seeds": len(ref_vals),
                      "source": ref.get("source", "")},
        "band": band,
        "diff_vs_reference": round(mean - ref_mean, 1),
        "pass": not below,
        "verdict": ("below the reference band: learning got worse" if below else
                    "above the band: better than the reference (re-record it with --record)" if above else
                    "within the reference band"),
    }
    return out


def run_seed(seed: int, steps: int, env: str, algo: str, out: Path, compile_update: str = "auto",
             preset: str = "none") -> float:
    """Train one seed co-located with one torch thread; its ``return_mean20``. ``compile_update``:
    auto (the run's own rule), true (the captured update) or false (eager)."""
    run_dir = out / (f"{algo}-{env}-{steps}-seed{seed}" if preset == "none" else f"{algo}-{env}-{preset}-{steps}-seed{seed}")
    cmd = [sys.executable, "-m", "rlstream.cli", "train", "--mode", "colocated", "--algo", algo, "--env", env,
           "--total-steps", str(steps), "--seed", str(seed), "--deploy.torch-threads", "1", "--run-dir", str(run_dir),
           "--preset", preset,  # as the reference band was recorded
           "--metrics-port", "-1", "--no-plot", "--tensorboard", "off", "--log-every", "60"]
    if compile_update != "auto":
        cmd += ["--learner.compile-update", "True" if compile_update == "true" else "False"]
    env_vars = Environment.read().child({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    log = out / f"{run_dir.name}.log"
    with open(log, "w") as f:
        p = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env_vars)
    if p.returncode != 0:
        raise RuntimeError(f"seed {seed} failed (exit {p.returncode}); see {log}")
    return read_run(run_dir)[1]


def read_run(run_dir: Path) -> tuple[dict, float]:
    """``(summary, return_mean20)`` of a finished run directory."""
    path = Path(run_dir) / "summary.json"
    if not path.exists():
        raise ValueError(f"{run_dir}: no summary.json (not a finished run)")
    summary = json.loads(path.read_text())
    return summary, float(summary["return_mean20"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--algo", default="ppo")
    ap.add_argument("--env", default="HalfCheetah-v5")
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    ap.add_argument("--preset", default="none", help="the runs' --preset (none: the algorithm's row; auto: the "
                    "task's default); each preset has its own reference")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS))
    ap.add_argument("--jobs", type=int, default=2, help="trainings at a time")
    ap.add_argument("--compile-update", choices=["auto", "true", "false"], default="auto",
                    help="the update path trained: auto (the run's rule), true (captured) or false (eager)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "learning-check")
    ap.add_argument("--runs", type=Path, nargs="+", help="judge these finished run directories instead of training")
    ap.add_argument("--reference", type=Path, help="default: bench/results/learning_check_<algo>_<env>.json")
    ap.add_argument("--record", action="store_true", help="write these runs' returns as the new reference")
    ap.add_argument("--note", default="", help="with --record: where the reference comes from (commit)")
    args = ap.parse_args(argv)
    ref_path = args.reference or reference_path(args.algo, args.env, args.preset)
    applied = what_runs(args.algo, args.env, args.preset)
    t0 = time.perf_counter()
    if args.runs:
        returns = {}
        for d in args.runs:
            summary, r = read_run(d)
            returns[d.name] = r
            if summary.get("algo") != args.algo or summary.get("env") != args.env:
                raise SystemExit(f"{d}: {summary.get('algo')} on {summary.get('env')}, not {args.algo} on {args.env}")
            ran = {"preset": summary.get("preset"), "env_kwargs": summary.get("env_kwargs") or {}}
            if ran != applied:
                raise SystemExit(f"{d}: ran {ran}, but --preset {args.preset} applies {applied}")
            # a run ends at the first whole batch past its budget
            if not args.steps <= int(summary["steps"]) < 1.05 * args.steps:
                raise SystemExit(f"{d}: trained {summary['steps']} steps, not a budget of --steps {args.steps}")
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            futs = {s: pool.submit(run_seed, s, args.steps, args.env, args.algo, args.out,
                                   args.compile_update, args.preset) for s in args.seeds}
            returns = {str(s): f.result() for s, f in futs.items()}
    if args.record:
        vals = list(returns.values())
        doc = {"reference": {"algo": args.algo, "env": args.env, "steps": args.steps, "preset": args.preset,
                             "preset_name": applied["preset"], "env_kwargs": applied["env_kwargs"], "source": args.note,
                             "returns": {k: round(v, 1) for k, v in returns.items()},
                             "recorded": time.strftime("%Y-%m-%d")},
               "band": band_for(vals, len(DEFAULT_SEEDS)),
               "rule": f"fail if the mean over n seeds < reference mean - {Z} * std * sqrt(1/n + 1/n_ref)"}
        write_json(ref_path, doc)
        print(json.dumps({"recorded": str(ref_path), **doc}, indent=2))
        return 0
    reference = json.loads(Path(ref_path).read_text())
    try:
        result = judge(returns, reference, args.steps, args.env, args.algo, args.preset)
    except ValueError as e:
        raise SystemExit(f"learning_check: {ref_path}: {e}") from None
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result, indent=2))
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
