"""The run's typed configuration (``TrainConfig``, in the sections of ``config.sections``), parsed once at the entry point (``rlstream.cli``)
and passed down: nothing below the entry point reads the environment or argv."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, get_type_hints

import tyro

from config.algos import ALGO_DEFAULTS, PRESET_CHOICES, algo_defaults, env_kwargs_of, env_preset
from config.bus import DEFAULT_LEARNER_GROUP, BusConfig, Replication, Retention
from config.env import Environment
from config.prepare import PrepareConfig
from config.sections import (FLAT, SECTIONS, ActorSection, DeploySection, EntryPoint, LearnerSection,  # noqa: F401
                             ReplaySection, RunSection, flat_flag_of, nest)
from config.storage import ObjectStoreConfig
from config.runfile import read_run_config, write_run_config


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


#: Why ``--actor.overlap`` is refused outside co-located mode (``run_decoupled`` and the CLI say it).
OVERLAP_COLOCATED_ONLY = ("--actor.overlap applies to co-located mode only (decoupled actors and learner are separate "
                          "processes: they already collect and train at once)")


def overlap_overrides(algo: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` with the algorithm fields ``--actor.overlap`` needs (its row's ``overlap``); a clear
    ``ValueError`` for an algorithm with no correction for the lag, or an override against it."""
    need = algo_defaults(algo).overlap
    if need is None:
        allowed = ", ".join(name for name, row in ALGO_DEFAULTS.items() if row.overlap is not None)
        raise ValueError(f"--actor.overlap is not allowed for {algo}: it trains each fragment one policy version "
                         f"after the one that collected it, and {algo} has no correction for a lagged behaviour "
                         f"policy (allowed: {allowed}); run {algo} without --actor.overlap")
    for key, value in need.items():
        if key in overrides and overrides[key] != value:
            raise ValueError(f"--actor.overlap trains {algo} with {key}={json.dumps(value)} (its correction for the "
                             f"one-version lag); --set {key}={json.dumps(overrides[key])} contradicts it: drop one "
                             "of them")
    return {**overrides, **need}


#: A staleness window this wide means "never stale" (DPO's): no policy-lag breaker by default.
POLICY_LAG_UNBOUNDED = 1 << 20


#: The least value of each budget and size that means anything (None, where a field allows it,
#: is its default), by the field's old flat name (``config.sections.FLAT``). ``TrainConfig``
#: refuses a config below one when it is made, so a bad flag stops the command before anything
#: is created or started.
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
#: What a fenced learner does (``--learner.on-fenced``): exit 4, or wait for SIGTERM, then exit 4.
ON_FENCED = ("exit", "wait")
#: The modes a run is trained in (``rlstream train --mode``; the roles of a decoupled run are decoupled).
MODES = ("colocated", "decoupled")


def check_bounds(cfg: Any) -> None:
    """``ValueError`` naming every field of ``cfg`` below its bound (``AT_LEAST``, ``ABOVE_ZERO``),
    as the flag that sets it: ``--run.total-steps must be >= 1, got 0``."""
    bad = []
    for name, least in AT_LEAST.items():
        value = _flat_value(cfg, name)
        if value is not None and value < least:
            bad.append(f"{flat_flag_of(name)} must be >= {least:g}, got {value:g}")
    for name in ABOVE_ZERO:
        value = _flat_value(cfg, name)
        if value is not None and not value > 0:
            bad.append(f"{flat_flag_of(name)} must be > 0, got {value:g}")
    if bad:
        raise ValueError("; ".join(bad))


def _flat_value(cfg: Any, flat: str) -> Any:
    section, attr = FLAT[flat]
    return getattr(getattr(cfg, section), attr)


@dataclass(frozen=True)
class TrainConfig:
    """A run's settings in sections (``config.sections``): ``run`` (``--algo``, ``--env``...),
    ``actor`` (``--actor.num-envs``), ``learner`` (``--learner.snapshot-every``), ``replay``,
    ``deploy``, and the entry point's ``mode``, ``bus``, ``object_store`` and ``streams``. Checked
    once, mode included, when it is made (``__post_init__``). The old flat keyword arguments
    (``TrainConfig(num_envs=4)``, ``replace(cfg, num_envs=4)``) and attribute reads
    (``cfg.num_envs``) still work for one release; new code names the section."""

    mode: EntryPoint[str] = "colocated"
    """colocated (one process, memory bus) or decoupled (processes over Kafka)."""
    run: Annotated[RunSection, tyro.conf.OmitArgPrefixes] = field(default_factory=RunSection)
    actor: ActorSection = field(default_factory=ActorSection)
    learner: LearnerSection = field(default_factory=LearnerSection)
    replay: ReplaySection = field(default_factory=ReplaySection)
    deploy: DeploySection = field(default_factory=DeploySection)
    streams: EntryPoint[PrepareConfig | None] = None
    """Stream-processor settings (staleness window, reorder, IS); None: the algorithm's defaults
    (``PrepareConfig.for_algo``). Its ``policy_id`` is always this config's ``run.policy_id``."""
    bus: EntryPoint[BusConfig] = field(default_factory=BusConfig)
    object_store: EntryPoint[ObjectStoreConfig] = field(
        default_factory=ObjectStoreConfig, compare=False, repr=False, metadata={"secret": True})
    """An ``s3://`` snapshot store's endpoint and credentials, from the environment
    (``ObjectStoreConfig.from_environment``); never written to a run config file."""

    def __post_init__(self) -> None:
        run, actor, learner = self.run, self.actor, self.learner
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not run.run_id:
            run = replace(run, run_id=uuid.uuid4().hex[:12])
        d = algo_defaults(run.algo)
        if run.preset not in PRESET_CHOICES:
            raise ValueError(f"--preset must be one of {', '.join(PRESET_CHOICES)}, got {run.preset!r}")
        overrides = dict(run.algo_overrides)
        env_kwargs = {**env_kwargs_of(run.algo, run.env_id, run.preset), **run.env_kwargs}
        found = env_preset(run.algo, run.env_id, run.preset)
        if found is not None:  # idempotent: re-made configs (replace, from_dict) merge it again
            row = found[1]
            overrides = {**row.algo, **overrides}
            if learner.train_batch_size is None and row.train_batch_size is not None:
                learner = replace(learner, train_batch_size=row.train_batch_size)
        # JSON (a run config file) turns tuples into lists; keep one form so configs compare equal
        overrides = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}
        if learner.train_batch_size is None:
            learner = replace(learner, train_batch_size=d.train_batch_size)
        for name in ("num_envs", "group_size"):
            if getattr(actor, name) is None:
                actor = replace(actor, **{name: getattr(d, name)})
        if actor.fragment_steps is None and d.fragment_steps is not None:
            actor = replace(actor, fragment_steps=d.fragment_steps)
        if learner.on_fenced not in ON_FENCED:
            raise ValueError(f"--learner.on-fenced must be one of {', '.join(ON_FENCED)}, got {learner.on_fenced!r}")
        if self.replay.enabled and d.on_policy:
            off = ", ".join(name for name, row in ALGO_DEFAULTS.items() if row.online and not row.on_policy)
            raise ValueError(f"--replay.enabled needs an off-policy algorithm ({off}), not {run.algo!r}")
        if actor.overlap:
            if self.mode != "colocated":
                raise ValueError(OVERLAP_COLOCATED_ONLY)
            overrides = overlap_overrides(run.algo, overrides)
        if actor.actor_lag_versions and self.mode != "decoupled":
            raise ValueError("--actor.actor-lag-versions applies to decoupled mode only (co-located actors "
                             "always act with the newest policy)")
        run = replace(run, algo_overrides=overrides, env_kwargs=env_kwargs, wrappers=tuple(run.wrappers),
                      run_dir=Path(run.run_dir))
        for name, value in (("run", run), ("actor", actor), ("learner", learner)):
            object.__setattr__(self, name, value)
        check_bounds(self)
        if self.replay.enabled and self.mode == "colocated":
            self.replay_settings()  # a fragment larger than the cache: refused now, not at the first update

    def __getattr__(self, name: str) -> Any:
        # the flat layout's attribute reads (``cfg.num_envs``) for one release: new code names the section
        where = FLAT.get(name)
        if where is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(object.__getattribute__(self, where[0]), where[1])

    @classmethod
    def from_flags(cls, flags: "TrainConfig", mode: str = "colocated") -> "TrainConfig":
        """The checked config of ``flags`` (a ``TrainFlags``) in ``mode``; ``ValueError`` saying what is wrong."""
        return cls(**{**{f.name: getattr(flags, f.name) for f in dataclasses.fields(cls)}, "mode": mode})

    def replay_settings(self) -> dict[str, Any] | None:
        """The sample cache's settings (``learner.replay.ReplayConfig`` fields); None: no replay.
        A fragment larger than the cache could never be replayed: a clear error."""
        if not self.replay.enabled:
            return None
        fragment = self.actor.num_envs * (self.actor.fragment_steps or self.effective_fragment_steps())
        if self.mode == "colocated" and fragment > self.replay.capacity:
            raise ValueError(f"--replay.enabled: a fragment holds {fragment} transitions, more than "
                             f"--replay.capacity {self.replay.capacity}; lower --actor.fragment-steps or raise "
                             "the capacity")
        return self.replay.settings()

    def preset_name(self) -> str | None:
        """The name of the preset this config applies (None: the algorithm's row only)."""
        found = env_preset(self.run.algo, self.run.env_id, self.run.preset)
        return None if found is None else found[0]

    def prepare_config(self) -> PrepareConfig:
        base = self.streams if self.streams is not None else PrepareConfig.for_algo(self.run.algo)
        return base if base.policy_id == self.run.policy_id else replace(base, policy_id=self.run.policy_id)

    def policy_lag_bound(self) -> int | None:
        """The policy-lag breaker's bound in versions (see ``learner.breaker_policy_lag_versions``); None: off."""
        if self.learner.breaker_policy_lag_versions is not None:
            return self.learner.breaker_policy_lag_versions or None
        if self.actor.actor_lag_versions:
            return None
        k = self.prepare_config().max_versions
        return k if k < POLICY_LAG_UNBOUNDED else None  # DPO: nothing is ever stale

    def batches_per_version(self) -> int:
        """On-policy actors' share of one learner batch, in fragments (see ``actor.max_batches_per_version``)."""
        a = self.actor
        if a.max_batches_per_version:
            return a.max_batches_per_version
        per_fragment = max(1, a.num_actors * a.num_envs * self.effective_fragment_steps())
        return max(1, -(-self.learner.train_batch_size // per_fragment))

    def actor_budget(self) -> int:
        """Env steps one decoupled actor collects (see ``actor.actor_steps``)."""
        return self.actor.actor_steps or max(1, -(-self.run.total_steps // max(1, self.actor.num_actors)))

    def steps_ahead_bound(self) -> int:
        """Env steps an actor may run ahead of the learner (see ``actor.max_steps_ahead``)."""
        if self.actor.max_steps_ahead:
            return self.actor.max_steps_ahead
        return 4 * max(self.learner.train_batch_size, self.actor.num_envs * self.effective_fragment_steps())

    def effective_run_id(self) -> str:
        """The run id (drawn once, when the config was made, if none was given)."""
        return self.run.run_id

    def effective_fragment_steps(self) -> int:
        a = self.actor
        if a.fragment_steps:
            return a.fragment_steps
        if a.group_size:
            return episode_horizon(self.run.env_id)
        return max(1, self.learner.train_batch_size // max(1, a.num_envs * a.num_actors))

    def snapshot_url(self) -> str:
        return self.learner.snapshot_store or str(self.run.run_dir / "snapshots")

    def redis(self) -> str | None:
        return self.deploy.redis_url or None

    def blob_cache_dir(self) -> str | None:
        """The host blob cache directory (None: off)."""
        return cache_dir_of(self.deploy.blob_cache)

    def to_dict(self) -> dict[str, Any]:
        """Every field as JSON values, in sections, but secrets (``from_dict`` inverts it)."""
        d = json.loads(json.dumps(dataclasses.asdict(self), default=str))
        for name in SECRET_FIELDS:
            d["bus"].pop(name, None)
        d.pop("object_store")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        """The config ``to_dict`` wrote, or one of the flat layout of before (mapped into the
        sections); an unknown or missing field is an error, not a default."""
        d = dict(d)
        if "run" not in d:  # the flat layout (every field at the top)
            d = flat_to_nested(d)
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
        # a file written before env kwargs could be given: its run made the env with none
        d["run"] = {"env_kwargs": {}, **d["run"]}
        # ... or before a fenced learner could wait: it exited
        d["learner"] = {"on_fenced": "exit", **d["learner"]}
        sections = {}
        for name, section in SECTIONS.items():
            values = dict(d.pop(name))
            _check_fields(section, values)
            sections[name] = section(**values)
        return cls(**d, **sections, bus=BusConfig(**bus),
                   streams=None if streams is None else PrepareConfig(**streams))

    def resolved(self) -> "TrainConfig":
        """This config with every default that depends on other fields filled in (snapshot store,
        the blob cache, the stream-processor settings), so every process that reads it agrees."""
        return replace(self, run=replace(self.run, run_id=self.effective_run_id()),
                       learner=replace(self.learner, snapshot_store=self.snapshot_url()),
                       deploy=replace(self.deploy, redis_url=self.redis(), blob_cache=self.blob_cache_dir() or "off"),
                       streams=self.prepare_config())


def flat_to_nested(d: dict[str, Any]) -> dict[str, Any]:
    """A run config file's mapping of the flat layout of before, in sections (unknown fields
    stay at the top, for ``from_dict`` to name)."""
    flat = {k: v for k, v in d.items() if k in FLAT}
    out = {k: v for k, v in d.items() if k not in FLAT}
    for section in SECTIONS:
        out[section] = {}
    for name, value in flat.items():
        section, attr = FLAT[name]
        out[section][attr] = value
    return out


_dataclass_init = TrainConfig.__init__


def _init(self, *args: Any, **kwargs: Any) -> None:
    """``TrainConfig``'s constructor, also taking the flat layout's keyword arguments
    (``num_envs=4``) into their sections, so ``replace(cfg, num_envs=4)`` works too."""
    flat = {k: kwargs.pop(k) for k in [k for k in kwargs if k in FLAT and k not in SECTIONS]}
    if "replay" in kwargs and not isinstance(kwargs["replay"], ReplaySection):
        flat["replay"] = kwargs.pop("replay")  # the flat ``replay=True``
    _dataclass_init(self, *args, **(nest(flat, kwargs) if flat else kwargs))


TrainConfig.__init__ = _init  # type: ignore[method-assign]


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


def _entry_point_fields(cls: type) -> tuple[str, ...]:
    return tuple(name for name, hint in get_type_hints(cls, include_extras=True).items()
                 if tyro.conf.Suppress in getattr(hint, "__metadata__", ()))


#: The ``TrainConfig`` fields set from the entry point's shared flags, not generated ones (those of
#: its sections by their own names: ``run_dir`` is ``run.run_dir``).
ENTRY_POINT_FIELDS: tuple[str, ...] = (_entry_point_fields(TrainConfig)
                                       + tuple(n for cls in SECTIONS.values() for n in _entry_point_fields(cls)))


@dataclass(frozen=True)
class TrainFlags(TrainConfig):
    """``TrainConfig``'s flags as ``tyro`` parses them, unchecked: the entry point makes the
    ``TrainConfig`` from them (``TrainConfig.from_flags``), so a value the config refuses is one
    line of error, not tyro's box."""

    def __post_init__(self) -> None:
        pass
