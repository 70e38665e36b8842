"""Learning against staleness: the off-policy algorithms (AGRO, TBA, decoupled PPO) trained on
data from a policy exactly K versions behind the learner, with and without the off-policy
correction, to show the learning curve against K (0, 4, 16).

The version lag is injected in one process, which is the cheapest faithful way to get a *fixed*
K: an actor keeps the last K + 1 published policy versions and always acts with the oldest, and
the learner gets each fragment with ``behaviour_logp`` of that policy and ``staleness_versions``
set to the real gap (as the stream processor would). In decoupled mode K is whatever the queue
depth happens to be; here it is the independent variable. The algorithm objects are the same ones
``rlstream train`` builds (``agents.registry.make_algorithm``), with their run defaults (one env,
fragments of 2048 steps).

"With correction" is each algorithm's default: V-trace targets with rho/c from the shared cap
rule (AGRO, TBA), TBA's staleness-decayed learning rate, decoupled PPO's clip anchored at the
learner's own policy with the behaviour weight. "Without": ``vtrace=false`` (rho = c = 1), TBA's
``staleness_schedule=none``, plain PPO (clip anchored at the stale behaviour policy).

``--decoupled`` runs AGRO and TBA the production way instead: ``rlstream train --mode decoupled``
over Kafka (actor, Faust worker and learner as processes), with the actors' lag set to K
(``TrainConfig.actor_lag_versions``): every fragment leaves the actor K versions behind the newest
version it has received, and the staleness, importance weights and V-trace are computed by the
real stream processor and learner. The stream processor's staleness window is opened wide
(``max_versions`` 2^20, no age limit) in both arms, so K = 16 data is neither dropped nor
down-weighted there and only the learner's correction differs, as in the in-process runs. The
lag column is then measured, not set: the stream processor's mean version lag, which adds the
queue's own lag (about one version) to K. Needs ``KAFKA_BROKERS``.

    python bench/staleness.py --env HalfCheetah-v5 --steps 1000000 --seeds 0 1 2 --ks 0 4 16
    python bench/staleness.py --steps 4096 --ks 0 2 --algos agro --seeds 0   # smoke
    KAFKA_BROKERS=127.0.0.1:9092 python bench/staleness.py --decoupled --algos agro tba --steps 200000
"""

from __future__ import annotations

from config.env import Environment
from config.limits import DEFAULT_BOOTSTRAP

import argparse
import copy
import json
import sys
import time
from collections import deque
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench.common

from bench.common import host_info, pyplot, running_mean, save_figure, timed  # noqa: E402
from agents.core import TrajectoryBatch  # noqa: E402
from agents.registry import make_algorithm  # noqa: E402

FRAGMENT = 2048
ALGOS = ("agro", "tba", "ppo")


def overrides(algo: str, correction: bool, steps: int, seed: int) -> dict:
    o: dict = {"seed": seed}
    if algo == "ppo":
        o.update(decoupled=correction, total_updates=max(1, steps // FRAGMENT))
    else:
        o["vtrace"] = correction
        if algo == "tba" and not correction:
            o["staleness_schedule"] = "none"
    return o


def collect(env, obs: np.ndarray, policy, T: int, gen: torch.Generator, episode: dict) -> tuple[dict, np.ndarray, list]:
    """``T`` steps of ``policy`` (as the actor: sampled actions, clipped for the env, the true final
    obs of a truncated episode kept apart). Returns the batch arrays, the next obs, finished returns."""
    low, high = env.action_space.low, env.action_space.high
    keys = ("obs", "actions", "rewards", "terminated", "truncated", "behaviour_logp", "next_obs_final")
    buf: dict = {k: [] for k in keys}
    done_returns = []
    for _ in range(T):
        o = torch.as_tensor(obs, dtype=torch.float32).unsqueeze(0)
        a, logp, _ = policy.act(o, generator=gen)
        nxt, r, term, trunc, _ = env.step(np.clip(a[0].numpy(), low, high))
        buf["obs"].append(obs)
        buf["actions"].append(a[0].numpy())
        buf["rewards"].append(r)
        buf["terminated"].append(term)
        buf["truncated"].append(trunc and not term)
        buf["behaviour_logp"].append(float(logp[0]))
        buf["next_obs_final"].append(nxt)
        episode["ret"] += float(r)
        if term or trunc:
            done_returns.append(episode["ret"])
            episode["ret"] = 0.0
            nxt, _ = env.reset()
        obs = nxt
    arrays = {k: np.asarray(v, dtype=np.float32 if k not in ("terminated", "truncated") else bool) for k, v in buf.items()}
    arrays = {k: v.reshape(T, 1, *v.shape[1:]) for k, v in arrays.items()}
    arrays["last_obs"] = np.asarray(obs, dtype=np.float32).reshape(1, -1)
    return arrays, obs, done_returns


def run_one(algo_name: str, env_id: str, K: int, correction: bool, steps: int, seed: int) -> dict:
    env = gym.make(env_id)
    obs, _ = env.reset(seed=seed)
    env.action_space.seed(seed)
    algo = make_algorithm(algo_name, env.observation_space.shape[0], env.action_space.shape[0],
                          overrides(algo_name, correction, steps, seed))
    versions: deque = deque([(0, copy.deepcopy(algo.policy.state_dict()))], maxlen=K + 1)
    behaviour = copy.deepcopy(algo.policy)
    gen = torch.Generator().manual_seed(seed)
    episode, curve, lags = {"ret": 0.0}, [], []
    t0, done = time.perf_counter(), 0
    while done < steps:
        version, state = versions[0]  # the oldest kept version: K behind once the deque is full
        behaviour.load_state_dict(state)
        arrays, obs, finished = collect(env, obs, behaviour, FRAGMENT, gen, episode)
        done += FRAGMENT
        curve += [(done, r) for r in finished]
        lag = algo.step - version
        lags.append(lag)
        algo.update(TrajectoryBatch.from_numpy(**arrays, staleness_versions=float(lag)))
        versions.append((algo.step, copy.deepcopy(algo.policy.state_dict())))
    rets = [r for _, r in curve]
    return {"algo": algo_name, "K": K, "correction": correction, "seed": seed, "steps": done,
            "updates": algo.step, "mean_lag": float(np.mean(lags)), "episodes": len(rets),
            "last20": float(np.mean(rets[-20:])) if rets else float("nan"),
            "wall_s": round(time.perf_counter() - t0, 1), "curve": curve}


def run_decoupled_one(algo_name: str, env_id: str, K: int, correction: bool, steps: int, seed: int,
                      bootstrap: str) -> dict:
    """One ``rlstream train --mode decoupled`` run with actors ``K`` versions behind (module doc)."""
    import tempfile
    import uuid

    from config import BusConfig, TrainConfig
    from rlstream.decoupled import run_decoupled
    from config import PrepareConfig

    algo_overrides = {k: v for k, v in overrides(algo_name, correction, steps, seed).items() if k != "seed"}
    with tempfile.TemporaryDirectory() as d:
        cfg = TrainConfig(mode="decoupled", algo=algo_name, env_id=env_id, total_steps=steps, seed=seed,
                          run_dir=Path(d), log_every_s=1e9, snapshot_every=0, plot=False, actor_lag_versions=K,
                          algo_overrides=algo_overrides, preset="none",
                          streams=PrepareConfig.for_algo(algo_name, max_versions=1 << 20, max_ms=None),
                          bus=BusConfig(kind="kafka", bootstrap=bootstrap,
                                        namespace=f"stale-{algo_name}-{K}-{int(correction)}-{seed}-{uuid.uuid4().hex[:6]}"))
        summary, wall = timed(run_decoupled, cfg)  # no logger: its one progress line goes to stderr
        curve = json.loads((Path(d) / "actor-0" / "curve.json").read_text())
    procs = summary["processes"]
    learner, streams = procs.get("learner", {}), procs.get("streams", {})
    curve = list(zip(curve["steps"], curve["returns"]))
    rets = [r for _, r in curve]
    return {"algo": algo_name, "K": K, "correction": correction, "seed": seed, "steps": procs["actor-0"]["steps"],
            "updates": learner.get("updates"), "samples_trained": learner.get("samples_trained"),
            "mean_lag": float(streams["lag_versions"]["mean"]), "max_lag": streams["lag_versions"]["max"],
            "drops": streams.get("drops"), "restarts": summary.get("restarts"),
            "consumer_rewinds": streams.get("consumer_rewinds"), "episodes": len(rets),
            "last20": float(np.mean(rets[-20:])) if rets else float("nan"), "wall_s": round(wall, 1),
            "curve": curve}


def plot(runs: list[dict], path: Path) -> None:
    """Mean over seeds of each run's running last-20 return against env steps, one panel per algorithm."""
    algos = list(dict.fromkeys(r["algo"] for r in runs))
    fig, axes = pyplot().subplots(1, len(algos), figsize=(5 * len(algos), 4), squeeze=False)
    for ax, a in zip(axes[0], algos):
        for (K, corr) in sorted({(r["K"], r["correction"]) for r in runs if r["algo"] == a}):
            rs = [r for r in runs if r["algo"] == a and r["K"] == K and r["correction"] == corr]
            xs = np.linspace(0, max(r["steps"] for r in rs), 50)
            ys = [np.interp(xs, [s for s, _ in r["curve"]], running_mean([v for _, v in r["curve"]])) for r in rs if r["curve"]]
            if ys:
                ax.plot(xs, np.mean(ys, 0), ls="-" if corr else "--", label=f"K={K} {'corr' if corr else 'no corr'}")
        ax.set_title(a)
        ax.xaxis.set_major_formatter(lambda x, _: f"{x / 1000:g}k")
        ax.set_xlabel("env steps")
        ax.set_ylabel("episode return")
        ax.legend(fontsize=7)
    save_figure(fig, path)


def table(runs: list[dict]) -> str:
    lines = ["| algorithm | K | correction | last-20 return (mean ± std over seeds) | mean lag | updates |",
             "|---|---|---|---|---|---|"]
    for key in dict.fromkeys((r["algo"], r["K"], r["correction"]) for r in runs):
        rs = [r for r in runs if (r["algo"], r["K"], r["correction"]) == key]
        v = [r["last20"] for r in rs]
        lines.append(f"| {key[0]} | {key[1]} | {'yes' if key[2] else 'no'} | {np.mean(v):.1f} ± {np.std(v):.1f} "
                     f"| {np.mean([r['mean_lag'] for r in rs]):.1f} | {rs[0]['updates']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default="HalfCheetah-v5")
    ap.add_argument("--steps", type=int, default=1_000_000, help="env steps per run")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 4, 16], help="policy versions of lag")
    ap.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS)
    ap.add_argument("--decoupled", action="store_true",
                    help="AGRO/TBA as a real decoupled run over Kafka, actors K versions behind (KAFKA_BROKERS)")
    ap.add_argument("--no-ablation", action="store_true", help="only the corrected runs")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="default: runs/bench-staleness/<time>")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.decoupled and "ppo" in args.algos:
        ap.error("--decoupled runs AGRO and TBA (--algos agro tba): decoupled PPO's lag is its flow's, not K")
    bootstrap = Environment.read().kafka_brokers or DEFAULT_BOOTSTRAP
    out = args.out or Path("runs/bench-staleness") / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    runs = []
    for a in args.algos:
        for K in args.ks:
            for corr in ((True,) if args.no_ablation else (True, False)):
                for seed in args.seeds:
                    r = (run_decoupled_one(a, args.env, K, corr, args.steps, seed, bootstrap) if args.decoupled
                         else run_one(a, args.env, K, corr, args.steps, seed))
                    runs.append(r)
                    print(json.dumps({k: v for k, v in r.items() if k != "curve"}), flush=True)
    md = table(runs)
    doc = {"bench": "staleness", "mode": "decoupled" if args.decoupled else "in-process", "env": args.env, "steps_per_run": args.steps, "seeds": args.seeds, "ks": args.ks,
           "host": host_info(threads=args.threads),
           "total_wall_s": round(time.perf_counter() - t0, 1), "table": md, "runs": runs}
    (out / "staleness.json").write_text(json.dumps(doc))
    (out / "staleness.md").write_text(md + "\n")
    plot(runs, out / "staleness.png")
    print(md)
    print(json.dumps({"out": str(out)}))


if __name__ == "__main__":
    main()
