"""An actor's envs and where they stand: the vector env, the current observations, the running
episode returns, the seed counter and the action-noise generator. ``collect`` steps them for one
fragment with a given policy version and returns it as a SampleBatch; the ``Actor`` decides when,
with which version, and publishes.

    rollout = Rollout(config)                      # in this process
    rollout = RolloutProcess(config)               # actor.rollout_process: the envs in a child process
    batch = rollout.collect(policy, version, T, seq)

Both give the same batches for the same config, policy and calls (tests/actor/test_rollout_process.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from actor.envs import NonFiniteEnvError, make_vector_env, spec_of
from actor.inference import GaussianSampler
from schemas.events import SampleBatch, new_id, now_ms


class Rollout:
    """The envs of one actor in this process. ``env``: an env to use instead of building one."""

    def __init__(self, config, env=None) -> None:
        self.config = config
        self.env = env if env is not None else make_vector_env(config.env_id, config.num_envs, config.vector_mode,
                                                                 config.wrappers, config.env_kwargs)
        self.spec = spec_of(self.env, config.env_id)
        self.cut_fragments = 0  # fragments ended early for a new policy (``collect``'s ``newer``)
        self.inflight_swaps = 0  # newer policies taken within a fragment (``config.inflight``)
        self._seed_counter = 0
        self._gen = torch.Generator().manual_seed(config.seed)
        self._ep_return = np.zeros(config.num_envs)
        self._ep_len = np.zeros(config.num_envs, dtype=np.int64)
        self._sampler_key: tuple[int, int] | None = None
        self._sampler: GaussianSampler | None = None
        self._obs: np.ndarray
        self.reset()

    def reset(self) -> None:
        """Reset every env with the next seeds (after a rejected fragment, and in group mode)."""
        cfg = self.config
        self._seed_counter += 1
        base = cfg.seed * 1_000_003 + self._seed_counter * cfg.num_envs
        if cfg.group_size > 0:
            seeds = [base + i // cfg.group_size for i in range(cfg.num_envs)]
        else:
            seeds = [base + i for i in range(cfg.num_envs)]
        obs, _ = self.env.reset(seed=seeds)
        self._ep_return[:] = 0
        self._ep_len[:] = 0
        self._obs = np.asarray(obs, dtype=np.float32)

    def _sampler_of(self, policy, version: int) -> GaussianSampler | None:
        """The numpy snapshot of the adopted version, taken once per version (not per fragment):
        only adoption changes the actor's module, so a version's snapshot stays exact."""
        if self._sampler_key != (id(policy), version):
            self._sampler_key, self._sampler = (id(policy), version), GaussianSampler.of(policy)
        return self._sampler

    def collect(self, policy, version: int, T: int, seq: int,
                newer: Callable[[], tuple[Any, int] | None] | None = None) -> SampleBatch:
        """One fragment of ``T`` steps per env with ``policy`` (tagged ``version`` and ``seq``).
        ``newer``: asked between env steps (every ``config.swap_every`` steps, and whenever
        ``config.swap_every_s`` has passed since it was last asked) for a newer adopted policy,
        as ``(policy, version)`` or None. With ``config.inflight`` the next steps act with it
        within this fragment (``step_versions``); without, the fragment ends there. Never asked
        in group mode. NonFiniteEnvError if an env returns NaN/inf (call ``reset`` then)."""
        cfg = self.config
        grouped = cfg.group_size > 0
        if grouped:
            self.reset()
        f = _Fragment(T, cfg.num_envs, self.spec, version)
        obs = self._obs
        swap_every = cfg.swap_every if newer is not None and not grouped else 0
        clock = time.perf_counter
        look_at = clock() + cfg.swap_every_s  # the next look by time
        sampler = self._sampler_of(policy, version)  # numpy inference; None: Policy.act per step
        if sampler is not None:
            noise, f.logp = sampler.noise((T, cfg.num_envs), self._gen)
        rollout_done = np.zeros(cfg.num_envs, bool)  # group mode: the column's first episode has ended
        for t in range(T):
            f.obs[t] = obs
            if sampler is not None:
                a_np = f.act[t] = sampler.sample(obs, noise[t])
            else:
                with torch.no_grad():
                    a, logp, _ = policy.act(torch.from_numpy(obs), generator=self._gen)
                a_np = f.act[t] = a.numpy()
                f.logp[t] = logp.numpy()
            obs, done = self._step(f, t, a_np, rollout_done if grouped else None)
            if swap_every and t + 1 < T and ((t + 1) % swap_every == 0 or clock() >= look_at):
                look_at = clock() + cfg.swap_every_s
                got = newer()
                if got is not None:
                    new_policy, new_version = got
                    new_sampler = self._sampler_of(new_policy, new_version)
                    if cfg.inflight and (sampler is None) == (new_sampler is None):
                        # in flight: steps t+1.. act with the new version, in this fragment
                        f.switch(t + 1, new_version)
                        if sampler is not None:  # the same noise, under the new version's std
                            f.logp[t + 1:] = new_sampler.logp(noise[t + 1:])
                        policy, sampler = new_policy, new_sampler
                        self.inflight_swaps += 1
                        continue
                    # end this fragment here (it keeps its one behaviour version) so the next
                    # steps act with the new one at once
                    f.cut(t + 1)
                    self.cut_fragments += 1
                    break
            if grouped:
                rollout_done |= done
                if rollout_done.all() and t + 1 < T:
                    # every rollout is complete: the remaining steps would be masked out anyway
                    f.cut(t + 1)
                    break
        self._obs = obs
        return f.batch(cfg, seq, obs)

    def _step(self, f: "_Fragment", t: int, a_np: np.ndarray,
              rollout_done: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Step the envs with ``a_np`` and record step ``t`` in ``f``: the reward and ends, and each
        episode that ended (its return, unless a grouped column already ended its rollout; a
        truncated one's final observation). Returns the next observations and which envs ended."""
        nobs, rew, term, trunc, info = self.env.step(self.spec.to_env(a_np))
        nobs = np.asarray(nobs, dtype=np.float32)
        rew = np.asarray(rew, dtype=np.float32)
        if not np.isfinite(rew).all():
            raise NonFiniteEnvError("reward", t, np.flatnonzero(~np.isfinite(rew)).tolist())
        if not np.isfinite(nobs).all():
            raise NonFiniteEnvError("observation", t, np.flatnonzero(~np.isfinite(nobs).all(-1)).tolist())
        f.rew[t], f.term[t], f.trunc[t] = rew, term, trunc
        self._ep_return += rew
        self._ep_len += 1
        done = np.logical_or(term, trunc)
        if done.any():
            fo = info.get("final_obs")
            for i in np.flatnonzero(done):
                if trunc[i] and not term[i]:
                    final = np.asarray(fo[i], dtype=np.float32)
                    if not np.isfinite(final).all():
                        raise NonFiniteEnvError("final observation", t, [int(i)])
                    f.final_idx.append(t * f.num_envs + int(i))
                    f.final_obs.append(final)
                if rollout_done is None or not rollout_done[i]:
                    f.ep_returns.append(float(self._ep_return[i]))
                    f.ep_lengths.append(int(self._ep_len[i]))
                self._ep_return[i] = 0.0
                self._ep_len[i] = 0
        return nobs, done

    def close(self) -> None:
        self.env.close()


class _Fragment:
    """The buffers of one fragment being collected: ``T`` steps x ``num_envs`` envs, the episodes
    that ended in it, and (once a newer version is taken in flight) each step's version."""

    def __init__(self, T: int, num_envs: int, spec, version: int) -> None:
        self.num_envs, self.obs_dim, self.version = num_envs, spec.obs_dim, version
        self.obs = np.empty((T, num_envs, spec.obs_dim), np.float32)
        self.act = np.empty((T, num_envs, spec.act_dim), np.float32)
        self.rew = np.empty((T, num_envs), np.float32)
        self.term = np.empty((T, num_envs), bool)
        self.trunc = np.empty((T, num_envs), bool)
        self.logp = np.empty((T, num_envs), np.float32)
        self.step_versions: np.ndarray | None = None  # per step, once a version changed in flight
        self.final_idx: list[int] = []
        self.final_obs: list[np.ndarray] = []
        self.ep_returns: list[float] = []
        self.ep_lengths: list[int] = []

    def switch(self, t: int, version: int) -> None:
        """Steps ``t``.. act with ``version``."""
        if self.step_versions is None:
            self.step_versions = np.full(len(self.obs), self.version, np.int64)
        self.step_versions[t:] = version

    def cut(self, T: int) -> None:
        """End the fragment after ``T`` steps."""
        self.obs, self.act, self.rew = self.obs[:T], self.act[:T], self.rew[:T]
        self.term, self.trunc, self.logp = self.term[:T], self.trunc[:T], self.logp[:T]
        if self.step_versions is not None:
            self.step_versions = self.step_versions[:T]

    def batch(self, cfg, seq: int, last_obs: np.ndarray) -> SampleBatch:
        group_ids = None
        if cfg.group_size > 0:
            groups = np.arange(self.num_envs, dtype=np.int64) // cfg.group_size
            group_ids = seq * (self.num_envs // cfg.group_size + 1) + groups
        return SampleBatch(
            batch_id=new_id(), actor_id=cfg.actor_id, seq=seq, env_id=cfg.env_id,
            policy_version=self.version, created_at_ms=now_ms(), obs=self.obs, actions=self.act,
            rewards=self.rew, terminated=self.term, truncated=self.trunc, behaviour_logp=self.logp,
            last_obs=last_obs.copy(), final_obs_index=np.asarray(self.final_idx, dtype=np.int64),
            final_obs=np.asarray(self.final_obs, dtype=np.float32).reshape(len(self.final_obs), self.obs_dim),
            group_ids=group_ids, episode_returns=self.ep_returns, episode_lengths=self.ep_lengths,
            step_versions=self.step_versions,
        )
