"""Gymnasium vector environments for actors (MuJoCo or classic control)."""

from __future__ import annotations

from dataclasses import dataclass

import gymnasium as gym
import numpy as np


class NonFiniteEnvError(RuntimeError):
    """The environment returned a NaN or inf observation or reward."""

    def __init__(self, what: str, step: int, envs: list[int]) -> None:
        self.what, self.step, self.envs = what, step, envs
        super().__init__(
            f"environment returned non-finite {what} at step {step} in env(s) {envs}; "
            "the fragment is discarded and the envs are reset"
        )


@dataclass(frozen=True)
class EnvSpec:
    env_id: str
    obs_dim: int
    act_dim: int
    act_low: np.ndarray
    act_high: np.ndarray


def make_vector_env(env_id: str, num_envs: int, mode: str = "sync") -> gym.vector.VectorEnv:
    """A vector env with same-step autoreset: a finished episode's true last observation is in
    ``info["final_obs"]`` and the returned obs is already the reset one."""
    try:
        return gym.make_vec(
            env_id, num_envs=num_envs, vectorization_mode=mode,
            vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
        )
    except gym.error.Error as e:
        raise ValueError(f"cannot make environment {env_id!r}: {e}") from e


def spec_of(env: gym.vector.VectorEnv, env_id: str) -> EnvSpec:
    obs_space, act_space = env.single_observation_space, env.single_action_space
    if not isinstance(act_space, gym.spaces.Box) or not isinstance(obs_space, gym.spaces.Box):
        raise ValueError(f"{env_id}: rlstream's policies need Box observation and action spaces")
    if len(obs_space.shape) != 1 or len(act_space.shape) != 1:
        raise ValueError(f"{env_id}: flat observation and action vectors are required")
    return EnvSpec(env_id, int(obs_space.shape[0]), int(act_space.shape[0]),
                   act_space.low.astype(np.float32), act_space.high.astype(np.float32))


def env_dims(env_id: str) -> EnvSpec:
    env = make_vector_env(env_id, 1)
    try:
        return spec_of(env, env_id)
    finally:
        env.close()
