"""Every algorithm side by side with PPO: return after the same env-step budget, same seeds,
each trained by ``run_colocated`` (what ``rlstream train --mode colocated --algo X`` runs: the
algorithm's run defaults from ``config.algos.ALGO_DEFAULTS``, every event on the file-backed
memory bus), then DPO trained offline on a PPO run's recorded samples (``rlstream replay
--train-dpo``) against its reference policy.

Env: InvertedPendulum-v5 by default. It is the MuJoCo task where every algorithm here moves
clearly within a budget that fits a few minutes per algorithm on 2 CPU cores (PPO ~10 -> ~700 in
30k steps); on HalfCheetah-v5 the group algorithms get one update per 8 x 1000 steps, so at any
affordable budget the table would mostly show noise.

Per run: ``train_last20`` is the mean return of the last 20 training episodes (stochastic
policy, as collected); ``eval`` is the final PolicyVersion's mean return over ``--eval-episodes``
episodes with the mean action, on the same eval seeds for every row. Rows give the mean and std
over seeds. ``dpo`` rows evaluate, per PPO seed, the DPO policy and its reference (the policy
version that generated most of the preference pairs) the same way.

The peer row ``sb3-ppo`` (with ``--sb3``; needs the ``bench`` extra, stable-baselines3) is
Stable-Baselines3's PPO on the same machine with CleanRL's / our PPO settings (2048 steps x 10
epochs x 32 minibatches of 64, lr 3e-4 annealed, GAE 0.95, clip 0.2, tanh 64x64, observation and
reward normalisation), evaluated by the same code on the same seeds.

    python bench/algorithms.py --env InvertedPendulum-v5 --steps 50000 --seeds 0 1 2
    python bench/algorithms.py --env HalfCheetah-v5 --steps 1000000 --seeds 0 1 2 --sb3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench.common

from bench.common import binned_mean, host_info, mean_std, pyplot, save_figure, timed  # noqa: E402
from rlstream.colocated import run_colocated  # noqa: E402
from config import BusConfig, TrainConfig  # noqa: E402
from streams.policies import load_policy, policy_from_arch  # noqa: E402
from logtools.replay import run_replay  # noqa: E402
from schemas.events import PolicyVersion  # noqa: E402
from schemas.weights import decode_weights  # noqa: E402
from streams.bus import make_bus  # noqa: E402
from streams.events import EventBus  # noqa: E402
from schemas.codec import Codec  # noqa: E402
from streams.topics import POLICY_VERSIONS  # noqa: E402

# row name -> (algo, TrainConfig overrides, algorithm overrides)
CASES = {
    "ppo": ("ppo", {}, {}),
    "grpo": ("grpo", {}, {}),
    "dapo": ("dapo", {}, {}),
    "agro": ("agro", {}, {}),
    "tba": ("tba", {}, {}),
    "tba-tb": ("tba", {"num_envs": 8, "group_size": 8, "train_batch_size": 512}, {"objective": "tb"}),
}
EVAL_SEED = 10_000


@torch.no_grad()
def episodes_of(policy, env_id: str, episodes: int) -> list[dict]:
    """Mean-action episodes of ``policy`` seeded EVAL_SEED + i: return, length, whether it ended
    by termination (a fall) and, for the MuJoCo walkers, the x distance covered (else None)."""
    env = gym.make(env_id)
    low, high = env.action_space.low, env.action_space.high
    out = []
    try:
        for i in range(episodes):
            obs, _ = env.reset(seed=EVAL_SEED + i)
            data = getattr(env.unwrapped, "data", None)
            x0 = float(data.qpos[0]) if data is not None else None
            total, n, term, trunc = 0.0, 0, False, False
            while not (term or trunc):
                a, _, _ = policy.act(torch.as_tensor(obs, dtype=torch.float32).unsqueeze(0), deterministic=True)
                obs, r, term, trunc, _ = env.step(np.clip(a[0].numpy(), low, high))
                total, n = total + float(r), n + 1
            out.append({"return": total, "length": n, "fell": bool(term),
                        "dx": float(data.qpos[0]) - x0 if x0 is not None else None})
    finally:
        env.close()
    return out


def evaluate(policy, env_id: str, episodes: int) -> list[float]:
    """Mean-action returns of ``policy`` on ``episodes`` episodes seeded EVAL_SEED + i."""
    return [e["return"] for e in episodes_of(policy, env_id, episodes)]


def policy_versions(log_dir: Path) -> dict[int, PolicyVersion]:
    bus = make_bus("memory", path=str(log_dir))
    try:
        events = EventBus(bus, Codec())
        return {pv.version: pv for pv in (events.codec.decode(r.value) for r in bus.read_all(POLICY_VERSIONS))}
    finally:
        bus.close()


def train_one(name: str, env_id: str, steps: int, seed: int, out: Path, episodes: int, preset: str = "auto") -> dict:
    algo, run, overrides = CASES[name]
    run_dir = out / f"{name}-seed{seed}"
    cfg = TrainConfig(algo=algo, env_id=env_id, total_steps=steps, seed=seed, run_dir=run_dir, log_every_s=1e9,
                      snapshot_every=0, metrics_port=-1, algo_overrides=overrides, preset=preset,
                      bus=BusConfig(log_dir=str(run_dir / "log")), **run)
    summary, wall = timed(run_colocated, cfg)
    returns = json.loads((run_dir / "curve.json").read_text())["returns"]
    versions = policy_versions(run_dir / "log")
    final = versions[max(versions)]
    ev = evaluate(load_policy(final), env_id, episodes)
    return {"name": name, "algo": algo, "seed": seed, "steps": summary["steps"], "updates": summary["updates"],
            "episodes": len(returns), "train_first20": float(np.mean(returns[:20])),
            "train_last20": float(np.mean(returns[-20:])), "eval": float(np.mean(ev)),
            "wall_s": round(wall, 1), "sps": round(summary["steps"] / wall, 1),
            "run": {"num_envs": cfg.num_envs, "group_size": cfg.group_size,
                    "fragment_steps": cfg.effective_fragment_steps(), "train_batch_size": cfg.train_batch_size},
            "log_dir": str(run_dir / "log")}


class _SB3Policy:
    """``act(obs, deterministic=True)`` over a trained SB3 model and its observation normaliser."""

    def __init__(self, model, vecnorm) -> None:
        self.model, self.vecnorm = model, vecnorm

    def act(self, obs: torch.Tensor, deterministic: bool = True):
        a, _ = self.model.predict(self.vecnorm.normalize_obs(obs.numpy()), deterministic=deterministic)
        return torch.as_tensor(a), None, None


def sb3_one(env_id: str, steps: int, seed: int, episodes: int) -> dict:
    """The peer: Stable-Baselines3 PPO with the same settings as our PPO row (module doc)."""
    from stable_baselines3 import PPO as SB3PPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecMonitor, VecNormalize

    venv = VecNormalize(VecMonitor(make_vec_env(env_id, n_envs=1, seed=seed)), gamma=0.99)
    model = SB3PPO("MlpPolicy", venv, n_steps=2048, batch_size=64, n_epochs=10, learning_rate=lambda f: 3e-4 * f,
                   gamma=0.99, gae_lambda=0.95, clip_range=0.2, ent_coef=0.0, vf_coef=0.5, max_grad_norm=0.5,
                   policy_kwargs={"net_arch": [64, 64], "activation_fn": torch.nn.Tanh}, seed=seed, device="cpu")
    t0 = time.perf_counter()
    model.learn(total_timesteps=steps)
    wall = time.perf_counter() - t0
    returns = [ep["r"] for ep in model.ep_info_buffer]  # the last 100 episodes
    ev = evaluate(_SB3Policy(model, venv), env_id, episodes)
    return {"name": "sb3-ppo", "algo": "sb3-ppo", "seed": seed, "steps": steps, "updates": steps // 2048,
            "episodes": len(returns), "train_first20": float("nan"), "train_last20": float(np.mean(returns[-20:])),
            "eval": float(np.mean(ev)), "wall_s": round(wall, 1), "sps": round(steps / wall, 1),
            "run": {"num_envs": 1, "group_size": 0, "fragment_steps": 2048, "train_batch_size": 2048}}


def dpo_one(ppo: dict, env_id: str, episodes: int, beta: float, epochs: int, segment: int) -> dict:
    log_dir = Path(ppo["log_dir"])
    out = log_dir.parent / "dpo"
    t0 = time.perf_counter()
    summary = run_replay(BusConfig(kind="memory", log_dir=str(log_dir)), train=True, beta=beta, epochs=epochs,
                         segment=segment, out=out, seed=ppo["seed"])
    wall = time.perf_counter() - t0
    dpo = summary["dpo"]
    state, arch = decode_weights((out / "policy.safetensors").read_bytes())
    policy = policy_from_arch(arch)
    policy.load_state_dict(state)
    ref_version = dpo["reference"]["version"]
    ref = load_policy(policy_versions(log_dir)[ref_version]) if ref_version is not None else None
    return {"name": "dpo", "seed": ppo["seed"], "pairs": summary["pairs_built"], "reference_version": ref_version,
            "heldout_reward_accuracy": dpo.get("heldout_reward_accuracy"),
            "eval": float(np.mean(evaluate(policy, env_id, episodes))),
            "eval_reference": float(np.mean(evaluate(ref, env_id, episodes))) if ref is not None else None,
            "wall_s": round(wall, 1)}


def table(runs: list[dict], dpos: list[dict]) -> tuple[list[dict], str]:
    rows = []
    for name in dict.fromkeys(r["name"] for r in runs):
        rs = [r for r in runs if r["name"] == name]
        rows.append({"name": name, "seeds": [r["seed"] for r in rs], "run": rs[0]["run"],
                     "train_last20": mean_std([r["train_last20"] for r in rs]), "eval": mean_std([r["eval"] for r in rs]),
                     "updates": mean_std([r["updates"] for r in rs]), "wall_s": mean_std([r["wall_s"] for r in rs]),
                     "sps": mean_std([r["sps"] for r in rs])})
    ppo_eval = next((r["eval"]["mean"] for r in rows if r["name"] == "ppo"), None)
    lines = ["| algorithm | envs x group, fragment, batch | train return (last 20) | eval return | vs PPO eval "
             "| updates | wall s | SPS |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        run = r["run"]
        shape = f"{run['num_envs']} x {run['group_size'] or '-'}, {run['fragment_steps']}, {run['train_batch_size']}"
        rel = f"{r['eval']['mean'] / ppo_eval:.2f}" if ppo_eval else "-"
        lines.append(f"| {r['name']} | {shape} | {r['train_last20']['mean']:.1f} ± {r['train_last20']['std']:.1f} "
                     f"| {r['eval']['mean']:.1f} ± {r['eval']['std']:.1f} | {rel} | {r['updates']['mean']:.0f} "
                     f"| {r['wall_s']['mean']:.1f} | {r['sps']['mean']:.0f} |")
    if dpos:
        d = {"name": "dpo (replay of the ppo runs)", "seeds": [x["seed"] for x in dpos],
             "eval": mean_std([x["eval"] for x in dpos]), "eval_reference": mean_std([x["eval_reference"] for x in dpos]),
             "pairs": mean_std([x["pairs"] for x in dpos]), "reference_version": [x["reference_version"] for x in dpos],
             "heldout_reward_accuracy": mean_std([x["heldout_reward_accuracy"] for x in dpos]),
             "wall_s": mean_std([x["wall_s"] for x in dpos])}
        rows.append(d)
        ref = d["eval_reference"]
        refs = ", ".join(f"v{v}" for v in d["reference_version"])
        rel = f"x{d['eval']['mean'] / ref['mean']:.2f} of its reference" if ref.get("mean") else "-"
        lines.append(f"| dpo (offline, replayed ppo samples) | {d['pairs']['mean']:.0f} pairs | - "
                     f"| {d['eval']['mean']:.1f} ± {d['eval']['std']:.1f} (reference {refs}: "
                     f"{ref.get('mean', float('nan')):.1f} ± {ref.get('std', float('nan')):.1f}) | {rel} | - "
                     f"| {d['wall_s']['mean']:.1f} | - |")
    return rows, "\n".join(lines)


def plot(doc: dict, out_dir: Path, path: Path) -> None:
    """Left: each algorithm's training return against env steps (mean over seeds, 20 bins, from
    the runs' curve.json); right: the eval return of every row, mean and std over seeds."""
    fig, (ax, bx) = pyplot().subplots(1, 2, figsize=(12, 4.5))
    edges = np.linspace(0, doc["steps_per_run"], 21)
    bins = np.concatenate(([-np.inf], edges[1:-1], [np.inf]))  # the last bin takes a run's overshoot
    for name in dict.fromkeys(r["name"] for r in doc["runs"]):
        curves = []
        for r in (r for r in doc["runs"] if r["name"] == name):
            f = out_dir / f"{name}-seed{r['seed']}" / "curve.json"
            if not f.exists():
                continue
            c = json.loads(f.read_text())
            curves.append(binned_mean(np.asarray(c["steps"], float), np.asarray(c["returns"], float), bins))
        if curves:
            ax.plot(edges[1:], np.nanmean(np.asarray(curves), 0), label=name)
    ax.set(xlabel="env steps", ylabel="training return (mean over seeds)", title=doc["env"])
    ax.legend(fontsize=8)
    rows = [r for r in doc["rows"] if r.get("eval", {}).get("mean") is not None]
    bx.bar([r["name"] for r in rows], [r["eval"]["mean"] for r in rows], yerr=[r["eval"]["std"] for r in rows])
    bx.set(ylabel="eval return (mean action)", title=f"after {doc['steps_per_run']:,} steps, seeds {doc['seeds']}")
    bx.tick_params(axis="x", rotation=30)
    save_figure(fig, path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default="InvertedPendulum-v5")
    ap.add_argument("--steps", type=int, default=50_000, help="env steps per run")
    ap.add_argument("--seeds", nargs="+", default=["0", "1", "2"], help="e.g. 0 1 2 (or 0,1,2)")
    ap.add_argument("--algos", default=",".join(CASES), help=f"comma-separated, of {sorted(CASES)}")
    ap.add_argument("--eval-episodes", type=int, default=10)
    ap.add_argument("--no-dpo", action="store_true", help="skip DPO on the PPO runs' samples")
    ap.add_argument("--sb3", action="store_true", help="add the Stable-Baselines3 PPO peer row (bench extra)")
    ap.add_argument("--dpo-beta", type=float, default=0.1)
    ap.add_argument("--dpo-epochs", type=int, default=20)
    ap.add_argument("--dpo-segment", type=int, default=8,
                    help="segment length of the preference pairs (InvertedPendulum pays +1 per step "
                         "alive, so segments only differ in return when the pole falls inside one: "
                         "at 32, few pairs survive the tie filter)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="default: runs/bench-algorithms/<time>")
    ap.add_argument("--render", type=Path, default=None, help="only print the table of a saved algorithms.json")
    args = ap.parse_args()
    if args.render is not None:
        saved = json.loads(args.render.read_text())
        print(table(saved["runs"], saved["dpo"])[1])
        plot(saved, args.render.parent, args.render.with_suffix(".png"))
        return
    torch.set_num_threads(args.threads)
    out = args.out or Path("runs/bench-algorithms") / time.strftime("%Y%m%d-%H%M%S")
    seeds = [int(x) for s in args.seeds for x in s.split(",") if x]
    names = [n for n in args.algos.split(",") if n]
    if "ppo" not in names:
        names.insert(0, "ppo")
    t0 = time.perf_counter()
    runs, dpos = [], []
    for name in names:
        for seed in seeds:
            r = train_one(name, args.env, args.steps, seed, out, args.eval_episodes)
            runs.append(r)
            print(json.dumps({"run": r}), flush=True)
    if args.sb3:
        for seed in seeds:
            r = sb3_one(args.env, args.steps, seed, args.eval_episodes)
            runs.append(r)
            print(json.dumps({"run": r}), flush=True)
    if not args.no_dpo:
        for r in runs:
            if r["name"] == "ppo":
                d = dpo_one(r, args.env, args.eval_episodes, args.dpo_beta, args.dpo_epochs, args.dpo_segment)
                dpos.append(d)
                print(json.dumps({"dpo": d}), flush=True)
    rows, md = table(runs, dpos)
    doc = {"bench": "algorithms", "env": args.env, "steps_per_run": args.steps, "seeds": seeds,
           "eval_episodes": args.eval_episodes, "eval": "mean action, episodes seeded 10000 + i",
           "dpo_settings": {"segment": args.dpo_segment, "beta": args.dpo_beta, "epochs": args.dpo_epochs},
           "host": host_info(threads=args.threads),
           "total_wall_s": round(time.perf_counter() - t0, 1), "rows": rows, "runs": runs, "dpo": dpos}
    out.mkdir(parents=True, exist_ok=True)
    (out / "algorithms.json").write_text(json.dumps(doc, indent=2))
    (out / "algorithms.md").write_text(md + "\n")
    plot(doc, out, out / "algorithms.png")
    print(json.dumps(doc, indent=2))
    print(md)


if __name__ == "__main__":
    main()
