"""An environment package whose env goes wrong, importable by id from any process (a rollout
child included): ``faulty_envs:NaNPendulum-v0`` with this folder on sys.path. Pendulum that
returns a NaN observation at step 5 of each instance's first episode."""

from __future__ import annotations

import gymnasium as gym
import numpy as np


class NaNPendulum(gym.Wrapper):
    def __init__(self, at: int = 5) -> None:
        super().__init__(gym.make("Pendulum-v1"))
        self.at, self.t = at, 0

    def step(self, action):
        obs, r, term, trunc, info = self.env.step(action)
        self.t += 1
        if self.t == self.at:
            obs = obs.copy()
            obs[0] = np.nan
        return obs, r, term, trunc, info


gym.register("NaNPendulum-v0", entry_point=f"{__name__}:NaNPendulum")
