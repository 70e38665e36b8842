"""The one place components are wired (Acme builders): every role gets its collaborators here
and never imports another role. Co-located and decoupled mode use the same builders, and build
each role into its process's harness the same way (``add_actor``, ``add_prepare_worker``,
``add_learner`` into an ``rlstream.harness.RoleProcess``: the role's hooks and how it closes)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from actor.actor import Actor, ActorConfig
from actor.backoff import DeliveryBackoff
from actor.envs import NonFiniteEnvError, env_dims
from actor.identity import actor_seed
from actor.policy_client import PolicySubscriber
from actor.rollout_process import RolloutProcess
from config import BusConfig, PrepareConfig, TrainConfig
from config.sections import LearnerSection
from config.env import RankEnv
from learner.learner import Learner, LearnerConfig
from learner.minibatch import MINIBATCH_SIZES, MinibatchController
from learner.replay import ReplayCache, ReplayConfig
from runtime.metrics import Metrics
from schemas.events import SampleBatch
from streams.bus import Bus, in_namespace, kafka_bus, open_bus
from streams.bus.kafka.produce_errors import PRODUCE_ERRORS
from streams.events import EventBus, event_bus, schema_codec
from streams.policies import BlobStore, open_blob_store
from streams.settings import EFFECTIVE_CONFIG_FILE, StreamsSettings
from streams.topics import SAMPLES_PREPARED, SAMPLES_RAW, STREAMS_GROUP

if TYPE_CHECKING:
    from rlstream.harness import RoleProcess


# Infrastructure of one setting comes from its own package; the roles below are assembled here.
build_bus = open_bus


def build_events(bus: Bus, metrics: Metrics | None = None, publish_schemas: bool = True) -> EventBus:
    """``event_bus``; the broker's produce errors of this process counted in ``metrics``
    (``rlstream_produce_errors_total``)."""
    if metrics is not None:
        PRODUCE_ERRORS.listen(metrics.count_produce_error)
    return event_bus(bus, metrics, publish_schemas=publish_schemas)


def build_blob_store(cfg: TrainConfig):
    """The claim-check store of the run (``deploy.redis_url``; None without Redis), behind the host blob cache."""
    return blob_store_of(cfg.redis(), cfg.deploy.blob_cache)


def blob_store_of(redis_url: str | None, cache: str | None):
    """The claim-check store of a tool (``REDIS_URL``, ``RLSTREAM_BLOB_CACHE`` at its entry point)."""
    from config.train import cache_dir_of

    return open_blob_store(redis_url, cache_dir_of(cache))


def build_algo(cfg: TrainConfig, obs_dim: int, act_dim: int, nvec: tuple[int, ...] = ()):
    """The algorithm of ``cfg``; ``nvec``: discrete action choices (categorical policy head)."""
    from agents.registry import algorithm_spec, make_algorithm, make_config

    overrides = dict(cfg.run.algo_overrides)
    if nvec:
        overrides["action_nvec"] = tuple(nvec)
    overrides.setdefault("seed", cfg.run.seed)
    updates = algorithm_spec(cfg.run.algo).updates_field  # e.g. PPO's learning-rate annealing
    if updates is not None and updates not in overrides:
        overrides[updates] = max(1, cfg.run.total_steps // cfg.learner.train_batch_size)
    torch.manual_seed(cfg.run.seed)
    if "capture_update" not in overrides:
        overrides["capture_update"] = capture_update(cfg, make_config(cfg.run.algo, overrides))
    return make_algorithm(cfg.run.algo, obs_dim, act_dim, overrides, cfg.learner.device)


def capture_update(cfg: TrainConfig, c) -> bool:
    """``cfg.learner.compile_update``, or its auto rule on the run's optimizer steps (``agents.capture``)
    for the algorithm config ``c``."""
    from agents.capture import pays_to_capture

    if cfg.learner.compile_update is not None:
        return bool(cfg.learner.compile_update)
    per_update = getattr(c, "update_epochs", 1) * getattr(c, "num_minibatches", 1)
    steps = max(1, cfg.run.total_steps // max(1, cfg.learner.train_batch_size)) * per_update
    ranks = cfg.learner.learners or len(str(cfg.learner.device).split(","))
    return pays_to_capture(cfg.run.algo, cfg.learner.device, steps, ranks)


def group_size(cfg: TrainConfig) -> int:
    """Envs per start-state group (0: none); the per-algorithm default is ``config.algos.ALGO_DEFAULTS``."""
    return cfg.actor.group_size or 0


def is_on_policy(algo: str) -> bool:
    """Whether ``algo`` assumes fresh data (its row of ``config.algos.ALGO_DEFAULTS``)."""
    from config.algos import algo_defaults

    return algo_defaults(algo).on_policy


# Free-running actors look for a newer policy every this many steps (see ActorConfig.swap_every).
SWAP_EVERY = 16


def build_flow(cfg: TrainConfig, bus: Bus, metrics: Metrics | None, log=None):
    """The flow control of a decoupled actor (``actor.flow``): on-policy algorithms wait for a
    newer version after their share of a learner batch; off-policy ones free-run under
    backpressure from the stream processors' backlog, with a dynamic fragment length unless
    ``fragment_steps`` is fixed. Both wait for the learner once they are
    ``cfg.steps_ahead_bound()`` env steps ahead of it while more than ``cfg.actor.max_backlog`` records
    wait for the processors and the learner, and stop at ``cfg.actor_budget()`` (``LearnerGate``)."""
    from actor.flow import LearnerGate

    def on_stall(version: int, ahead: int) -> None:
        if log is not None:
            log.warning("learner_stalled", version=version, steps_ahead=ahead,
                        note="the policy version has not advanced; waiting for the learner")

    def backlog() -> float:  # records the processors and the learner have not consumed
        return float(bus.group_lag(STREAMS_GROUP, SAMPLES_RAW) + bus.group_lag(cfg.bus.learner_group, SAMPLES_PREPARED))

    return LearnerGate(_inner_flow(cfg, bus, metrics, log), cfg.steps_ahead_bound(), cfg.actor.num_envs,
                       budget=cfg.actor_budget(), backlog=backlog, max_backlog=cfg.actor.max_backlog, on_stall=on_stall)


def _inner_flow(cfg: TrainConfig, bus: Bus, metrics: Metrics | None, log=None):
    from actor.flow import Backpressure, OnPolicySync

    if is_on_policy(cfg.run.algo):
        def on_timeout(version: int, waited: float) -> None:
            if log is not None:
                log.warning("policy_wait_timeout", version=version, waited_s=round(waited, 2),
                            note="no newer policy version; sending one more fragment under this one")

        return OnPolicySync(cfg.batches_per_version(), cfg.actor.policy_wait_s, on_timeout=on_timeout)

    def backlog() -> float:
        return float(bus.group_lag(STREAMS_GROUP, SAMPLES_RAW))

    sizes = None
    if not cfg.actor.fixed_fragments and not cfg.actor.fragment_steps:
        from actor.fragment_size import FragmentSizeController

        sizes = FragmentSizeController()
    on_size = metrics.set_fragment_length if metrics is not None else None
    return Backpressure(backlog, max_backlog=cfg.actor.max_backlog, sizes=sizes, on_size=on_size)


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
    sub = PolicySubscriber(events, policy_id=cfg.run.policy_id, stage=actor_id, on_latency=on_latency,
                           blob_store=blob, lag=cfg.actor.actor_lag_versions)
    acfg = actor_config(cfg, actor_id, index)
    # --actor.overlap: the envs in a child process, so collection runs beside the learner's update
    rollout = RolloutProcess(acfg) if cfg.actor.overlap else None
    backoff = DeliveryBackoff(on_backoff=metrics.observe_backoff if metrics is not None else None)
    return Actor(acfg, sub, events, on_batch=batch_hook, on_reject=on_reject, flow=flow, rollout=rollout,
                 backoff=backoff)


def actor_config(cfg: TrainConfig, actor_id: str, index: int) -> ActorConfig:
    """The one mapping of the run's ``actor`` section (and ``run``'s env and seed) onto actor
    ``index``'s ``ActorConfig``."""
    a, g = cfg.actor, group_size(cfg)
    if g and a.num_envs % g:
        raise ValueError(f"--actor.num-envs {a.num_envs} must be a multiple of the group size {g} for {cfg.run.algo}")
    free_running = cfg.mode == "decoupled" and not g and not is_on_policy(cfg.run.algo)
    return ActorConfig(actor_id=actor_id, env_id=cfg.run.env_id, num_envs=a.num_envs,
                       fragment_steps=cfg.effective_fragment_steps(), seed=actor_seed(cfg.run.seed, index),
                       group_size=g, wrappers=tuple(cfg.run.wrappers), env_kwargs=dict(cfg.run.env_kwargs),
                       swap_every=SWAP_EVERY if free_running else 0)


def learner_config(cfg: TrainConfig) -> LearnerConfig:
    """The one mapping of the run's ``learner`` section (and ``run``'s identity, ``deploy``'s
    claim-check size, the bus's group) onto the ``LearnerConfig``."""
    s = cfg.learner
    return LearnerConfig(algo=cfg.run.algo, train_batch_size=s.train_batch_size, snapshot_every=s.snapshot_every,
                         snapshot_interval_s=s.snapshot_interval_s, total_samples=cfg.run.total_steps,
                         env_id=cfg.run.env_id, policy_id=cfg.run.policy_id, run_id=cfg.effective_run_id(),
                         claim_check_above=cfg.deploy.claim_check_above, group=cfg.bus.learner_group)


def build_replay(cfg: TrainConfig) -> ReplayCache | None:
    """The learner's sample cache of the ``replay`` section (None: off; a fragment larger than the
    cache: a clear ``ValueError``, ``TrainConfig.replay_settings``)."""
    settings = cfg.replay_settings()
    return ReplayCache(ReplayConfig(**settings), seed=cfg.run.seed) if settings is not None else None


def build_prepare(cfg: PrepareConfig, blob_store: BlobStore | None, metrics: Metrics | None,
                  actor_state=None):
    """The stream processors (``Prepare``) of every shell: importance weights against any policy
    version, claim-checked ones through ``blob_store``; ``actor_state``: the Faust shell's table."""
    from streams.policies import PolicyLogpFn
    from streams.processors.pipeline import Prepare

    return Prepare.from_config(cfg, PolicyLogpFn.factory(blob_store), metrics=metrics, actor_state=actor_state)


def build_prepare_worker(cfg: TrainConfig, events: EventBus, metrics: Metrics | None):
    """The in-process shell of the stream processors (co-located mode; ``build_streams_worker``
    runs it as a process on Kafka, ``build_faust_app`` is the other shell of the same ``Prepare``)."""
    from streams.worker import PrepareWorker

    return PrepareWorker(events, build_prepare(cfg.prepare_config(), build_blob_store(cfg), metrics), metrics=metrics)


def streams_bus(settings: StreamsSettings, client_id: str) -> Bus:
    """A Kafka bus of a streams worker, in its namespace (no topic created)."""
    bus = BusConfig(kind="kafka", bootstrap=settings.brokers, replication=settings.replication,
                    security=dict(settings.client_config))
    return in_namespace(kafka_bus(bus, client_id), settings.namespace.name)


def build_streams_worker(settings: StreamsSettings, metrics: Metrics | None = None):
    """``python -m rlstream.entry worker``: the in-process shell as a process on Kafka, assembled as the
    Faust worker is (claim-check store, schema-resolving codec). Returns the worker and its bus."""
    from streams.worker import PrepareWorker

    bus = streams_bus(settings, "rlstream-streams-worker")
    blob = open_blob_store(settings.redis_url, settings.blob_cache)
    events = build_events(bus, metrics, publish_schemas=False)
    return PrepareWorker(events, build_prepare(settings.prepare, blob, metrics), metrics=metrics), bus


def build_faust_app(settings: StreamsSettings, metrics: Metrics | None = None):
    """The Faust shell (``streams.faust_app.StreamsApp``) of ``faust -A streams worker``: the same
    processors, claim-check store and schema-resolving codec as the other shells. A worker started
    from a run config records its effective settings in ``<run_dir>/streams.config.json``."""
    from config.runfile import write_run_config
    from streams.faust_app import StreamsApp

    metrics = metrics if metrics is not None else Metrics(role="streams", gpu=False)
    blob = open_blob_store(settings.redis_url, settings.blob_cache)
    codec = schema_codec(streams_bus(settings, f"{settings.app_id}-schemas"))
    app = StreamsApp(settings, metrics=metrics, codec=codec,
                     make_prepare=lambda state: build_prepare(settings.prepare, blob, metrics, actor_state=state))
    if settings.run_config is not None and settings.run_dir:
        write_run_config(settings.effective(), Path(settings.run_dir) / EFFECTIVE_CONFIG_FILE)
    return app


def build_backlog_breaker(section: LearnerSection, metrics: Metrics | None):
    """The decoupled learner's breaker over the stream processors' backlog on rl.samples.raw."""
    from learner.circuit_breaker import CircuitBreaker

    return CircuitBreaker(open_above=section.breaker_open_above, close_below=section.breaker_close_below, min_open_s=1.0,
                          on_change=metrics.circuit_breaker_hook() if metrics is not None else None)


def build_policy_breaker(cfg: TrainConfig, metrics: Metrics | None):
    """The learner's breaker over the policy lag it reads (``cfg.policy_lag_bound()``; None: off):
    open above the bound, closed again under half of it (the hysteresis band)."""
    from learner.circuit_breaker import CircuitBreaker

    bound = cfg.policy_lag_bound()
    if bound is None:
        return None
    return CircuitBreaker(open_above=bound, close_below=bound / 2, min_open_s=1.0,
                          on_change=metrics.circuit_breaker_hook() if metrics is not None else None)


def build_data_parallel(cfg: TrainConfig, algo, rank: RankEnv, stop: threading.Event):
    """The learner's data-parallel group when ``rank`` is one of several
    (``learner.distributed.DataParallel``, docs/explanation/learner-ranks.md); None alone."""
    if rank.world_size <= 1:
        return None
    from learner import distributed

    return distributed.DataParallel.from_env(algo, rank, cfg.learner.grad_compression, stop=stop.is_set)


def consumer_lag_gauge(metrics: Metrics, bus: Bus, group: str, topic: str):
    """The decoupled learner's lag signal: ``group``'s lag on ``topic``, also set as a metric."""
    def lag() -> float:
        value = float(bus.group_lag(group, topic))
        metrics.set_consumer_lag(group, topic, value)
        return value
    return lag


def build_learner(cfg: TrainConfig, events: EventBus, metrics: Metrics | None, algo, on_update=None,
                  breaker=None, lag_signal=None, parallel=None, gpu_util=None) -> Learner:
    """The learner of ``cfg``; ``breaker``/``lag_signal``: the backlog breaker (decoupled); the
    policy-lag breaker is built here, for both modes; ``gpu_util``: percent now, or None
    (the dynamic minibatch size's signal, ``--dynamic-batch``)."""
    from learner.snapshots.url import open_store

    store = open_store(cfg.snapshot_url(), keep_timed=cfg.learner.snapshot_keep_timed, object_store=cfg.object_store)

    def update_hook(learner: Learner, m: dict[str, float], seconds: float) -> None:
        if metrics is not None:
            metrics.count_learner_steps()
            metrics.set_policy_version(learner.version)
            metrics.observe_step_time(seconds, "update")
            for phase, s in learner.core.timing.last.items():  # the round's parts (LearnerCore.timing)
                metrics.observe_step_time(s, f"learner_{phase}")
            if "minibatch_size" in m:
                metrics.set_batch_size(int(m["minibatch_size"]))
            if "replay_cache_samples" in m:
                metrics.set_replay(m["replay_cache_samples"], m["replay_ratio"], m["replay_spi"])
        if on_update is not None:
            on_update(learner, m, seconds)

    blob = build_blob_store(cfg)
    lcfg = learner_config(cfg)
    replay = build_replay(cfg)
    control = None
    if cfg.learner.dynamic_batch:
        static = cfg.learner.train_batch_size // max(1, getattr(algo.config, "num_minibatches", 1))
        control = MinibatchController(initial=min(MINIBATCH_SIZES, key=lambda s: abs(s - static)))
    return Learner(lcfg, algo, events, snapshots=store, breaker=breaker, lag_signal=lag_signal,
                   on_update=update_hook, blob_store=blob, parallel=parallel,
                   policy_breaker=build_policy_breaker(cfg, metrics), replay=replay,
                   batch_control=control, gpu_util=gpu_util,
                   on_snapshot_failure=metrics.count_snapshot_failure if metrics is not None else None)


def set_threads(cfg: TrainConfig) -> None:
    """Torch's threads: one unless asked (a small MLP's update gains nothing from a second one on
    an idle machine and runs tens of times slower beside another busy process; config.train)."""
    torch.set_num_threads(cfg.deploy.torch_threads or 1)


def rank_config(cfg: TrainConfig, rank: RankEnv) -> TrainConfig:
    """``cfg`` as learner ``rank`` runs it: one of N data-parallel ranks takes its own device, and
    only rank 0 writes TensorBoard (docs/explanation/learner-ranks.md)."""
    if rank.world_size <= 1:
        return cfg
    from learner import distributed

    device = distributed.parse_devices(cfg.learner.device, cfg.learner.learners or rank.world_size)[rank.local_rank]
    return replace(cfg, learner=replace(cfg.learner, device=device),
                   run=replace(cfg.run, tensorboard=cfg.run.tensorboard if rank.rank == 0 else None))


def add_actor(proc: RoleProcess, cfg: TrainConfig, events: EventBus, metrics: Metrics | None, index: int, *,
              name: str | None = None, board: str | None = None, lag=None, flow=None) -> Actor:
    """Actor ``index`` (id ``name``, default ``actor-<index>``) held by ``proc``: its fragments
    counted in the progress and TensorBoard run ``board`` (default: its id) with policy lag
    ``lag(batch)`` (``RoleProcess.batch_hook``), its policy latencies in ``proc.latencies``."""
    name = name or f"actor-{index}"
    actor = build_actor(cfg, events, metrics, index, on_batch=proc.batch_hook(board or name, lag), log=proc.log,
                        flow=flow, on_latency=proc.latencies, actor_id=name)
    if proc.flush is not None:  # a decoupled actor's process: it waits in each round's flush (actor.backoff)
        proc.on_flush = actor.backoff.observe
        if metrics is not None:
            metrics.watch_unacknowledged(lambda: len(actor.acks.pending))
    return proc.add(name, actor)


def add_prepare_worker(proc: RoleProcess, cfg: TrainConfig, events: EventBus, metrics: Metrics | None):
    """The in-process stream processor (``build_prepare_worker``) held by ``proc`` as ``streams``."""
    return proc.add("streams", build_prepare_worker(cfg, events, metrics))


def add_learner(proc: RoleProcess, cfg: TrainConfig, events: EventBus, metrics: Metrics | None, *,
                name: str = "learner", rank: RankEnv | None = None, bus: Bus | None = None,
                stop: threading.Event | None = None) -> Learner:
    """The learner of ``cfg``, started (resumed with ``cfg.run.resume``) and held by ``proc``: its
    updates move the progress and the TensorBoard run ``learner``; it takes a last snapshot when
    it closes once the roles were driven (not after a lost peer). ``rank`` (decoupled): one of the
    run's ranks, with its data-parallel group (``build_data_parallel``), the backlog breaker and
    the stream processors' lag on ``bus`` as its signal; its progress counts samples trained."""
    info = env_info(cfg)
    algo = build_algo(cfg, info.obs_dim, info.act_dim, info.nvec)
    parallel = breaker = lag = None
    if rank is not None:
        parallel = build_data_parallel(cfg, algo, rank, stop or threading.Event())
        breaker = build_backlog_breaker(cfg.learner, metrics)
        lag = consumer_lag_gauge(metrics, bus, STREAMS_GROUP, SAMPLES_RAW) if metrics is not None else None
    learner = build_learner(cfg, events, metrics, algo, on_update=proc.update_hook(steps_trained=rank is not None),
                            breaker=breaker, lag_signal=lag, parallel=parallel,
                            gpu_util=proc.gpu.utilization if proc.gpu is not None else None)

    def close() -> None:
        if proc.ran and learner.snapshots is not None and learner.stats.updates and not learner.ranks.broken:
            learner.snapshot()  # (a lost peer: the last snapshot stands; a fenced learner's does nothing)
        learner.close()
        if parallel is not None:
            from learner import distributed

            distributed.close_group()

    proc.add(name, learner, close=close)
    learner.start(resume=cfg.run.resume)
    return learner


@dataclass
class EnvInfo:
    obs_dim: int
    act_dim: int
    nvec: tuple[int, ...] = ()
    """Discrete actions: choices per component (pass to ``build_algo``)."""


def env_info(cfg: TrainConfig) -> EnvInfo:
    spec = env_dims(cfg.run.env_id, cfg.run.wrappers, cfg.run.env_kwargs)
    return EnvInfo(spec.obs_dim, spec.act_dim, spec.nvec)


def task(cfg: TrainConfig) -> dict[str, Any]:
    """What a run trained, as its summary and start line say it: the algorithm, the env with its
    keyword arguments and wrappers, and the preset that ran (None: the algorithm's row only)."""
    return {"algo": cfg.run.algo, "env": cfg.run.env_id, "env_kwargs": dict(cfg.run.env_kwargs),
            "wrappers": list(cfg.run.wrappers), "preset": cfg.preset_name()}


def describe(cfg: TrainConfig) -> dict[str, Any]:
    return {"mode": cfg.mode, **task(cfg),
            "total_steps": cfg.run.total_steps,
            "num_actors": cfg.actor.num_actors, "num_envs": cfg.actor.num_envs,
            "fragment_steps": cfg.effective_fragment_steps(), "train_batch_size": cfg.learner.train_batch_size,
            "group_size": group_size(cfg)}
