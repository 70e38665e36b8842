"""The run's typed configuration (``TrainConfig``), parsed once at the entry point (``rlstream.cli``)
and passed down: nothing below the entry point reads the environment or argv."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, TypeVar, get_type_hints

import tyro

from config.algos import ALGO_DEFAULTS, PRESET_CHOICES, algo_defaults, env_preset
from config.bus import DEFAULT_LEARNER_GROUP, BusConfig, Replication, Retention
from config.env import Environment
from config.limits import DEFAULT_CLAIM_CHECK_ABOVE
from config.prepare import PrepareConfig
from config.storage import ObjectStoreConfig
from config.runfile import read_run_config, write_run_config

_T = TypeVar("_T")
#: A ``TrainConfig`` field the entry point sets from its shared flags (``rlstream.cli``), with
#: meanings beyond the field (environment fallbacks, run-directory layout), not a generated flag.
EntryPoint = Annotated[_T, tyro.conf.Suppress]


def episode_horizon(env_id: str, default: int = 1000) -> int:
    """The env's registered ``max_episode_steps`` (``default`` when it has none); a
    ``module:EnvId`` id imports its module first, as gymnasium does."""
    import importlib

    import gymnasium as gym

    module, sep, name = env_id.partition(":")
    if sep:
        importlib.import_module(module)
    try:
        steps = gym.spec(name if sep else env_id).max_episode_steps
    except gym.error.Error:
        return default
    return int(steps) if steps else default


def is_off(setting: str) -> bool:
    """Whether a blob-cache setting (``RLSTREAM_BLOB_CACHE``, ``--blob-cache``) turns the cache off."""
    return setting.strip().lower() in ("off", "none", "0")


def cache_dir_of(setting: str | None) -> str | None:
    """The host blob cache directory a setting (``--blob-cache``, ``RLSTREAM_BLOB_CACHE``) names:
    unset or blank -> ``default_cache_dir()``; ``off`` -> None (no cache); else the directory given."""
    if setting is None or not setting.strip():
        return default_cache_dir()
    return None if is_off(setting) else setting.strip()


def default_cache_dir() -> str:
    """The host blob cache's default directory: ``/dev/shm/rlstream-blobs-<uid>`` (memory-backed),
    or the same under the temp directory where /dev/shm is not writable."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return os.path.join(base, f"rlstream-blobs-{os.getuid()}")


#: Why ``--overlap`` is refused outside co-located mode (``run_decoupled`` and the CLI say it).
OVERLAP_COLOCATED_ONLY = ("--overlap applies to co-located mode only (decoupled actors and learner are separate "
                          "processes: they already collect and train at once)")


def overlap_overrides(algo: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` with the algorithm fields ``--overlap`` needs (its row's ``overlap``); a clear
    ``ValueError`` for an algorithm with no correction for the lag, or an override against it."""
    need = algo_defaults(algo).overlap
    if need is None:
        allowed = ", ".join(name for name, row in ALGO_DEFAULTS.items() if row.overlap is not None)
        raise ValueError(f"--overlap is not allowed for {algo}: it trains each fragment one policy version "
                         f"after the one that collected it, and {algo} has no correction for a lagged behaviour "
                         f"policy (allowed: {allowed}); run {algo} without --overlap")
    for key, value in need.items():
        if key in overrides and overrides[key] != value:
            raise ValueError(f"--overlap trains {algo} with {key}={json.dumps(value)} (its correction for the "
                             f"one-version lag); --set {key}={json.dumps(overrides[key])} contradicts it: drop one "
                             "of them")
    return {**overrides, **need}


#: A staleness window this wide means "never stale" (DPO's): no policy-lag breaker by default.
POLICY_LAG_UNBOUNDED = 1 << 20


#: The least value of each budget and size that means anything (None, where a field allows it,
#: is its default). ``TrainConfig`` refuses a config below one when it is made, so a bad flag
#: stops the command before anything is created or started.
AT_LEAST: dict[str, float] = {
    "total_steps": 1, "num_actors": 1, "num_envs": 1, "train_batch_size": 1, "fragment_steps": 0,
    "group_size": 0, "snapshot_every": 0, "log_every_s": 0, "learners": 1, "claim_check_above": 0,
    "policy_wait_s": 0, "max_batches_per_version": 0, "max_backlog": 0, "actor_steps": 0, "max_steps_ahead": 0,
    "torch_threads": 1, "stream_workers": 1, "max_restarts": 0, "replay_capacity": 1, "replay_max_reuse": 0,
    "replay_min_size": 0, "breaker_open_above": 0, "breaker_close_below": 0, "snapshot_keep_timed": 0,
    "snapshot_interval_s": 0, "actor_lag_versions": 0, "breaker_policy_lag_versions": 0,
}
#: Fields that must be above zero.
ABOVE_ZERO: tuple[str, ...] = ("replay_samples_per_insert",)


def check_bounds(cfg: Any) -> None:
    """``ValueError`` naming every field of ``cfg`` below its bound (``AT_LEAST``, ``ABOVE_ZERO``),
    as the flag that sets it: ``--total-steps must be >= 1, got 0``."""
    bad = []
    for name, least in AT_LEAST.items():
        value = getattr(cfg, name)
        if value is not None and value < least:
            bad.append(f"--{name.replace('_', '-')} must be >= {least:g}, got {value:g}")
    for name in ABOVE_ZERO:
        value = getattr(cfg, name)
        if value is not None and not value > 0:
            bad.append(f"--{name.replace('_', '-')} must be > 0, got {value:g}")
    if bad:
        raise ValueError("; ".join(bad))


@dataclass(frozen=True)
class TrainConfig:
    mode: EntryPoint[str] = "colocated"
    """colocated (one process, memory bus) or decoupled (processes over Kafka)."""
    algo: str = "ppo"
    """ppo, grpo, dapo, agro, tba."""
    env_id: Annotated[str, tyro.conf.arg(aliases=("--env", "--env-name"))] = "HalfCheetah-v5"
    """Gymnasium env id (``module:EnvId-v0`` imports the module first)."""
    wrappers: EntryPoint[tuple[str, ...]] = ()
    """Per-env gymnasium wrappers by name (``actor.envs.WRAPPERS``)."""
    preset: str = "auto"
    """Per-environment settings over the algorithm's row (``config.algos.ENV_PRESETS``): auto (the
    env's default preset, if the table has one), none, or a preset name (cleanrl, zoo). Flags and
    ``--set`` win over it."""
    total_steps: Annotated[int, tyro.conf.arg(aliases=("--total-timesteps",))] = 100_000
    """Environment steps to train for (summed over envs and actors)."""
    num_actors: int = 1
    """Actors (co-located: in-process; decoupled: processes)."""
    num_envs: int | None = None
    """Vector env width per actor; None: the algorithm's default (``config.algos.ALGO_DEFAULTS``)."""
    fragment_steps: int | None = None
    """Steps per env per SampleBatch; None: train_batch_size // (num_envs * num_actors), or the
    env's episode horizon in group mode (``effective_fragment_steps``)."""
    train_batch_size: int | None = None
    """Transitions per learner update; None: the algorithm's default."""
    seed: int = 0
    """Seed of envs, action noise and the learner."""
    group_size: int | None = None
    """Envs per start-state group (GRPO/DAPO; 0: no groups); None: the algorithm's default."""
    algo_overrides: EntryPoint[dict] = field(default_factory=dict)
    """Algorithm config fields to override (from --set key=value)."""
    run_dir: EntryPoint[Path] = Path("runs/latest")
    """Where snapshots, the summary and the plot go."""
    run_id: EntryPoint[str] = ""
    """Bound into logs and events; "": a random id, drawn once when the config is made."""
    snapshot_store: str | None = None
    """Snapshot store: a path, ``redis://...`` or ``s3://bucket/prefix`` (endpoint and credentials
    from ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``...; ``pip install 'rlstream[s3]'``); None:
    <run_dir>/snapshots."""
    snapshot_every: int = 10
    """Updates between snapshots (the store keeps the newest 10, ``?keep_last=N`` in its URL)."""
    snapshot_interval_s: float = 86_400.0
    """Seconds between time-based snapshots (daily by default), taken at the first update after
    the interval ran out since the store's newest one; kept by their own retention; 0: off."""
    snapshot_keep_timed: int = 7
    """Time-based snapshots kept, apart from the newest 10 (``?keep_timed=N`` in the URL wins)."""
    resume: bool = False
    """Resume from the newest snapshot (and committed offsets)."""
    plot: bool = True
    """Write <run_dir>/returns.png (return vs steps)."""
    tensorboard: EntryPoint[str | None] = None
    """TensorBoard log directory (each role writes its own run under it); None: off."""
    metrics_port: EntryPoint[int | None] = None
    """Prometheus/health port; None: the role default; -1: no server."""
    log_every_s: Annotated[float, tyro.conf.arg(aliases=("--log-every",))] = 5.0
    """Seconds between progress lines."""
    device: str = "cpu"
    """torch device of the learner: cpu, cuda, cuda:1, or one per rank, cuda:0,1,2,3."""
    compile_update: bool | None = None
    """Capture each minibatch step (forward, loss, backward, Adam) with torch.compile
    (``agents.capture``). None: auto, on where it pays (``agents.capture.pays_to_capture``: PPO or
    AGRO on one rank, in a run of twice the optimizer steps its compile takes to pay back, e.g.
    CleanRL's 1M-step PPO; docs/benchmarks.md). False: eager; True: always (any algorithm)."""
    learners: int | None = None
    """Data-parallel learner ranks (docs/explanation/learner-ranks.md); None: one per device of ``device``."""
    grad_compression: str = "none"
    """Gradient all-reduce between ranks: none, fp16 or bf16 (torch's DDP compress hooks)."""
    redis_url: str | None = None
    """Redis for claim-check weights (None: inline only)."""
    claim_check_above: int = DEFAULT_CLAIM_CHECK_ABOVE
    """With Redis: weights over this many bytes go by claim check (a tiny record fans out to
    the actors; each host fetches the blob once)."""
    blob_cache: str | None = None
    """Directory of the host's one verified copy of each claim-checked blob, shared by its
    processes (streams/blobcache.py); ``off``: each process fetches its own; None (and no
    ``RLSTREAM_BLOB_CACHE`` at the entry point): /dev/shm/rlstream-blobs-<uid>."""
    breaker_open_above: float = 256.0
    """Circuit breaker: pause training when the stream processors' backlog on rl.samples.raw
    (records) passes this; the learner would otherwise keep versioning ahead of stale data."""
    breaker_close_below: float = 32.0
    """Circuit breaker: resume once the backlog is back under this."""
    breaker_policy_lag_versions: int | None = None
    """Circuit breaker on policy lag (both modes): hold learner updates while the newest data it
    reads was collected more than this many versions behind its policy, and resume once that
    lag is under half of it; None: the staleness window K of the run's stream processors (data
    past it is dropped or down-weighted anyway, so training further ahead only wastes the
    actors' work), off under ``actor_lag_versions`` (stale on purpose); 0: off."""
    streams: EntryPoint[PrepareConfig | None] = None
    """Stream-processor settings (staleness window, reorder, IS); None: the algorithm's defaults
    (``PrepareConfig.for_algo``). Its ``policy_id`` is always this config's ``policy_id``."""
    policy_id: str = "policy"
    """The policy this run trains: the learner publishes PolicyVersions under it; actors and
    stream processors follow only its versions (other policies on the same topic are ignored)."""
    max_batches_per_version: int | None = None
    """Decoupled, on-policy algorithms: fragments an actor publishes under one policy version
    before it waits for a newer one; None: its share of one learner batch,
    ceil(train_batch_size / (num_actors * num_envs * fragment_steps))."""
    policy_wait_s: Annotated[float, tyro.conf.arg(aliases=("--policy-wait",))] = 20.0
    """Decoupled, on-policy: the most an actor waits for a newer version before it sends one
    more fragment under the old one (a batch lost on the way must not stall training)."""
    actor_lag_versions: int = 0
    """Decoupled only, for staleness experiments: actors act with the newest policy version at least
    this many versions behind the newest they received, so the data is K versions stale through
    the whole pipeline (``bench/staleness.py --decoupled``); 0: the newest, as in production."""
    max_backlog: int = 64
    """Decoupled, off-policy: actors pause while the stream processors' backlog on
    rl.samples.raw (records not yet committed by their group) is above this, and resume at half.
    All algorithms: the end-to-end backlog (that plus the learner's on rl.samples.prepared) above
    which an actor ``max_steps_ahead`` ahead of the learner waits for it."""
    fixed_fragments: bool = False
    """Decoupled, off-policy, no ``fragment_steps`` given: keep the fragment length fixed instead of
    following that backlog (``actor.fragment_size.FragmentSizeController``, 32..256 steps per env)."""
    actor_steps: int | None = None
    """Decoupled: env steps each actor collects before it stops; None: its share of the budget,
    ceil(total_steps / num_actors)."""
    max_steps_ahead: int | None = None
    """Decoupled: env steps an actor may publish since the policy version last advanced before it
    waits for the learner, while the end-to-end backlog is above ``max_backlog``
    (``actor.flow.LearnerGate``); None: 4 x the larger of one learner batch and one fragment of
    the actor (``steps_ahead_bound``)."""
    torch_threads: int | None = None
    """Intra-op threads of torch in this process; None: 1, in both modes. The policies are small
    MLPs: on an idle 2-core machine co-located PPO on HalfCheetah ran as fast with one thread as
    with two (wall 0.99x, CPU 0.68x), and beside one other busy process torch's default of two
    threads ran it at 60 samples/s against 2,142 with one (their spin-waits). Raise it for a
    large model on a machine of its own."""
    overlap: bool = False
    """Co-located only: the actors collect fragment k+1 with policy version v (their envs in child
    processes, ``actor.rollout_process``) while the learner updates on fragment k, so every fragment after the first is trained one
    version after the one that collected it (policy lag 1, reported as such). Allowed for the
    algorithms that correct a lagged behaviour policy (``config.algos.ALGO_DEFAULTS``' ``overlap``
    column): PPO then trains as decoupled PPO (``decoupled=true``: clip anchored at the learner's
    policy, truncated pi/mu weights); AGRO and TBA as they are. Off: strict alternation, lag 0.
    On two idle cores PPO on HalfCheetah ran 1.31x strict PPO's samples/s (docs/benchmarks.md)."""
    stream_workers: int = 1
    """Decoupled: Faust workers ``rlstream train --mode decoupled`` starts in the streams group
    (they split the partitions of rl.samples.raw, ``--partitions``)."""
    max_restarts: int = 3
    """Decoupled: restarts of one role after it dies or fails its liveness probe (backoff 1 s,
    doubling to 30 s) before the run fails naming its log file."""
    liveness_probes: bool = True
    """Decoupled: probe each child's ``/healthz`` as the manifests' ``livenessProbe`` does (every
    10 s, 3 s timeout: ``runtime.ports.LIVENESS_PROBE``), once it has answered once, and kill
    and restart one that fails 3 probes in a row (a hung or slow process)."""
    replay: bool = False
    """Off-policy algorithms (agro, tba): the learner also trains on fragments replayed from a
    cache of the last ``replay_capacity`` transitions it trained on (``learner.replay``)."""
    replay_capacity: int = 1000
    """Transitions the learner node's sample cache holds (whole fragments; a fragment must fit)."""
    replay_samples_per_insert: float = 2.0
    """Rate limiter: trainings per transition inserted, its fresh one included (Reverb's SPI)."""
    replay_max_reuse: int = 2
    """Times one cached fragment may be replayed."""
    replay_min_size: int = 0
    """Transitions cached before any replay; 0: half the capacity."""
    dynamic_batch: bool = False
    """The learner's minibatch size follows the accelerator's load, 32..256 transitions
    (``learner.minibatch``: GPU utilisation, or the learner's duty cycle without a GPU)."""
    bus: EntryPoint[BusConfig] = field(default_factory=BusConfig)
    object_store: EntryPoint[ObjectStoreConfig] = field(
        default_factory=ObjectStoreConfig, compare=False, repr=False, metadata={"secret": True})
    """An ``s3://`` snapshot store's endpoint and credentials, from the environment
    (``ObjectStoreConfig.from_environment``); never written to a run config file."""

    def __post_init__(self) -> None:
        if not self.run_id:
            object.__setattr__(self, "run_id", uuid.uuid4().hex[:12])
        d = algo_defaults(self.algo)
        if self.preset not in PRESET_CHOICES:
            raise ValueError(f"--preset must be one of {', '.join(PRESET_CHOICES)}, got {self.preset!r}")
        found = env_preset(self.algo, self.env_id, self.preset)
        if found is not None:  # idempotent: re-made configs (replace, from_dict) merge it again
            row = found[1]
            object.__setattr__(self, "algo_overrides", {**row.algo, **self.algo_overrides})
            if self.train_batch_size is None and row.train_batch_size is not None:
                object.__setattr__(self, "train_batch_size", row.train_batch_size)
        # JSON (a run config file) turns tuples into lists; keep one form so configs compare equal
        object.__setattr__(self, "algo_overrides",
                           {k: tuple(v) if isinstance(v, list) else v for k, v in self.algo_overrides.items()})
        for name in ("num_envs", "train_batch_size", "group_size"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, getattr(d, name))
        if self.fragment_steps is None and d.fragment_steps is not None:
            object.__setattr__(self, "fragment_steps", d.fragment_steps)
        check_bounds(self)  # (--actor-lag-versions' decoupled-only is checked by run_colocated: the
        # CLI builds this config before it sets ``mode``)
        if self.replay and d.on_policy:
            raise ValueError(f"--replay needs an off-policy algorithm (agro, tba), not {self.algo!r}")
        if self.overlap:  # (co-located only is checked by run_decoupled: ``mode`` is set later)
            object.__setattr__(self, "algo_overrides", overlap_overrides(self.algo, self.algo_overrides))

    @classmethod
    def from_flags(cls, flags: "TrainConfig") -> "TrainConfig":
        """The checked config of ``flags`` (a ``TrainFlags``); ``ValueError`` saying what is wrong."""
        return cls(**{f.name: getattr(flags, f.name) for f in dataclasses.fields(cls)})

    def replay_settings(self) -> dict[str, Any] | None:
        """The sample cache's settings (``learner.replay.ReplayConfig`` fields); None: no replay.
        A fragment larger than the cache could never be replayed: a clear error."""
        if not self.replay:
            return None
        fragment = self.num_envs * (self.fragment_steps or self.effective_fragment_steps())
        if self.mode == "colocated" and fragment > self.replay_capacity:
            raise ValueError(f"--replay: a fragment holds {fragment} transitions, more than "
                             f"--replay-capacity {self.replay_capacity}; lower --fragment-steps or raise the capacity")
        return {"capacity": self.replay_capacity, "samples_per_insert": self.replay_samples_per_insert,
                "max_reuse": self.replay_max_reuse, "min_size": self.replay_min_size}

    def preset_name(self) -> str | None:
        """The name of the preset this config applies (None: the algorithm's row only)."""
        found = env_preset(self.algo, self.env_id, self.preset)
        return None if found is None else found[0]

    def prepare_config(self) -> PrepareConfig:
        base = self.streams if self.streams is not None else PrepareConfig.for_algo(self.algo)
        return base if base.policy_id == self.policy_id else replace(base, policy_id=self.policy_id)

    def policy_lag_bound(self) -> int | None:
        """The policy-lag breaker's bound in versions (see ``breaker_policy_lag_versions``); None: off."""
        if self.breaker_policy_lag_versions is not None:
            return self.breaker_policy_lag_versions or None
        if self.actor_lag_versions:
            return None
        k = self.prepare_config().max_versions
        return k if k < POLICY_LAG_UNBOUNDED else None  # DPO: nothing is ever stale

    def batches_per_version(self) -> int:
        """On-policy actors' share of one learner batch, in fragments (see the field)."""
        if self.max_batches_per_version:
            return self.max_batches_per_version
        per_fragment = max(1, self.num_actors * self.num_envs * self.effective_fragment_steps())
        return max(1, -(-self.train_batch_size // per_fragment))

    def actor_budget(self) -> int:
        """Env steps one decoupled actor collects (see ``actor_steps``)."""
        return self.actor_steps or max(1, -(-self.total_steps // max(1, self.num_actors)))

    def steps_ahead_bound(self) -> int:
        """Env steps an actor may run ahead of the learner (see ``max_steps_ahead``)."""
        if self.max_steps_ahead:
            return self.max_steps_ahead
        return 4 * max(self.train_batch_size, self.num_envs * self.effective_fragment_steps())

    def effective_run_id(self) -> str:
        """The run id (drawn once, when the config was made, if none was given)."""
        return self.run_id

    def effective_fragment_steps(self) -> int:
        if self.fragment_steps:
            return self.fragment_steps
        if self.group_size:
            return episode_horizon(self.env_id)
        return max(1, self.train_batch_size // max(1, self.num_envs * self.num_actors))

    def snapshot_url(self) -> str:
        return self.snapshot_store or str(self.run_dir / "snapshots")

    def redis(self) -> str | None:
        return self.redis_url or None

    def blob_cache_dir(self) -> str | None:
        """The host blob cache directory (None: off)."""
        return cache_dir_of(self.blob_cache)

    def to_dict(self) -> dict[str, Any]:
        """Every field as JSON values but secrets (``from_dict`` inverts it)."""
        d = json.loads(json.dumps(dataclasses.asdict(self), default=str))
        for name in SECRET_FIELDS:
            d["bus"].pop(name, None)
        d.pop("object_store")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        """The config ``to_dict`` wrote; an unknown or missing field is an error, not a default."""
        d = dict(d)
        _check_fields(cls, d, skip=("object_store",))
        bus = dict(d.pop("bus"))
        # a file written before the learner's group could be named: its run used the default group
        bus.setdefault("learner_group", DEFAULT_LEARNER_GROUP)
        # ... or its topics' replication: the broker's defaults
        bus.setdefault("replication", {"factor": None, "min_insync": None})
        _check_fields(BusConfig, bus, skip=SECRET_FIELDS)
        bus["retention"] = {k: Retention(**v) for k, v in bus["retention"].items()}
        _check_fields(Replication, bus["replication"])
        bus["replication"] = Replication(**bus["replication"])
        streams = d.pop("streams")
        if streams is not None:
            _check_fields(PrepareConfig, streams)
        return cls(**{**d, "run_dir": Path(d["run_dir"]), "wrappers": tuple(d["wrappers"]), "bus": BusConfig(**bus),
                      "streams": None if streams is None else PrepareConfig(**streams)})

    def resolved(self) -> "TrainConfig":
        """This config with every default that depends on other fields filled in (snapshot store,
        the blob cache, the stream-processor settings), so every process that reads it agrees."""
        return replace(self, run_id=self.effective_run_id(), snapshot_store=self.snapshot_url(),
                       redis_url=self.redis(), blob_cache=self.blob_cache_dir() or "off",
                       streams=self.prepare_config())


#: ``BusConfig`` fields a run config file never holds (each process takes them from its environment).
SECRET_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(BusConfig) if f.metadata.get("secret"))


def _check_fields(cls: type, d: dict[str, Any], skip: tuple[str, ...] = ()) -> None:
    names = {f.name for f in dataclasses.fields(cls)} - set(skip)
    if set(d) != names:
        raise ValueError(f"{cls.__name__}: unknown fields {sorted(set(d) - names)}, "
                         f"missing fields {sorted(names - set(d))}")


def write_config(cfg: TrainConfig, path: Path) -> Path:
    """Write ``cfg`` as a run config file (``streams.runconfig``) at ``path``."""
    return write_run_config(cfg.to_dict(), path)


def read_config(path: str | Path, env: Environment | None = None) -> TrainConfig:
    """The ``TrainConfig`` of a run config file, with the Kafka security settings of ``env`` (a
    file never holds them); a clear ``SystemExit`` if it cannot be used."""
    try:
        cfg = TrainConfig.from_dict(read_run_config(path))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise SystemExit(f"config file {path}: {e}") from None
    if env is not None:
        try:
            security = env.kafka_security()
        except ValueError as e:
            raise SystemExit(str(e)) from None
        cfg = replace(cfg, bus=replace(cfg.bus, security=security),
                      object_store=ObjectStoreConfig.from_environment(env))
    return cfg


#: The ``TrainConfig`` fields set from the entry point's shared flags, not generated ones.
ENTRY_POINT_FIELDS: tuple[str, ...] = tuple(
    name for name, hint in get_type_hints(TrainConfig, include_extras=True).items()
    if tyro.conf.Suppress in getattr(hint, "__metadata__", ()))


@dataclass(frozen=True)
class TrainFlags(TrainConfig):
    """``TrainConfig``'s flags as ``tyro`` parses them, unchecked: the entry point makes the
    ``TrainConfig`` from them (``TrainConfig.from_flags``), so a value the config refuses is one
    line of error, not tyro's box."""

    def __post_init__(self) -> None:
        pass
