"""A user's own environment package, as the test suite ships it: importing this module
registers ``Corridor-v0`` (Discrete actions), as a package's ``__init__`` would. Used as
``--env user_envs:Corridor-v0`` with this folder on PYTHONPATH."""

from __future__ import annotations

import gymnasium as gym
import numpy as np


class Corridor(gym.Env):
    """Walk right to the end of a corridor of ``length`` cells: action 1 right, 0 left;
    reward 1 at the end (terminated), -0.01 per step otherwise."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(self, length: int = 8, render_mode: str | None = None) -> None:
        self.length = length
        self.render_mode = render_mode
        self.observation_space = gym.spaces.Box(-1.0, 2.0, shape=(2,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.pos = 0

    def _obs(self) -> np.ndarray:
        return np.array([self.pos / self.length, 1.0], dtype=np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.pos = 0
        return self._obs(), {}

    def step(self, action):
        self.pos = max(0, self.pos + (1 if int(action) == 1 else -1))
        done = self.pos >= self.length
        return self._obs(), (1.0 if done else -0.01), done, False, {}

    def render(self) -> np.ndarray:
        frame = np.zeros((16, 16 * (self.length + 1), 3), np.uint8)
        frame[:, 16 * self.pos:16 * (self.pos + 1)] = 255
        return frame


gym.register("Corridor-v0", entry_point=f"{__name__}:Corridor", max_episode_steps=40)
