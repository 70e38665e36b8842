"""The one place components are wired (Acme builders): every role gets its collaborators here
and never imports another role. Co-located and decoupled mode use the same builders."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from actor.actor import Actor, ActorConfig
from actor.envs import NonFiniteEnvError, env_dims
from actor.policy_client import PolicySubscriber
from learner.learner import Learner, LearnerConfig
from rlstream.config import BusConfig, TrainConfig
from runtime.metrics import Metrics
from streams.policies import open_blob_store
from schemas.codec import Codec, SchemaTopic
from schemas.events import SampleBatch
from streams.bus import Bus, make_bus
from streams.events import EventBus
from streams.topics import LEARNER_GROUP, SAMPLES_PREPARED, SAMPLES_RAW, SCHEMAS, STREAMS_GROUP, all_topics


def build_bus(cfg: BusConfig) -> Bus:
    """The bus of ``cfg`` in its namespace (roles use logical topic names), every topic created."""
    if cfg.kind == "memory":
        bus = make_bus("memory", path=cfg.log_dir)
    elif cfg.kind == "kafka":
        bus = make_bus("kafka", bootstrap=cfg.bootstrap)
    else:
        raise ValueError(f"unknown bus {cfg.kind!r}")
    ns = cfg.topics()
    if ns.name:
        from streams.bus.namespaced import NamespacedBus

        bus = NamespacedBus(bus, ns)
    bus.create_topics(all_topics(cfg.partitions, cfg.retention))
    return bus


def build_events(bus: Bus, metrics: Metrics | None, publish_schemas: bool = True) -> EventBus:
    codec = Codec(resolver=SchemaTopic(bus, SCHEMAS))
    hook = skip = None
    if metrics is not None:
        hook, skip = metrics.count_dead_letter, metrics.count_skipped
    events = EventBus(bus, codec, on_dead_letter=hook, on_skip=skip)
    if publish_schemas:
        SchemaTopic(bus, SCHEMAS).publish(codec.registry)
    return events


def build_blob_store(cfg: TrainConfig):
    """The claim-check store of the run (None without Redis), behind the host blob cache."""
    return open_blob_store(cfg.redis(), cfg.blob_cache_dir())


def build_algo(cfg: TrainConfig, obs_dim: int, act_dim: int, nvec: tuple[int, ...] = ()):
    """The algorithm of ``cfg``; ``nvec``: discrete action choices (categorical policy head)."""
    from agents.registry import make_algorithm

    overrides = dict(cfg.algo_overrides)
    if nvec:
        overrides["action_nvec"] = tuple(nvec)
    overrides.setdefault("seed", cfg.seed)
    if cfg.algo == "ppo" and "total_updates" not in overrides:
        overrides["total_updates"] = max(1, cfg.total_steps // cfg.train_batch_size)
    torch.manual_seed(cfg.seed)
    return make_algorithm(cfg.algo, obs_dim, act_dim, overrides, cfg.device)


def group_size(cfg: TrainConfig) -> int:
    """Envs per start-state group (0: none); the per-algorithm default is ``agents.defaults.ALGO_DEFAULTS``."""
    return cfg.group_size or 0


def is_on_policy(algo: str) -> bool:
    """Whether ``algo`` assumes fresh data (its row of ``agents.defaults.ALGO_DEFAULTS``)."""
    from agents.defaults import algo_defaults

    return algo_defaults(algo).on_policy


# Free-running actors look for a newer policy every this many steps (see ActorConfig.swap_every).
SWAP_EVERY = 16


def build_flow(cfg: TrainConfig, bus: Bus, metrics: Metrics | None, log=None):
    """The flow control of a decoupled actor (``actor.flow``): on-policy algorithms wait for a
    newer version after their share of a learner batch; off-policy ones free-run under
    backpressure from the stream processors' backlog, with a dynamic fragment length unless
    ``fragment_steps`` is fixed. Both wait for the learner once they are
    ``cfg.steps_ahead_bound()`` env steps ahead of it while more than ``cfg.max_backlog`` records
    wait for the processors and the learner, and stop at ``cfg.actor_budget()`` (``LearnerGate``)."""
    from actor.flow import LearnerGate

    def on_stall(version: int, ahead: int) -> None:
        if log is not None:
            log.warning("learner_stalled", version=version, steps_ahead=ahead,
                        note="the policy version has not advanced; waiting for the learner")

    def backlog() -> float:  # records the processors and the learner have not consumed
        return float(bus.group_lag(STREAMS_GROUP, SAMPLES_RAW) + bus.group_lag(LEARNER_GROUP, SAMPLES_PREPARED))

    return LearnerGate(_inner_flow(cfg, bus, metrics, log), cfg.steps_ahead_bound(), cfg.num_envs,
                       budget=cfg.actor_budget(), backlog=backlog, max_backlog=cfg.max_backlog, on_stall=on_stall)


def _inner_flow(cfg: TrainConfig, bus: Bus, metrics: Metrics | None, log=None):
    from actor.flow import Backpressure, OnPolicySync

    if is_on_policy(cfg.algo):
        def on_timeout(version: int, waited: float) -> None:
            if log is not None:
                log.warning("policy_wait_timeout", version=version, waited_s=round(waited, 2),
                            note="no newer policy version; sending one more fragment under this one")

        return OnPolicySync(cfg.batches_per_version(), cfg.policy_wait_s, on_timeout=on_timeout)

    def backlog() -> float:
        return float(bus.group_lag(STREAMS_GROUP, SAMPLES_RAW))

    sizes = None
    if not cfg.fixed_fragments and not cfg.fragment_steps:
        from learner.batch_size import BatchSizeController

        sizes = BatchSizeController()
    on_size = metrics.set_batch_size if metrics is not None else None
    return Backpressure(backlog, max_backlog=cfg.max_backlog, sizes=sizes, on_size=on_size)


def actor_seed(run_seed: int, index: int) -> int:
    """Base seed of actor ``index``'s env resets and action noise (``rlstream lineage`` reports it)."""
    return run_seed * 7919 + index


def build_actor(cfg: TrainConfig, events: EventBus, metrics: Metrics | None, index: int,
                on_batch=None, log=None, flow=None, on_latency=None, actor_id: str | None = None) -> Actor:
    """Actor ``index`` (its seed; its id ``actor-<index>`` unless ``actor_id`` is given)."""
    actor_id = actor_id or f"actor-{index}"
    extra_latency = on_latency

    def on_latency(s: float) -> None:
        if metrics is not None:
            metrics.observe_policy_latency(s)
        if extra_latency is not None:
            extra_latency(s)

    def on_reject(e: NonFiniteEnvError) -> None:
        if metrics is not None:
            metrics.count_drop("env_nonfinite")
        if log is not None:
            log.error("env_output_rejected", error=str(e), what=e.what, step=e.step, envs=e.envs)

    def batch_hook(batch: SampleBatch, seconds: float) -> None:
        if metrics is not None:
            metrics.count_samples(batch.size, "actor")
        if on_batch is not None:
            on_batch(batch, seconds)

    blob = build_blob_store(cfg)
    sub = PolicySubscriber(events, policy_id=cfg.policy_id, stage=actor_id, on_latency=on_latency,
                           blob_store=blob, lag=cfg.actor_lag_versions)
    g = group_size(cfg)
    num_envs = cfg.num_envs
    if g and num_envs % g:
        raise ValueError(f"--num-envs {num_envs} must be a multiple of the group size {g} for {cfg.algo}")
    acfg = ActorConfig(actor_id=actor_id, env_id=cfg.env_id, num_envs=num_envs,
                       fragment_steps=cfg.effective_fragment_steps(), seed=actor_seed(cfg.seed, index),
                       group_size=g, wrappers=tuple(cfg.wrappers), swap_every=SWAP_EVERY if (cfg.mode == "decoupled" and not g
                                                               and not is_on_policy(cfg.algo)) else 0)
    return Actor(acfg, sub, events, on_batch=batch_hook, on_reject=on_reject, flow=flow)


def build_prepare_worker(cfg: TrainConfig, events: EventBus, metrics: Metrics | None):
    """The in-process shell of the stream processors (co-located mode; the Faust app is the
    other shell of the same ``Prepare``)."""
    from streams.processors.importance import PolicyLogpFn
    from streams.processors.pipeline import Prepare
    from streams.worker import PrepareWorker

    blob = build_blob_store(cfg)  # claim-checked weights get IS too
    prepare = Prepare.from_config(cfg.prepare_config(), PolicyLogpFn.factory(blob), metrics=metrics)
    return PrepareWorker(events, prepare, metrics=metrics)


def build_learner(cfg: TrainConfig, events: EventBus, metrics: Metrics | None, algo, on_update=None,
                  breaker=None, lag_signal=None, parallel=None) -> Learner:
    from learner.snapshots import open_store

    store = open_store(cfg.snapshot_url())

    def update_hook(learner: Learner, m: dict[str, float], seconds: float) -> None:
        if metrics is not None:
            metrics.count_learner_steps()
            metrics.set_policy_version(learner.version)
            metrics.observe_step_time(seconds, "update")
        if on_update is not None:
            on_update(learner, m, seconds)

    blob = build_blob_store(cfg)
    lcfg = LearnerConfig(algo=cfg.algo, train_batch_size=cfg.train_batch_size, snapshot_every=cfg.snapshot_every,
                         total_samples=cfg.total_steps,
                         env_id=cfg.env_id, policy_id=cfg.policy_id, run_id=cfg.effective_run_id(),
                         claim_check_above=cfg.claim_check_above)
    return Learner(lcfg, algo, events, snapshots=store, breaker=breaker, lag_signal=lag_signal,
                   on_update=update_hook, blob_store=blob, parallel=parallel)


@dataclass
class EnvInfo:
    obs_dim: int
    act_dim: int
    nvec: tuple[int, ...] = ()
    """Discrete actions: choices per component (pass to ``build_algo``)."""


def env_info(cfg: TrainConfig) -> EnvInfo:
    spec = env_dims(cfg.env_id, cfg.wrappers)
    return EnvInfo(spec.obs_dim, spec.act_dim, spec.nvec)


def describe(cfg: TrainConfig) -> dict[str, Any]:
    return {"mode": cfg.mode, "algo": cfg.algo, "env": cfg.env_id, "wrappers": list(cfg.wrappers),
            "total_steps": cfg.total_steps,
            "num_actors": cfg.num_actors, "num_envs": cfg.num_envs,
            "fragment_steps": cfg.effective_fragment_steps(), "train_batch_size": cfg.train_batch_size,
            "group_size": group_size(cfg)}
