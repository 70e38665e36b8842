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

Every row states the mode it ran in. ``--decoupled NAMES`` also runs those rows the production
way, ``run_decoupled`` (what ``rlstream train --mode decoupled --algo X`` runs: learner, one Faust
stream worker and one actor as processes over Kafka), against a broker the bench starts on a free
port (or ``--bootstrap``); there the data reaches the learner stale by the queue's own lag, which
the co-located rows never see (TBA's staleness weights are all 1 co-located, so its row equals
AGRO's). V-trace is not a loss of its own here but the correction inside AGRO, TBA and decoupled
PPO; the ``vtrace`` row gives it work at its defaults: AGRO with the learner's sample cache
(``--replay.enabled``, at its defaults), so part of what the learner trains (a quarter, on
HalfCheetah) is fragments trained before, older than the policy, restated with V-trace's weights
(``vtrace_replay_weights``). It runs decoupled only: co-located, AGRO's 2,048-step fragments do not
fit the default cache of 1,000 transitions.

Each run's result is kept in ``--out`` (``<row>-<mode>-seed<S>.json``) and is not run again, so a
table can be built in several invocations.

    python bench/algorithms.py --env InvertedPendulum-v5 --steps 50000 --seeds 0 1 2
    python bench/algorithms.py --env HalfCheetah-v5 --steps 1000000 --seeds 0 1 2 --sb3
    python bench/algorithms.py --env HalfCheetah-v5 --steps 200000 --no-dpo --decoupled agro,tba,vtrace
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import uuid
import warnings
from dataclasses import replace
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench.common

from bench.common import (binned_mean, host_info, mean_std, private_broker, pyplot, save_figure, timed,  # noqa: E402
                          write_json)
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
from config.algos import ALGO_DEFAULTS  # noqa: E402

# row name -> (algo, TrainConfig overrides, algorithm overrides)
CASES = {
    "ppo": ("ppo", {}, {}),
    "grpo": ("grpo", {}, {}),
    "dapo": ("dapo", {}, {}),
    "agro": ("agro", {}, {}),
    "tba": ("tba", {}, {}),
    "tba-tb": ("tba", {"num_envs": 8, "group_size": 8, "train_batch_size": 512}, {"objective": "tb"}),
    "vtrace": ("agro", {"replay": True}, {}),
}
#: rows that cannot run co-located at their defaults (``vtrace``: a 2,048-step fragment is larger
#: than the default sample cache of 1,000 transitions; decoupled actors send 32..256-step fragments)
DECOUPLED_ONLY = ("vtrace",)
LABELS = {"tba-tb": "tba (objective=tb)", "vtrace": "v-trace (agro + replayed samples)"}
MODES = {"colocated": "co-located (memory bus)", "decoupled": "decoupled (Kafka, Faust worker, 1 actor)"}
EVAL_SEED = 10_000


@torch.no_grad()
def episodes_of(policy, env_id: str, episodes: int, env_kwargs: dict | None = None) -> list[dict]:
    """Mean-action episodes of ``policy`` seeded EVAL_SEED + i on ``gym.make(env_id, **env_kwargs)``:
    return, length, whether it ended by termination (a fall) and, for the MuJoCo walkers, the x
    distance covered (else None)."""
    env = gym.make(env_id, **(env_kwargs or {}))
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


def evaluate(policy, env_id: str, episodes: int, env_kwargs: dict | None = None) -> list[float]:
    """Mean-action returns of ``policy`` on ``episodes`` episodes seeded EVAL_SEED + i."""
    return [e["return"] for e in episodes_of(policy, env_id, episodes, env_kwargs)]


def policy_versions(log_dir: Path) -> dict[int, PolicyVersion]:
    bus = make_bus("memory", path=str(log_dir))
    try:
        events = EventBus(bus, Codec())
        return {pv.version: pv for pv in (events.codec.decode(r.value) for r in bus.read_all(POLICY_VERSIONS))}
    finally:
        bus.close()


def load_avg() -> list[float]:
    """The machine's 1, 5 and 15-minute load averages (the runs share the cores)."""
    return [round(x, 2) for x in os.getloadavg()]


def train_one(name: str, env_id: str, steps: int, seed: int, out: Path, episodes: int, preset: str = "auto",
              env_kwargs: dict | None = None) -> dict:
    """One co-located run of row ``name``; ``env_kwargs`` as ``--env-arg`` gives them (training and evaluation)."""
    algo, run, overrides = CASES[name]
    run_dir = out / f"{name}-seed{seed}"
    cfg = TrainConfig(algo=algo, env_id=env_id, total_steps=steps, seed=seed, run_dir=run_dir, log_every_s=1e9,
                      snapshot_every=0, metrics_port=-1, algo_overrides=overrides, preset=preset,
                      bus=BusConfig(log_dir=str(run_dir / "log")), **run)
    if env_kwargs:
        cfg = replace(cfg, run=replace(cfg.run, env_kwargs={**cfg.run.env_kwargs, **env_kwargs}))
    load0 = load_avg()
    summary, wall = timed(run_colocated, cfg)
    returns = json.loads((run_dir / "curve.json").read_text())["returns"]
    versions = policy_versions(run_dir / "log")
    final = versions[max(versions)]
    ev = evaluate(load_policy(final), env_id, episodes, cfg.run.env_kwargs)
    return {"name": name, "algo": algo, "mode": "colocated", "seed": seed, "steps": summary["steps"],
            "updates": summary["updates"], "preset": cfg.preset_name(), "env_kwargs": dict(cfg.run.env_kwargs),
            "episodes": len(returns), "train_first20": float(np.mean(returns[:20])),
            "train_last20": float(np.mean(returns[-20:])), "eval": float(np.mean(ev)),
            "wall_s": round(wall, 1), "sps": round(summary["steps"] / wall, 1),
            "run": {"num_envs": cfg.num_envs, "group_size": cfg.group_size,
                    "fragment_steps": cfg.effective_fragment_steps(), "train_batch_size": cfg.train_batch_size},
            "lag_versions": (summary.get("streams") or {}).get("lag_versions"),
            "load_avg": {"start": load0, "end": load_avg()},
            "curve_file": str(run_dir / "curve.json"), "log_dir": str(run_dir / "log")}


def newest_kafka_version(cfg: TrainConfig) -> PolicyVersion:
    """The newest PolicyVersion of ``cfg``'s policy on its Kafka namespace (a decoupled run's final policy)."""
    from rlstream import wiring
    from streams.policy.tail import newest_version

    bus = wiring.build_bus(cfg.bus)
    try:
        return newest_version(wiring.build_events(bus), cfg.policy_id)
    finally:
        bus.close()


def train_decoupled(name: str, env_id: str, steps: int, seed: int, out: Path, episodes: int, bootstrap: str,
                    preset: str = "auto") -> dict:
    """One ``rlstream train --mode decoupled --algo X`` run of row ``name`` (module doc)."""
    from rlstream.decoupled import run_decoupled

    algo, run, overrides = CASES[name]
    run_dir = out / f"{name}-decoupled-seed{seed}"
    cfg = TrainConfig(mode="decoupled", algo=algo, env_id=env_id, total_steps=steps, seed=seed, run_dir=run_dir,
                      log_every_s=15.0, snapshot_every=0, metrics_port=-1, plot=False, algo_overrides=overrides,
                      preset=preset, bus=BusConfig(kind="kafka", bootstrap=bootstrap,
                                                   namespace=f"algos-{name}-{seed}-{uuid.uuid4().hex[:6]}"), **run)
    load0 = load_avg()
    summary, wall = timed(run_decoupled, cfg)
    procs = summary["processes"]
    learner, streams, actor = procs.get("learner", {}), procs.get("streams", {}), procs.get("actor-0", {})
    curve_file = run_dir / "actor-0" / "curve.json"
    returns = json.loads(curve_file.read_text())["returns"]
    final = newest_kafka_version(cfg)
    ev = evaluate(load_policy(final), env_id, episodes, cfg.run.env_kwargs)
    flow = actor.get("flow") or {}
    return {"name": name, "algo": algo, "mode": "decoupled", "seed": seed, "steps": int(actor.get("steps") or 0),
            "updates": learner.get("updates"), "samples_trained": learner.get("samples_trained"),
            "preset": cfg.preset_name(), "final_version": final.version,
            "episodes": len(returns), "train_first20": float(np.mean(returns[:20])),
            "train_last20": float(np.mean(returns[-20:])), "eval": float(np.mean(ev)),
            "wall_s": round(wall, 1), "sps": round(int(actor.get("steps") or 0) / wall, 1),
            "run": {"num_envs": cfg.num_envs, "group_size": cfg.group_size,
                    "fragment_steps": flow.get("fragment_steps") or cfg.effective_fragment_steps(),
                    "dynamic_fragments": (not ALGO_DEFAULTS[algo].on_policy
                                          and not getattr(cfg, "fixed_fragments", False)),
                    "train_batch_size": cfg.train_batch_size, "replay": cfg.replay_settings()},
            "lag_versions": streams.get("lag_versions"), "freshness": streams.get("freshness"),
            "drops": streams.get("drops"), "replay": learner.get("replay"), "ended": summary.get("ended"),
            "restarts": summary.get("restarts"), "load_avg": {"start": load0, "end": load_avg()},
            "curve_file": str(curve_file)}


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


def mode_of(run: dict) -> str:
    """A run's mode (results recorded before the column existed ran co-located)."""
    return run.get("mode", "colocated")


def row_key(run: dict) -> tuple[str, str]:
    return run["name"], mode_of(run)


def label(name: str, mode: str, preset: str | None = None) -> str:
    preset = f" ({preset})" if preset else ""
    return f"{LABELS.get(name, name)}{preset}, {'decoupled' if mode == 'decoupled' else 'co-located'}"


def table(runs: list[dict], dpos: list[dict]) -> tuple[list[dict], str]:
    rows = []
    for key in dict.fromkeys(row_key(r) for r in runs):
        rs = [r for r in runs if row_key(r) == key]
        lags = [r.get("lag_versions") or {} for r in rs]
        rows.append({"name": key[0], "mode": key[1], "mode_text": MODES.get(key[1], key[1]),
                     "preset": rs[0].get("preset"), "seeds": [r["seed"] for r in rs], "run": rs[0]["run"],
                     "train_last20": mean_std([r["train_last20"] for r in rs]), "eval": mean_std([r["eval"] for r in rs]),
                     "eval_per_seed": [round(r["eval"], 1) for r in rs],
                     "updates": mean_std([r["updates"] for r in rs]), "wall_s": mean_std([r["wall_s"] for r in rs]),
                     "sps": mean_std([r["sps"] for r in rs]),
                     "lag_mean": mean_std([x.get("mean") for x in lags]),
                     "lag_max": max((x.get("max") or 0 for x in lags), default=0)})
    ppo_eval = next((r["eval"]["mean"] for r in rows if (r["name"], r["mode"]) == ("ppo", "colocated")), None)
    lines = ["| algorithm | mode | envs x group, fragment, batch | train return (last 20) | eval return "
             "| eval per seed | vs PPO eval | updates | policy lag (mean / max) | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        run = r["run"]
        frag = f"{run['fragment_steps']}" if not run.get("dynamic_fragments") else "32..256"
        shape = f"{run['num_envs']} x {run['group_size'] or '-'}, {frag}, {run['train_batch_size']}"
        if run.get("replay"):
            shape += f" (+replay x{run['replay']['samples_per_insert']:g})"
        rel = f"{round(r['eval']['mean'] / ppo_eval, 2) + 0.0:.2f}" if ppo_eval else "-"
        name = LABELS.get(r["name"], r["name"]) + (f" ({r['preset']})" if r.get("preset") else "")
        lag = f"{r['lag_mean']['mean']:.1f} / {r['lag_max']:g}" if r["lag_mean"] else "-"
        lines.append(f"| {name} | {r['mode_text']} | {shape} "
                     f"| {r['train_last20']['mean']:.1f} ± {r['train_last20']['std']:.1f} "
                     f"| {r['eval']['mean']:.1f} ± {r['eval']['std']:.1f} "
                     f"| {', '.join(f'{x:.0f}' for x in r['eval_per_seed'])} | {rel} | {r['updates']['mean']:.0f} "
                     f"| {lag} | {r['wall_s']['mean']:.1f} |")
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
        lines.append(f"| dpo (offline, replayed ppo samples) | offline | {d['pairs']['mean']:.0f} pairs | - "
                     f"| {d['eval']['mean']:.1f} ± {d['eval']['std']:.1f} (reference {refs}: "
                     f"{ref.get('mean', float('nan')):.1f} ± {ref.get('std', float('nan')):.1f}) | - | {rel} | - | - "
                     f"| {d['wall_s']['mean']:.1f} |")
    return rows, "\n".join(lines)


def curve_path(run: dict, out_dir: Path) -> Path:
    """A run's curve.json: where it was written, else beside a moved result (``--render``)."""
    if run.get("curve_file") and Path(run["curve_file"]).exists():
        return Path(run["curve_file"])
    if mode_of(run) == "decoupled":
        return out_dir / f"{run['name']}-decoupled-seed{run['seed']}" / "actor-0" / "curve.json"
    return out_dir / f"{run['name']}-seed{run['seed']}" / "curve.json"


CURVE_BINS = 20


def binned_curve(curve: dict, steps_per_run: int) -> list[float | None]:
    """A run's training return in ``CURVE_BINS`` equal bins of env steps: the mean return of the
    episodes that ended in each (the last bin takes a run's overshoot); None where none did."""
    edges = np.linspace(0, steps_per_run, CURVE_BINS + 1)
    bins = np.concatenate(([-np.inf], edges[1:-1], [np.inf]))
    b = binned_mean(np.asarray(curve["steps"], float), np.asarray(curve["returns"], float), bins)
    return [None if np.isnan(x) else round(float(x), 1) for x in b]


def with_curve(run: dict, out_dir: Path, steps_per_run: int) -> dict:
    """``run`` with its binned training curve (``binned_curve``) from its curve.json, so that the
    result file alone redraws the plot (``--render``)."""
    f = curve_path(run, out_dir)
    if "curve_binned" in run or not f.exists():
        return run
    return {**run, "curve_binned": binned_curve(json.loads(f.read_text()), steps_per_run)}


def plot(doc: dict, out_dir: Path, path: Path) -> None:
    """Left: each row's training return against env steps (mean over seeds of the runs' binned
    curves; decoupled rows dashed); right: the eval return of every row, mean and std over seeds."""
    fig, (ax, bx) = pyplot().subplots(1, 2, figsize=(13, 5))
    edges = np.linspace(0, doc["steps_per_run"], CURVE_BINS + 1)
    colours = {}
    for key in dict.fromkeys(row_key(r) for r in doc["runs"]):
        curves, preset = [], None
        for r in (r for r in doc["runs"] if row_key(r) == key):
            preset = r.get("preset")
            r = with_curve(r, out_dir, doc["steps_per_run"])
            if "curve_binned" in r:
                curves.append([np.nan if x is None else x for x in r["curve_binned"]])
        if curves:
            colour = colours.setdefault(key[0], f"C{len(colours) % 10}")
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # a bin no seed has an episode end in
                y = np.nanmean(np.asarray(curves, float), 0)
            seen = np.isfinite(y)  # co-located runs stamp episodes per fragment: join the bins that have some
            ax.plot(edges[1:][seen], y[seen], color=colour,
                    ls="--" if key[1] == "decoupled" else "-", label=label(*key, preset))
    ax.set(xlabel="env steps", ylabel="training return (mean over seeds)", title=doc["env"])
    ax.legend(fontsize=7)
    rows = [r for r in doc["rows"] if r.get("eval", {}).get("mean") is not None]
    names = [label(r["name"], r["mode"], r.get("preset")) if "mode" in r else r["name"] for r in rows]
    bx.bar(names, [r["eval"]["mean"] for r in rows], yerr=[r["eval"]["std"] for r in rows],
           color=[colours.get(r["name"], "grey") for r in rows])
    for bar, r in zip(bx.patches, rows):
        if r.get("mode") == "decoupled":
            bar.set_hatch("//")
    bx.axhline(0, color="k", lw=0.5)
    bx.set(ylabel="eval return (mean action; hatched: decoupled)",
           title=f"after {doc['steps_per_run']:,} steps, seeds {doc['seeds']}")
    bx.tick_params(axis="x", rotation=45, labelsize=7)
    for t in bx.get_xticklabels():
        t.set_horizontalalignment("right")
    save_figure(fig, path, dpi=90)


def cached(path: Path, make) -> dict:
    """The run saved at ``path``, else ``make()``'s, saved there."""
    if path.exists():
        return json.loads(path.read_text())
    r = make()
    write_json(path, r)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default="InvertedPendulum-v5")
    ap.add_argument("--steps", type=int, default=50_000, help="env steps per run")
    ap.add_argument("--seeds", nargs="+", default=["0", "1", "2"], help="e.g. 0 1 2 (or 0,1,2)")
    ap.add_argument("--algos", default=",".join(n for n in CASES if n not in DECOUPLED_ONLY),
                    help=f"co-located rows, comma-separated, of {sorted(set(CASES) - set(DECOUPLED_ONLY))}")
    ap.add_argument("--decoupled", default="", help=f"rows also run decoupled over Kafka, of {sorted(CASES)}")
    ap.add_argument("--bootstrap", default=None, help="a broker for --decoupled (default: one started for the bench)")
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
    ap.add_argument("--note", default="", help="kept in the result (e.g. the commit it ran at)")
    ap.add_argument("--out", type=Path, default=None, help="default: runs/bench-algorithms/<time>")
    ap.add_argument("--render", type=Path, default=None, help="only print the table of a saved algorithms.json")
    args = ap.parse_args()
    if args.render is not None:
        saved = json.loads(args.render.read_text())
        rows, md = table(saved["runs"], saved["dpo"])
        print(md)
        plot({**saved, "rows": rows}, args.render.parent, args.render.with_suffix(".png"))
        return
    torch.set_num_threads(args.threads)
    out = (args.out or Path("runs/bench-algorithms") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(x) for s in args.seeds for x in s.split(",") if x]
    names = [n for n in args.algos.split(",") if n]
    decoupled = [n for n in args.decoupled.split(",") if n]
    for n in names + decoupled:
        if n not in CASES:
            ap.error(f"unknown row {n!r}; rows: {sorted(CASES)}")
    if bad := [n for n in names if n in DECOUPLED_ONLY]:
        ap.error(f"{bad} run decoupled only (--decoupled)")
    if "ppo" not in names:
        names.insert(0, "ppo")
    t0 = time.perf_counter()
    load0 = load_avg()
    runs, dpos = [], []
    for name in names:
        for seed in seeds:
            r = cached(out / f"{name}-colocated-seed{seed}.json",
                       lambda: train_one(name, args.env, args.steps, seed, out, args.eval_episodes))
            runs.append(r)
            print(json.dumps({"run": r}), flush=True)
    if decoupled:
        missing = any(not (out / f"{n}-decoupled-seed{s}.json").exists() for n in decoupled for s in seeds)
        broker = private_broker() if args.bootstrap is None and missing else contextlib.nullcontext(args.bootstrap)
        with broker as bootstrap:
            for name in decoupled:
                for seed in seeds:
                    r = cached(out / f"{name}-decoupled-seed{seed}.json",
                               lambda: train_decoupled(name, args.env, args.steps, seed, out, args.eval_episodes,
                                                       bootstrap))
                    runs.append(r)
                    print(json.dumps({"run": r}), flush=True)
    if args.sb3:
        for seed in seeds:
            r = cached(out / f"sb3-ppo-colocated-seed{seed}.json",
                       lambda: {**sb3_one(args.env, args.steps, seed, args.eval_episodes), "mode": "colocated"})
            runs.append(r)
            print(json.dumps({"run": r}), flush=True)
    if not args.no_dpo:
        for r in runs:
            if (r["name"], mode_of(r)) == ("ppo", "colocated"):
                d = dpo_one(r, args.env, args.eval_episodes, args.dpo_beta, args.dpo_epochs, args.dpo_segment)
                dpos.append(d)
                print(json.dumps({"dpo": d}), flush=True)
    runs = [with_curve(r, out, args.steps) for r in runs]
    rows, md = table(runs, dpos)
    loads = [x for r in runs for x in (r.get("load_avg") or {}).values()]
    doc = {"bench": "algorithms", "env": args.env, "steps_per_run": args.steps, "seeds": seeds,
           "eval_episodes": args.eval_episodes, "eval": "mean action, episodes seeded 10000 + i",
           "modes": {m: MODES[m] for m in dict.fromkeys(mode_of(r) for r in runs)},
           "dpo_settings": {"segment": args.dpo_segment, "beta": args.dpo_beta, "epochs": args.dpo_epochs},
           "host": host_info(threads=args.threads),
           "load_avg": {"runs_1m": {"min": min((x[0] for x in loads), default=None),
                                    "max": max((x[0] for x in loads), default=None),
                                    "mean": round(float(np.mean([x[0] for x in loads])), 2) if loads else None},
                        "this_invocation": {"start": load0, "end": load_avg()},
                        "per_run": "runs[i].load_avg: the 1, 5 and 15-minute load at its start and end"},
           "note": args.note, "runs_wall_s_sum": round(sum(r["wall_s"] for r in runs), 1),
           "total_wall_s": round(time.perf_counter() - t0, 1), "rows": rows, "runs": runs, "dpo": dpos}
    (out / "algorithms.json").write_text(json.dumps(doc, indent=2))
    (out / "algorithms.md").write_text(md + "\n")
    plot(doc, out, out / "algorithms.png")
    print(json.dumps({k: v for k, v in doc.items() if k != "runs"}, indent=2))  # each run was printed above
    print(md)


if __name__ == "__main__":
    main()
