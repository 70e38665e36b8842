"""The actor: steps vector envs with the newest policy and publishes SampleBatch events.

    actor = Actor(config, subscriber, events, flow=flow)
    while not stop.is_set():
        actor.step()          # adopt a newer policy if one arrived, collect, publish

``flow`` (``actor.flow``; decoupled mode) decides when the next fragment may be collected and
how long it is: on-policy algorithms wait for a newer version after their share of a learner
batch, off-policy ones pause while the stream processors' backlog is high. ``step`` returns
None while held back, after waiting up to ``flow.poll_s`` for a version (or room).

Each SampleBatch is collected with ONE behaviour policy version (it is swapped only between
fragments), tagged with that version, the sampled (unclipped) actions and their log-probs, and
a per-actor ``seq``. NaN/inf from an env never reaches a topic: the fragment is discarded,
the envs reset, and the rejection counted and logged.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from actor.envs import NonFiniteEnvError, make_vector_env, spec_of
from actor.flow import Flow
from actor.inference import GaussianSampler
from actor.policy_client import PolicySubscriber
from schemas.events import SampleBatch, new_id, now_ms
from streams.events import EventBus
from streams.topics import SAMPLES_RAW


@dataclass(frozen=True)
class ActorConfig:
    actor_id: str = "actor-0"
    """Stable id; the record key of this actor's batches (per-actor order) and reorder key."""
    env_id: str = "HalfCheetah-v5"
    """Gymnasium env id."""
    num_envs: int = 1
    """Vector env width N."""
    fragment_steps: int = 2048
    """Steps per env in one SampleBatch (T); the batch holds T*N transitions."""
    seed: int = 0
    """Base seed of env resets and action noise."""
    group_size: int = 0
    """>0: group mode (GRPO/DAPO): each fragment resets all envs with one seed per group of this
    many envs, so a group's rollouts share a start state; group_ids are set. A column is one
    rollout: the fragment ends as soon as every column has finished its first episode (or after
    ``fragment_steps``), and only those first episodes are reported in the episode stats."""
    max_nonfinite: int = 10
    """Give up (raise) after this many consecutive fragments rejected for NaN/inf env output."""
    vector_mode: str = "sync"
    """gymnasium vectorization mode: sync or async (subprocess envs)."""
    wrappers: tuple[str, ...] = ()
    """Per-env wrappers by name (``actor.envs.WRAPPERS``)."""
    swap_every: int = 0
    """>0 (free-running off-policy actors): every this many steps, look for a newer policy and,
    if one arrived, end the fragment there so the new one acts at once; policy latency is then
    bounded by this many steps instead of a whole fragment. 0: swap only between fragments."""


class Actor:
    def __init__(self, config: ActorConfig, subscriber: PolicySubscriber, events: EventBus,
                 on_batch: Callable[[SampleBatch, float], None] | None = None,
                 on_reject: Callable[[NonFiniteEnvError], None] | None = None,
                 env=None, flow: Flow | None = None) -> None:
        self.config = config
        self.flow = flow
        self.subscriber = subscriber
        self.events = events
        self.on_batch = on_batch
        self.on_reject = on_reject
        self.env = env if env is not None else make_vector_env(config.env_id, config.num_envs, config.vector_mode,
                                                                 config.wrappers)
        self.spec = spec_of(self.env, config.env_id)
        self.seq = 0
        self.rejected = 0
        self._consecutive_rejects = 0
        self._seed_counter = 0
        self._gen = torch.Generator().manual_seed(config.seed)
        self._ep_return = np.zeros(config.num_envs)
        self._ep_len = np.zeros(config.num_envs, dtype=np.int64)
        self._obs = self._reset()
        self.steps = 0
        self.fragment_steps = config.fragment_steps
        self.swap_every = config.swap_every
        self.cut_fragments = 0  # fragments ended early for a new policy
        self._sampler_key: tuple[int, int] | None = None
        self._sampler: GaussianSampler | None = None

    def _reset(self) -> np.ndarray:
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
        return np.asarray(obs, dtype=np.float32)

    def adopt(self, timeout: float = 0.0) -> bool:
        """Adopt the newest policy version that arrived (waiting up to ``timeout`` for one); True
        if one was. ``step`` does it itself unless ``pinned``."""
        return self.subscriber.poll(timeout)

    def step(self, policy_timeout: float = 0.0, pinned: bool = False) -> SampleBatch | None:
        """Adopt a newer policy if any (waiting up to ``policy_timeout`` for the first one),
        collect one fragment and publish it (None: no policy yet, or the flow holds the actor
        back). The role protocol's step (``runtime.roles.Role``). ``pinned``: act with the
        version adopted already (co-located ``--overlap`` adopts between rounds, with ``adopt``,
        so a fragment's version never depends on when the learner's thread publishes)."""
        if not pinned or self.subscriber.policy is None:
            self.subscriber.poll(policy_timeout if self.subscriber.policy is None else 0.0)
        if self.subscriber.policy is None:
            return None
        flow = self.flow
        if flow is not None and not flow.allow(self.subscriber.version):
            self.subscriber.poll(flow.poll_s)  # a newer version ends the wait at once
            if not flow.allow(self.subscriber.version):
                return None
        steps = flow.fragment_steps(self.fragment_steps) if flow is not None else self.fragment_steps
        t0 = time.perf_counter()
        try:
            batch = self.collect(steps)
        except NonFiniteEnvError as e:
            self.rejected += 1
            self._consecutive_rejects += 1
            if self.on_reject is not None:
                self.on_reject(e)
            self._obs = self._reset()
            if self._consecutive_rejects >= self.config.max_nonfinite:
                raise RuntimeError(
                    f"{self.config.env_id}: {self._consecutive_rejects} consecutive fragments had "
                    f"non-finite env output; last: {e}"
                ) from e
            return None
        self._consecutive_rejects = 0
        self.events.publish(SAMPLES_RAW, batch, key=self.config.actor_id)
        self.seq += 1
        if flow is not None:
            flow.on_published(batch.num_steps, batch.policy_version)
        if self.on_batch is not None:
            self.on_batch(batch, time.perf_counter() - t0)
        return batch

    def _sampler_of(self, policy, version: int) -> GaussianSampler | None:
        """The numpy snapshot of the adopted version, taken once per version (not per fragment):
        only adoption changes the actor's module, so a version's snapshot stays exact."""
        if self._sampler_key != (id(policy), version):
            self._sampler_key, self._sampler = (id(policy), version), GaussianSampler.of(policy)
        return self._sampler

    def collect(self, T: int) -> SampleBatch:
        cfg, spec = self.config, self.spec
        N = cfg.num_envs
        policy, version = self.subscriber.policy, self.subscriber.version
        if cfg.group_size > 0:
            self._obs = self._reset()
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
            if (self.swap_every and not grouped and t + 1 < T and (t + 1) % self.swap_every == 0
                    and self.subscriber.poll(0.0)):
                # a newer policy arrived: end this fragment here (it keeps its one behaviour
                # version) so the next steps act with the new one at once
                T = t + 1
                obs_buf, act_buf, rew_buf = obs_buf[:T], act_buf[:T], rew_buf[:T]
                term_buf, trunc_buf, logp_buf = term_buf[:T], trunc_buf[:T], logp_buf[:T]
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
        self.steps += T * N
        group_ids = None
        if cfg.group_size > 0:
            groups = np.arange(N, dtype=np.int64) // cfg.group_size
            group_ids = self.seq * (N // cfg.group_size + 1) + groups
        return SampleBatch(
            batch_id=new_id(), actor_id=cfg.actor_id, seq=self.seq, env_id=cfg.env_id,
            policy_version=version, created_at_ms=now_ms(), obs=obs_buf, actions=act_buf,
            rewards=rew_buf, terminated=term_buf, truncated=trunc_buf, behaviour_logp=logp_buf,
            last_obs=obs.copy(), final_obs_index=np.asarray(final_idx, dtype=np.int64),
            final_obs=np.asarray(final_obs, dtype=np.float32).reshape(len(final_obs), spec.obs_dim),
            group_ids=group_ids, episode_returns=ep_returns, episode_lengths=ep_lengths,
        )

    def close(self) -> None:
        self.env.close()
        self.subscriber.close()

    def summary(self) -> dict:
        """What this actor did (the role protocol's summary)."""
        return {"role": "actor", "actor_id": self.config.actor_id, "steps": self.steps, "seq": self.seq,
                "rejected_fragments": self.rejected, "policy_versions_adopted": self.subscriber.adopted,
                "cut_fragments": self.cut_fragments,
                "startup_adoption_ms": None if (lat := self.subscriber.startup_latency_s) is None else round(lat * 1e3, 3)}
