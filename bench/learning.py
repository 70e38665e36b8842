"""Learning quality of the defaults: PPO on HalfCheetah-v5 for 1M steps, co-located, through
the whole event pipeline (``rlstream train`` with default settings). Not a test: it takes
10-20 minutes on 2 cores.

Reference: CleanRL's published ppo_continuous_action result on HalfCheetah at 1M steps is about
1,440 (mean episodic return; their benchmark runs). That figure is quoted, not re-measured here.

    python bench/learning.py --steps 1000000 --seed 1 --out runs/bench-learning
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from rlstream.colocated import run_colocated
from config import BusConfig, TrainConfig

CLEANRL_PPO_HALFCHEETAH_1M = 1440.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", default="HalfCheetah-v5")
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("runs/bench-learning"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    run_dir = args.out / f"seed{args.seed}-{int(time.time())}"
    cfg = TrainConfig(env_id=args.env, total_steps=args.steps, seed=args.seed, run_dir=run_dir, preset="none",
                      plot=True, log_every_s=60, bus=BusConfig(log_dir=str(run_dir / "log")))
    t0 = time.perf_counter()
    summary = run_colocated(cfg)
    curve = json.loads((run_dir / "curve.json").read_text())
    steps, rets = np.asarray(curve["steps"]), np.asarray(curve["returns"])
    checkpoints = {}
    for s in (100_000, 250_000, 500_000, 750_000, 1_000_000):
        m = rets[(steps <= s) & (steps > s - 50_000)]
        if m.size:
            checkpoints[str(s)] = round(float(m.mean()), 1)
    final = float(rets[-10:].mean()) if rets.size else float("nan")
    print(json.dumps({
        "bench": "learning", "env": args.env, "algo": "ppo", "steps": summary["steps"], "seed": args.seed,
        "final_return_mean_last10": round(final, 1),
        "reference_cleanrl_ppo_1M": CLEANRL_PPO_HALFCHEETAH_1M if args.env == "HalfCheetah-v5" else None,
        "meets_reference": bool(final >= CLEANRL_PPO_HALFCHEETAH_1M) if args.env == "HalfCheetah-v5" else None,
        "curve_mean_return_at": checkpoints, "wall_s": round(time.perf_counter() - t0, 1),
        "sps": summary["sps"], "plot": summary.get("plot"), "run_dir": str(run_dir),
    }, indent=2))


if __name__ == "__main__":
    main()
