"""rlstream co-located PPO beside the single-file PPOs users would otherwise pick, at identical
settings, in one run; prints ONE JSON document.

Settings (CleanRL ``ppo_continuous_action``'s): 1 env, 2,048 steps per update, 10 epochs,
minibatch 64, separate 64-64 tanh actor and critic MLPs, state-independent log std, observation
and reward normalisation (clip 10), Adam eps 1e-5 with the learning rate annealed linearly to 0
over the run, clip 0.2 (value loss clipped too), GAE 0.99 / 0.95, grad-norm clip 0.5, one torch
thread. Each peer and seed runs in its own subprocess; SPS is timed around training only (the
wall clock, and the process CPU time, which is steadier on a shared machine). Final return: mean
of the last 10 episodes' raw returns.

Peers (installed with ``pip install -e .[bench]``; this script installs nothing):
- ``sb3``: Stable-Baselines3 PPO (``VecNormalize`` for the normalisation);
- ``cleanrl``: CleanRL's own ``ppo_continuous_action`` script (``python -m
  cleanrl.ppo_continuous_action``), run by ``--cleanrl-python``: an interpreter with ``cleanrl``
  1.2.0 and the Gymnasium 0.28 / MuJoCo 2.3 it was written for, which this project's Python 3.11
  and Gymnasium 1.4 are not (docs/benchmarks.md says how to make one). Gymnasium 0.28 has no
  ``-v5`` tasks, so a table with CleanRL in it runs every peer on ``HalfCheetah-v4``. Its SPS is
  the figure the script prints (timed around its training loop, as ours are); its process CPU
  time includes start-up, so no CPU ratio is drawn against it;
- ``rlstream``: ``rlstream train --mode colocated`` (``run_colocated``);
- ``rlstream-overlap``: the same with ``--overlap`` (the actors collect the next fragment in a
  second thread while the learner updates; PPO then trains as decoupled PPO on one-version-stale
  fragments). Its row adds the run's policy lag and where the overlapped rounds spent their time,
  and the JSON's ratios set it against ``rlstream`` (strict PPO) for SPS and return.

    python bench/peers.py --steps 20480 --seeds 1 2 3
    python bench/peers.py --steps 100000 --seeds 1 2 3 --peers rlstream rlstream-overlap
    python bench/peers.py --env HalfCheetah-v4 --cleanrl-python .venv-cleanrl/bin/python --seeds 1 2 3
"""

from __future__ import annotations

from config.env import Environment

import argparse
import functools
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root: bench.common

from bench.common import host_info, load_1m  # noqa: E402

PEERS = ("sb3", "cleanrl", "rlstream", "rlstream-overlap")
LR, GAMMA, LAM, CLIP = 3e-4, 0.99, 0.95, 0.2


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _timed(fn) -> tuple[object, float, float, float]:
    """``(fn(), wall s, CPU s, children's CPU s)``; the CPU figure counts this process and the
    children ``fn`` started and ended (``--overlap``'s rollout processes), the last those alone."""
    t0, c0, k0 = time.perf_counter(), time.process_time(), _children_cpu()
    out = fn()
    kids = _children_cpu() - k0
    return out, time.perf_counter() - t0, time.process_time() - c0 + kids, kids


def run_sb3(env_id: str, steps: int, seed: int) -> dict:
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    env = VecNormalize(make_vec_env(env_id, n_envs=1, seed=seed), norm_obs=True, norm_reward=True,
                       clip_obs=10.0, clip_reward=10.0, gamma=GAMMA)
    model = PPO("MlpPolicy", env, n_steps=2048, batch_size=64, n_epochs=10, learning_rate=lambda f: LR * f,
                gamma=GAMMA, gae_lambda=LAM, clip_range=CLIP, clip_range_vf=CLIP, ent_coef=0.0, vf_coef=0.5,
                max_grad_norm=0.5, seed=seed, device="cpu", verbose=0,
                policy_kwargs={"net_arch": {"pi": [64, 64], "vf": [64, 64]}, "activation_fn": torch.nn.Tanh,
                               "log_std_init": 0.0})
    _, wall, cpu, _ = _timed(lambda: model.learn(steps))
    env.close()
    return {"steps": int(model.num_timesteps), "wall_s": wall, "cpu_s": cpu,
            "returns": [float(e["r"]) for e in model.ep_info_buffer]}


def run_cleanrl(env_id: str, steps: int, seed: int, python: str) -> dict:
    """CleanRL's own script as a module, in a subprocess; returns and SPS parsed from its stdout."""
    cmd = [python, "-m", "cleanrl.ppo_continuous_action", "--env-id", env_id, "--seed", str(seed),
           "--total-timesteps", str(steps), "--num-envs", "1", "--num-steps", "2048", "--num-minibatches", "32",
           "--update-epochs", "10", "--track", "False", "--capture-video", "False", "--cuda", "False"]
    env = Environment.read().child({"PYTHONPATH": None})
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # one torch thread, as every peer
    with tempfile.TemporaryDirectory() as d:
        c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        p = subprocess.run(cmd, cwd=d, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"unavailable": f"`{python} -m cleanrl.ppo_continuous_action` exited {p.returncode}: {last} "
                               "(docs/benchmarks.md: which Python runs it)"}
    sps = [float(x) for x in re.findall(r"^SPS:\s*([\d.]+)", p.stdout, re.M)]
    rets = [float(x) for x in re.findall(r"episodic_return=\[?([-\d.e+]+)", p.stdout)]
    if not sps:
        return {"unavailable": "CleanRL printed no SPS line"}
    cpu = (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)
    # cpu_s stays None: the child's CPU includes interpreter and env start-up, so no CPU ratio is drawn
    return {"steps": steps, "wall_s": steps / sps[-1], "process_wall_s": wall, "cpu_s": None,
            "process_cpu_s": cpu, "returns": rets}


def run_rlstream(env_id: str, steps: int, seed: int, overlap: bool = False) -> dict:
    from rlstream.colocated import run_colocated
    from config import TrainConfig

    with tempfile.TemporaryDirectory() as d:
        cfg = TrainConfig(env_id=env_id, total_steps=steps, seed=seed, run_dir=Path(d), log_every_s=1e9,
                          snapshot_every=0, overlap=overlap, preset="none")  # the peers' settings, not a task preset
        summary, wall, cpu, children_cpu = _timed(lambda: run_colocated(cfg))
        curve = json.loads((Path(d) / "curve.json").read_text())
    out = {"steps": int(summary["steps"]), "wall_s": wall, "cpu_s": cpu, "children_cpu_s": children_cpu,
           "returns": curve["returns"]}
    if overlap:
        out.update(policy_lag=summary["policy_lag"], overlap=summary["overlap"])
    return out


def one(peer: str, env_id: str, steps: int, seed: int, cleanrl_python: str) -> dict:
    import torch

    torch.set_num_threads(1)
    run = {"sb3": run_sb3, "cleanrl": functools.partial(run_cleanrl, python=cleanrl_python),
           "rlstream": run_rlstream, "rlstream-overlap": functools.partial(run_rlstream, overlap=True)}[peer]
    try:
        out = run(env_id, steps, seed)
    except ImportError as e:
        return {"unavailable": f"not installed: {e} (pip install -e .[bench])"}
    if "unavailable" in out:
        return out
    rets = out.pop("returns")
    out["sps"] = out["steps"] / out["wall_s"]
    out["cpu_sps"] = out["steps"] / out["cpu_s"] if out["cpu_s"] else None
    out["cores"] = out["cpu_s"] / out["wall_s"] if out["cpu_s"] else None  # > 1: the run used cores in parallel
    out["episodes"] = len(rets)
    out["return_last10"] = float(np.mean(rets[-10:])) if rets else None
    return out


def _agg(rows: list[dict], key: str) -> float | None:
    xs = [r[key] for r in rows if r.get(key) is not None]
    return round(float(np.mean(xs)), 1) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", default="HalfCheetah-v5")
    ap.add_argument("--steps", type=int, default=20480, help="env steps per run (CleanRL's reference: 1M)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1])
    ap.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    ap.add_argument("--cleanrl-python", default=sys.executable,
                    help="interpreter with cleanrl 1.2.0 and Gymnasium 0.28 (docs/benchmarks.md)")
    ap.add_argument("--one", choices=PEERS, help=argparse.SUPPRESS)  # internal: run one peer, print its row
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.env, args.steps, args.seeds[0], args.cleanrl_python)))
        return
    here = Environment.read()
    env = here.child({"PYTHONPATH": os.pathsep.join([str(ROOT), here.get("PYTHONPATH")]).rstrip(os.pathsep)})
    runs: dict[str, list[dict]] = {p: [] for p in args.peers}
    for seed in args.seeds:
        for peer in args.peers:  # interleaved, so a change in the machine's load hits every peer
            p = subprocess.run([sys.executable, __file__, "--one", peer, "--env", args.env, "--steps", str(args.steps),
                                "--seeds", str(seed), "--cleanrl-python", args.cleanrl_python], cwd=ROOT, env=env, capture_output=True, text=True)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            row = json.loads(lines[-1]) if p.returncode == 0 and lines else {
                "unavailable": f"exited {p.returncode}: {(p.stderr.strip().splitlines() or [''])[-1]}"}
            runs[peer].append({"seed": seed, **{k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}})
    summary = {}
    for peer, rows in runs.items():
        ok = [r for r in rows if "unavailable" not in r]
        summary[peer] = ({"sps": _agg(ok, "sps"), "cpu_sps": _agg(ok, "cpu_sps"), "return_last10": _agg(ok, "return_last10")}
                         if ok else {"unavailable": rows[0]["unavailable"]})
    ours = summary.get("rlstream", {})
    ratios = {}
    for peer in args.peers:
        if peer not in ("rlstream", "rlstream-overlap") and "unavailable" not in summary[peer] and ours.get("sps"):
            ratios[f"rlstream_over_{peer}_sps"] = round(ours["sps"] / summary[peer]["sps"], 3)
            if ours.get("cpu_sps") and summary[peer].get("cpu_sps"):
                ratios[f"rlstream_over_{peer}_cpu_sps"] = round(ours["cpu_sps"] / summary[peer]["cpu_sps"], 3)
            if ours.get("return_last10") is not None and summary[peer]["return_last10"] is not None:
                ratios[f"rlstream_minus_{peer}_return"] = round(ours["return_last10"] - summary[peer]["return_last10"], 1)
    ov = summary.get("rlstream-overlap", {})
    if ours.get("sps") and ov.get("sps"):  # overlap against strict PPO, same run, interleaved per seed
        ratios["overlap_over_strict_sps"] = round(ov["sps"] / ours["sps"], 3)
        if ours.get("cpu_sps") and ov.get("cpu_sps"):
            ratios["overlap_over_strict_cpu_sps"] = round(ov["cpu_sps"] / ours["cpu_sps"], 3)
        if ours.get("return_last10") is not None and ov.get("return_last10") is not None:
            ratios["overlap_minus_strict_return"] = round(ov["return_last10"] - ours["return_last10"], 1)
    versions = {}
    if "cleanrl" in args.peers:
        probe = subprocess.run([args.cleanrl_python, "-c", "import importlib.metadata as m, platform; print(platform.python_version(), "
                                "*(m.version(d) for d in ('cleanrl', 'gymnasium', 'mujoco', 'torch')))"],
                               capture_output=True, text=True)
        if probe.returncode == 0:
            versions["cleanrl"] = dict(zip(("python", "cleanrl", "gymnasium", "mujoco", "torch"), probe.stdout.split()))
    print(json.dumps({
        "bench": "peers", "env": args.env, "steps": args.steps, "seeds": args.seeds, "target_sps_ratio_min": 2.0,
        "settings": {"num_envs": 1, "steps_per_update": 2048, "epochs": 10, "minibatch": 64, "hidden": [64, 64],
                     "activation": "tanh", "normalize": "obs and reward, clip 10", "lr": f"{LR} annealed to 0",
                     "torch_threads": 1},
        "host": host_info(loadavg_1m=load_1m()),
        "peer_versions": versions,
        "summary": summary, "ratios": ratios, "runs": runs,
    }, indent=2))


if __name__ == "__main__":
    main()
