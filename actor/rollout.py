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
                                                                 config.wrappers)
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
        cfg, spec = self.config, self.spec
        N = cfg.num_envs
        if cfg.group_size > 0:
            self.reset()
        obs_buf = np.empty((T, N, spec.obs_dim), np.float32)
        act_buf = np.empty((T, N, spec.act_dim), np.float32)
        rew_buf = np.empty((T, N), np.float32)
        term_buf = np.empty((T, N), bool)
        trunc_buf = np.empty((T, N), bool)
        logp_buf = np.empty((T, N), np.float32)
        final_idx: list[int] = []
        final_obs: list[np.ndarray] = []
        ep_returns: list[float] = []
        ep_lengths: list[int] = []
        obs = self._obs
        grouped = cfg.group_size > 0
        swap_every = cfg.swap_every if newer is not None and not grouped else 0
        swap_s = cfg.swap_every_s
        clock = time.perf_counter
        look_at = clock() + swap_s  # the next look by time
        step_versions: np.ndarray | None = None  # per step, once a version changed in flight
        sampler = self._sampler_of(policy, version)  # numpy inference; None: Policy.act per step
        if sampler is not None:
            noise, logp_buf = sampler.noise((T, N), self._gen)
        rollout_done = np.zeros(N, bool)  # group mode: the column's first episode has ended
        for t in range(T):
            obs_buf[t] = obs
            if sampler is not None:
                a_np = act_buf[t] = sampler.sample(obs, noise[t])
            else:
                with torch.no_grad():
                    a, logp, _ = policy.act(torch.from_numpy(obs), generator=self._gen)
                a_np = a.numpy()
                act_buf[t] = a_np
                logp_buf[t] = logp.numpy()
            nobs, rew, term, trunc, info = self.env.step(spec.to_env(a_np))
            nobs = np.asarray(nobs, dtype=np.float32)
            rew = np.asarray(rew, dtype=np.float32)
            if not np.isfinite(rew).all():
                raise NonFiniteEnvError("reward", t, np.flatnonzero(~np.isfinite(rew)).tolist())
            if not np.isfinite(nobs).all():
                raise NonFiniteEnvError("observation", t, np.flatnonzero(~np.isfinite(nobs).all(-1)).tolist())
            rew_buf[t], term_buf[t], trunc_buf[t] = rew, term, trunc
            self._ep_return += rew
            self._ep_len += 1
            done = np.logical_or(term, trunc)
            if done.any():
                fo = info.get("final_obs")
                for i in np.flatnonzero(done):
                    if trunc[i] and not term[i]:
                        f = np.asarray(fo[i], dtype=np.float32)
                        if not np.isfinite(f).all():
                            raise NonFiniteEnvError("final observation", t, [int(i)])
                        final_idx.append(t * N + int(i))
                        final_obs.append(f)
                    if not (grouped and rollout_done[i]):
                        ep_returns.append(float(self._ep_return[i]))
                        ep_lengths.append(int(self._ep_len[i]))
                    self._ep_return[i] = 0.0
                    self._ep_len[i] = 0
            obs = nobs
            if swap_every and t + 1 < T and ((t + 1) % swap_every == 0 or clock() >= look_at):
                look_at = clock() + swap_s
                got = newer()
                if got is not None:
                    new_policy, new_version = got
                    new_sampler = self._sampler_of(new_policy, new_version)
                    if cfg.inflight and (sampler is None) == (new_sampler is None):
                        # in flight: steps t+1.. act with the new version, in this fragment
                        if step_versions is None:
                            step_versions = np.full(T, version, np.int64)
                        step_versions[t + 1:] = new_version
                        if sampler is not None:  # the same noise, under the new version's std
                            logp_buf[t + 1:] = new_sampler.logp(noise[t + 1:])
                        policy, sampler = new_policy, new_sampler
                        self.inflight_swaps += 1
                        continue
                    # end this fragment here (it keeps its one behaviour version) so the next
                    # steps act with the new one at once
                    T = t + 1
                    obs_buf, act_buf, rew_buf = obs_buf[:T], act_buf[:T], rew_buf[:T]
                    term_buf, trunc_buf, logp_buf = term_buf[:T], trunc_buf[:T], logp_buf[:T]
                    if step_versions is not None:
                        step_versions = step_versions[:T]
                    self.cut_fragments += 1
                    break
            if grouped:
                rollout_done |= done
                if rollout_done.all() and t + 1 < T:
                    # every rollout is complete: the remaining steps would be masked out anyway
                    T = t + 1
                    obs_buf, act_buf, rew_buf = obs_buf[:T], act_buf[:T], rew_buf[:T]
                    term_buf, trunc_buf, logp_buf = term_buf[:T], trunc_buf[:T], logp_buf[:T]
                    break
        self._obs = obs
        group_ids = None
        if grouped:
            groups = np.arange(N, dtype=np.int64) // cfg.group_size
            group_ids = seq * (N // cfg.group_size + 1) + groups
        return SampleBatch(
            batch_id=new_id(), actor_id=cfg.actor_id, seq=seq, env_id=cfg.env_id,
            policy_version=version, created_at_ms=now_ms(), obs=obs_buf, actions=act_buf,
            rewards=rew_buf, terminated=term_buf, truncated=trunc_buf, behaviour_logp=logp_buf,
            last_obs=obs.copy(), final_obs_index=np.asarray(final_idx, dtype=np.int64),
            final_obs=np.asarray(final_obs, dtype=np.float32).reshape(len(final_obs), spec.obs_dim),
            group_ids=group_ids, episode_returns=ep_returns, episode_lengths=ep_lengths,
            step_versions=step_versions,
        )

    def close(self) -> None:
        self.env.close()
