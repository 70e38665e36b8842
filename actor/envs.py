"""Gymnasium vector environments for actors (MuJoCo, classic control, or the user's own).

``env_id`` is any id ``gymnasium.make`` accepts, including Gymnasium's ``module:EnvId-v0`` form:
the module (e.g. a package that calls ``gymnasium.register`` on import) is imported first, in
every process that builds the env. ``wrappers`` names per-env wrappers from ``WRAPPERS``.
"""

from __future__ import annotations

import difflib
import importlib
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import gymnasium as gym
import numpy as np

#: Per-env wrappers selectable by name (``--wrappers a,b``), applied in the order given.
WRAPPERS: dict[str, Callable[[gym.Env], gym.Env]] = {
    "normalize_obs": gym.wrappers.NormalizeObservation,
    "normalize_reward": gym.wrappers.NormalizeReward,
    "clip_reward": lambda env: gym.wrappers.ClipReward(env, -10.0, 10.0),
    "flatten_obs": gym.wrappers.FlattenObservation,
}


class NonFiniteEnvError(RuntimeError):
    """The environment returned a NaN or inf observation or reward."""

    def __init__(self, what: str, step: int, envs: list[int]) -> None:
        self.what, self.step, self.envs = what, step, envs
        super().__init__(
            f"environment returned non-finite {what} at step {step} in env(s) {envs}; "
            "the fragment is discarded and the envs are reset"
        )

    def __reduce__(self):  # (crosses actor.rollout_process's pipe as itself)
        return type(self), (self.what, self.step, self.envs)


@dataclass(frozen=True)
class EnvSpec:
    env_id: str
    obs_dim: int
    act_dim: int
    act_low: np.ndarray
    act_high: np.ndarray
    nvec: tuple[int, ...] = ()
    """Discrete/MultiDiscrete actions: choices per component (categorical policy head); () for Box."""
    act_start: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Discrete actions: the space's ``start`` per component (env action = index + start)."""

    def to_env(self, actions: np.ndarray) -> np.ndarray:
        """Policy actions ``[N, act_dim]`` -> what ``env.step`` takes: clipped to the bounds (Box),
        or integer choices (Discrete: ``[N]``; MultiDiscrete: ``[N, act_dim]``)."""
        if not self.nvec:
            return np.clip(actions, self.act_low, self.act_high)
        idx = np.rint(actions).astype(np.int64) + self.act_start
        return idx[..., 0] if self.act_start.ndim == 0 else idx


def import_env_module(env_id: str) -> str:
    """Import the module of a ``module:EnvId`` id (it registers the env); return the bare id."""
    module, sep, name = env_id.rpartition(":")
    if not sep:
        return env_id
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"cannot import {module!r}, the module of environment {env_id!r}: {e}") from e
    return name


def registered_spec(env_id: str) -> gym.envs.registration.EnvSpec:
    """The registered spec of ``env_id`` (its module imported first); gym.error.Error if none."""
    return gym.spec(import_env_module(env_id))


def newest_version(env_id: str) -> str | None:
    """The newest registered id of ``env_id``'s family (``HalfCheetah-v5`` for ``HalfCheetah-v3``)."""
    name = import_env_module(env_id)
    base, dash, _ = name.rpartition("-v")
    family = base if dash else name
    versions = [(spec.version, key) for key, spec in gym.registry.items()
                if spec.name == family and spec.namespace is None and spec.version is not None]
    return max(versions)[1] if versions else None


#: MuJoCo's warnings about gymnasium's own model files (nothing a user of rlstream can change),
#: dropped where envs are made (``quiet_mujoco``): HalfCheetah's XML sets ``settotalmass``.
MUJOCO_NOISE: tuple[str, ...] = ("compiler attribute 'settotalmass' is deprecated",)
_quiet: list[bool] = []


def quiet_mujoco(env_id: str) -> None:
    """Before a MuJoCo env is made: once per process, a MuJoCo warning handler that drops the
    warnings of ``MUJOCO_NOISE`` and prints every other one as MuJoCo does (``WARNING: ...`` on
    stderr, without its MUJOCO_LOG.TXT in the working directory). A handler already set is kept."""
    if _quiet:
        return
    try:
        entry = registered_spec(env_id).entry_point
    except (gym.error.Error, ValueError):
        return
    if "mujoco" not in str(entry):
        return
    _quiet.append(True)
    import mujoco

    if mujoco.get_mju_user_warning() is not None:
        return

    def warn(message: str) -> None:
        if not message.startswith(MUJOCO_NOISE):
            print(f"WARNING: {message}", file=sys.stderr, flush=True)

    mujoco.set_mju_user_warning(warn)


class EnvKwargsError(ValueError):
    """The env loads, but not with these ``gymnasium.make`` keyword arguments."""


#: (env id, its keyword arguments) ``check_env_id`` has made in this process (the entry point checks before it starts).
_loads: set[tuple[str, str]] = set()


def check_env_id(env_id: str, env_kwargs: Mapping[str, Any] | None = None) -> None:
    """Make ``env_id`` (with ``env_kwargs``) once and close it; ``ValueError`` saying why it cannot
    be used, and what to use instead: for an old version that no longer loads (``HalfCheetah-v3``:
    mujoco-py), the newest; for an unknown id, the registered ids closest to it; for a keyword the
    env does not take, the env's error (``EnvKwargsError``)."""
    key = (env_id, repr(sorted((env_kwargs or {}).items())))
    if key in _loads:
        return
    try:
        with warnings.catch_warnings():  # gymnasium's "out of date" warning: the error below says it
            warnings.simplefilter("ignore", DeprecationWarning)
            quiet_mujoco(env_id)
            gym.make(import_env_module(env_id), **(env_kwargs or {})).close()
    except TypeError as e:  # a keyword argument the env's constructor does not take
        raise EnvKwargsError(f"cannot make environment {env_id!r} with {dict(env_kwargs or {})}: {e}") from e
    except (gym.error.Error, ImportError) as e:
        bare = import_env_module(env_id)
        newer = newest_version(env_id)
        if newer and newer != bare:
            hint = f"; use {newer}" + (", the same task on the maintained MuJoCo bindings (rlstream's presets and "
                                       "results are for it)" if "mujoco" in str(e).lower() else "")
        else:
            close = list(dict.fromkeys(newest_version(c) or c
                                       for c in difflib.get_close_matches(bare, list(gym.registry), n=5, cutoff=0.6)))
            hint = (f"; use {' or '.join(close[:2])} if that is what you meant" if close else
                    "; python -c 'import gymnasium; gymnasium.pprint_registry()' lists the registered ids")
            if close and isinstance(e, gym.error.NameNotFound):  # (gymnasium's own guess is the family only)
                e = gym.error.NameNotFound(f"no environment {bare!r} is registered")
        raise ValueError(f"cannot make environment {env_id!r}: {str(e).rstrip('.')}{hint}") from e
    _loads.add(key)


def wrapper_fns(names: Sequence[str]) -> list[Callable[[gym.Env], gym.Env]]:
    """The wrappers named ``names``; ValueError naming the choices for an unknown one."""
    unknown = [n for n in names if n not in WRAPPERS]
    if unknown:
        raise ValueError(f"unknown wrapper(s) {unknown}; choose from {sorted(WRAPPERS)}")
    return [WRAPPERS[n] for n in names]


def make_vector_env(env_id: str, num_envs: int, mode: str = "sync", wrappers: Sequence[str] = (),
                    env_kwargs: Mapping[str, Any] | None = None) -> gym.vector.VectorEnv:
    """A vector env of ``gymnasium.make(env_id, **env_kwargs)`` with same-step autoreset: a
    finished episode's true last observation is in ``info["final_obs"]`` and the returned obs is
    already the reset one."""
    fns = wrapper_fns(wrappers)
    import_env_module(env_id)
    quiet_mujoco(env_id)
    try:
        return gym.make_vec(
            env_id, num_envs=num_envs, vectorization_mode=mode,
            vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}, wrappers=fns or None,
            **(env_kwargs or {}),
        )
    except (gym.error.Error, ImportError, TypeError) as e:
        check_env_id(env_id, env_kwargs)  # the reason, with the version to use where an old one cannot load
        raise ValueError(f"cannot make environment {env_id!r}: {e}") from e


def spec_of(env: gym.vector.VectorEnv | gym.Env, env_id: str) -> EnvSpec:
    """The spaces of ``env`` (a vector env's single ones) as an EnvSpec; ValueError if unsupported."""
    obs_space = getattr(env, "single_observation_space", env.observation_space)
    act_space = getattr(env, "single_action_space", env.action_space)
    if not isinstance(obs_space, gym.spaces.Box) or len(obs_space.shape) != 1:
        raise ValueError(f"{env_id}: rlstream's policies need a flat Box observation space, not {obs_space} "
                         "(--wrappers flatten_obs flattens Discrete/Dict/Tuple observations)")
    obs_dim = int(obs_space.shape[0])
    if isinstance(act_space, gym.spaces.Discrete):
        return EnvSpec(env_id, obs_dim, 1, np.zeros(1, np.float32), np.full(1, act_space.n - 1, np.float32),
                       nvec=(int(act_space.n),), act_start=np.asarray(act_space.start, np.int64))
    if isinstance(act_space, gym.spaces.MultiDiscrete) and act_space.nvec.ndim == 1:
        nvec = tuple(int(n) for n in act_space.nvec)
        return EnvSpec(env_id, obs_dim, len(nvec), np.zeros(len(nvec), np.float32),
                       np.asarray(nvec, np.float32) - 1, nvec=nvec,
                       act_start=np.asarray(act_space.start, np.int64).reshape(len(nvec)))
    if not isinstance(act_space, gym.spaces.Box) or len(act_space.shape) != 1:
        raise ValueError(f"{env_id}: rlstream's policies need a flat Box, Discrete or MultiDiscrete "
                         f"action space, not {act_space}")
    return EnvSpec(env_id, obs_dim, int(act_space.shape[0]),
                   act_space.low.astype(np.float32), act_space.high.astype(np.float32))


def env_dims(env_id: str, wrappers: Sequence[str] = (), env_kwargs: Mapping[str, Any] | None = None) -> EnvSpec:
    env = make_vector_env(env_id, 1, wrappers=wrappers, env_kwargs=env_kwargs)
    try:
        return spec_of(env, env_id)
    finally:
        env.close()
