"""``rlstream eval RUN``: mean and std of the episode return of any recorded policy version.

    result = evaluate("runs/latest", version=12, episodes=10, deterministic=True)
    # {"version": 12, "source": "log", "env": "CartPole-v1", "mean": 500.0, "std": 0.0, ...}

The weights come from the run's event log (``RUN/log``, every version ever published), or
else from its snapshots (``RUN/snapshots``), or else from a policy saved whole (a DPO replay's
``RUN/policy.safetensors``, version 0); no version: the newest. The env is the one the
run trained on (``summary.json`` or the snapshot's metadata) unless ``env_id`` is given.
``video_dir``: the first episode is rendered offscreen (``rgb_array``; MuJoCo needs
``MUJOCO_GL=egl`` or ``osmesa``) and written there as an MP4 (or a GIF without ffmpeg).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from actor.envs import import_env_module, quiet_mujoco, spec_of, wrapper_fns
from agents.networks import Policy


class EvalError(RuntimeError):
    """The run, version or env to evaluate cannot be found or built."""


def _from_log(log_dir: Path, version: int | None) -> tuple[int, Policy] | None:
    from config import BusConfig
    from logtools.subscribe import PolicyFeed

    if not (log_dir / "_topics.json").exists():
        return None
    feed = PolicyFeed(BusConfig(kind="memory", log_dir=str(log_dir)), from_version=version, dead_letter=False)
    try:
        for update in feed.updates(idle_timeout=1.0):
            if version is None or update.version == version:
                return update.version, update.policy
            if update.version > version:
                return None
    finally:
        feed.close()
    return None


def _from_snapshots(store_dir: Path, version: int | None) -> tuple[int, Policy, dict] | None:
    from learner.snapshots.url import open_store
    from streams.policies import policy_from_arch

    if not store_dir.is_dir():
        return None
    store = open_store(str(store_dir), keep_last=None)
    version = store.latest() if version is None else version
    if version is None or version not in store.versions():
        return None
    weights, meta = store.load(version)
    if not isinstance(meta.get("arch"), dict):
        raise EvalError(f"snapshot {version} in {store_dir} records no architecture")
    policy = policy_from_arch(meta["arch"])
    policy.load_state_dict(weights, strict=True)
    return version, policy.eval(), meta


def _from_policy_file(path: Path, version: int | None) -> tuple[int, Policy] | None:
    """A trained policy saved whole (``policy.safetensors``: a DPO replay's run), as version 0."""
    from schemas.weights import decode_weights
    from streams.policies import policy_from_arch

    if version not in (None, 0) or not path.is_file():
        return None
    weights, arch = decode_weights(path.read_bytes())
    if not arch:
        raise EvalError(f"{path} records no architecture")
    policy = policy_from_arch(arch)
    policy.load_state_dict(weights, strict=True)
    return 0, policy.eval()


def load_version(run_dir: Path, version: int | None) -> tuple[int, Policy, str, dict]:
    """``(version, policy, source, snapshot meta)`` of ``run_dir``; EvalError if not recorded."""
    found = _from_log(run_dir / "log", version)
    if found is not None:
        return found[0], found[1].eval(), "log", {}
    snap = _from_snapshots(run_dir / "snapshots", version)
    if snap is not None:
        return snap[0], snap[1], "snapshots", snap[2]
    whole = _from_policy_file(run_dir / "policy.safetensors", version)
    if whole is not None:
        return whole[0], whole[1], "policy.safetensors", {}
    which = "any version" if version is None else f"version {version}"
    raise EvalError(f"{run_dir}: {which} is neither in its event log (log/), its snapshots (snapshots/) "
                    "nor a saved policy (policy.safetensors)")


def _run_env(run_dir: Path, meta: dict) -> tuple[str | None, list[str], dict[str, Any]]:
    """The env id, wrappers and ``gymnasium.make`` keyword arguments the run's summary records."""
    summary = run_dir / "summary.json"
    recorded = json.loads(summary.read_text()) if summary.exists() else {}
    return (recorded.get("env") or meta.get("env_id"), list(recorded.get("wrappers", [])),
            dict(recorded.get("env_kwargs") or {}))


def evaluate(run_dir: str | Path, version: int | None = None, episodes: int = 10, deterministic: bool = False,
             env_id: str | None = None, wrappers: Sequence[str] | None = None, video_dir: str | Path | None = None,
             seed: int = 0) -> dict[str, Any]:
    import gymnasium as gym

    run_dir = Path(run_dir)
    if episodes < 1:
        raise EvalError("--episodes must be >= 1")
    version, policy, source, meta = load_version(run_dir, version)
    recorded_env, recorded_wrappers, recorded_kwargs = _run_env(run_dir, meta)
    env_kwargs = recorded_kwargs if env_id in (None, recorded_env) else {}  # another env: its own defaults
    env_id = env_id or recorded_env
    if not env_id:
        raise EvalError(f"{run_dir} does not record its env: pass --env")
    wrappers = list(recorded_wrappers if wrappers is None else wrappers)
    import_env_module(env_id)
    quiet_mujoco(env_id)  # MuJoCo's model-file deprecation warnings are not the user's
    try:
        env = gym.make(env_id, render_mode="rgb_array" if video_dir else None, **env_kwargs)
    except (gym.error.Error, TypeError) as e:
        raise EvalError(f"cannot make environment {env_id!r} ({env_kwargs}): {e}") from e
    for fn in wrapper_fns(wrappers):
        env = fn(env)
    spec = spec_of(env, env_id)
    if (spec.obs_dim, spec.act_dim) != (policy.obs_dim, policy.act_dim):
        raise EvalError(f"version {version} is {policy.obs_dim}x{policy.act_dim}, {env_id} "
                        f"{spec.obs_dim}x{spec.act_dim}")
    gen = torch.Generator().manual_seed(seed)
    returns, lengths, frames = [], [], []
    try:
        for ep in range(episodes):
            obs, _ = env.reset(seed=seed + ep)
            total, n, done = 0.0, 0, False
            while not done:
                if video_dir and ep == 0:
                    frames.append(env.render())
                o = torch.as_tensor(np.asarray(obs, np.float32)).unsqueeze(0)
                a, _, _ = policy.act(o, deterministic=deterministic, generator=gen)
                obs, r, term, trunc, _ = env.step(spec.to_env(a.numpy())[0])
                total, n, done = total + float(r), n + 1, bool(term or trunc)
            returns.append(total)
            lengths.append(n)
    finally:
        env.close()
    out: dict[str, Any] = {
        "run": str(run_dir), "version": version, "source": source, "env": env_id, "env_kwargs": env_kwargs,
        "wrappers": wrappers,
        "episodes": episodes, "deterministic": deterministic,
        "mean": float(np.mean(returns)), "std": float(np.std(returns)),
        "returns": [round(r, 3) for r in returns], "mean_length": float(np.mean(lengths)),
    }
    if video_dir:
        out["video"] = write_video(frames, Path(video_dir), f"{env_id.replace(':', '_')}-v{version}")
    return out


def write_video(frames: list[np.ndarray], out_dir: Path, name: str, fps: int = 30, max_frames: int = 300) -> str:
    """Write RGB frames (at most ``max_frames``, evenly spaced) as ``name.mp4`` (imageio-ffmpeg)
    or else ``name.gif``; the path."""
    import imageio.v2 as imageio

    if not frames or frames[0] is None:
        raise EvalError("the environment rendered no frames (it has no rgb_array render mode)")
    frames = frames[::max(1, -(-len(frames) // max_frames))]
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        path = out_dir / f"{name}.mp4"
        imageio.mimwrite(path, frames, fps=fps, macro_block_size=1)
    except (ImportError, ValueError, RuntimeError):
        path = out_dir / f"{name}.gif"
        imageio.mimwrite(path, frames, duration=1000 / fps, loop=0)
    return str(path)


def format_result(r: dict[str, Any]) -> str:
    mode = "deterministic" if r["deterministic"] else "sampled"
    std = 0.0 if math.isnan(r["std"]) else r["std"]
    return (f"{r['env']} version {r['version']} ({r['source']}): return {r['mean']:.1f} +/- {std:.1f} "
            f"over {r['episodes']} episodes ({mode} actions)")
