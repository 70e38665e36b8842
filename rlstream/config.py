"""Typed run configuration, parsed once at the entry point (rlstream/cli.py).

Nothing below the entry point reads the environment or argv: roles get these dataclasses.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

from streams.processors.pipeline import PrepareConfig
from streams.topics import Namespace, Retention, parse_retention
from rlstream.obs.ports import (ENV_BUS, ENV_KAFKA_BROKERS, ENV_NAMESPACE, ENV_REDIS_URL, ENV_RUN_ID,
                                ENV_SNAPSHOT_STORE)

ENV_RETENTION = "RLSTREAM_RETENTION"


@dataclass(frozen=True)
class BusConfig:
    kind: str = "memory"
    """memory (in-process, co-located default) or kafka."""
    bootstrap: str = "127.0.0.1:9092"
    """Kafka bootstrap servers (kind=kafka)."""
    partitions: int = 1
    """Partitions of the sample topics when this process creates them."""
    log_dir: str | None = None
    """kind=memory: keep the log in files here (history and commits survive the process, so a
    run can resume and be replayed); None: purely in memory."""
    retention: dict[str, Retention] = field(default_factory=dict)
    """Per-topic retention over the defaults of ``streams.topics.RETENTION_MS``, applied when this
    process creates the topics (env ``RLSTREAM_RETENTION``, see ``parse_retention``)."""
    namespace: str = ""
    """Run namespace scoping every topic and consumer group (``streams.topics.Namespace``);
    "": the legacy unscoped names."""

    @classmethod
    def from_env(cls, kind: str | None = None, bootstrap: str | None = None,
                 log_dir: str | None = None, namespace: str | None = None) -> "BusConfig":
        """Flags win over the environment (RLSTREAM_BUS, KAFKA_BROKERS, RLSTREAM_NAMESPACE,
        RLSTREAM_RETENTION)."""
        try:
            retention = parse_retention(os.environ.get(ENV_RETENTION, ""))
        except ValueError as e:
            raise SystemExit(f"{ENV_RETENTION}: {e}") from None
        return cls(
            kind=kind or os.environ.get(ENV_BUS, "memory"),
            bootstrap=bootstrap or os.environ.get(ENV_KAFKA_BROKERS, "127.0.0.1:9092"),
            log_dir=log_dir,
            retention=retention,
            namespace=(os.environ.get(ENV_NAMESPACE, "") if namespace is None else namespace).strip(),
        )

    def topics(self) -> Namespace:
        """The namespace object (validates the name)."""
        return Namespace(self.namespace)


@dataclass(frozen=True)
class AlgoDefaults:
    """How ``rlstream train --algo X`` collects and batches data when the flags are not given."""

    num_envs: int
    """Vector env width per actor."""
    group_size: int
    """Envs per start-state group (0: no groups). Group mode makes each column one rollout."""
    train_batch_size: int
    """Transitions per learner update."""
    fragment_steps: int | None = None
    """Steps per env per SampleBatch; None: ``train_batch_size // (num_envs * num_actors)``, or in
    group mode the env's episode horizon (``max_episode_steps``), so every rollout ends inside its
    fragment (the actor ends the fragment early once all have)."""


_PPO_LIKE = AlgoDefaults(num_envs=1, group_size=0, train_batch_size=2048)
_GROUPED = AlgoDefaults(num_envs=8, group_size=8, train_batch_size=512)

#: The one table of per-algorithm run defaults (README "Algorithms" explains the choices).
#: PPO, AGRO and TBA bootstrap a learned value, so fragments may cut episodes anywhere: CleanRL's
#: 1 env x 2048 steps. GRPO and DAPO compare whole rollouts from one start state: one group of 8
#: rollouts per fragment, fragments as long as an episode (ended early once all 8 are done), and
#: a small batch, counted in padded steps: 512 is a few groups while rollouts are short and one
#: group per update once they pass 64 steps (InvertedPendulum, 30k steps, 3 seeds: GRPO reached
#: a return of ~290 with 512 vs ~170 with 1024; 8 rollouts per group beat 2 groups of 4).
ALGO_DEFAULTS: dict[str, AlgoDefaults] = {
    "ppo": _PPO_LIKE, "agro": _PPO_LIKE, "tba": _PPO_LIKE, "grpo": _GROUPED, "dapo": _GROUPED,
}


def episode_horizon(env_id: str, default: int = 1000) -> int:
    """The env's registered ``max_episode_steps`` (``default`` when it has none)."""
    import gymnasium as gym

    from actor.envs import registered_spec

    try:
        steps = registered_spec(env_id).max_episode_steps
    except gym.error.Error:
        return default
    return int(steps) if steps else default


@dataclass(frozen=True)
class TrainConfig:
    mode: str = "colocated"
    """colocated (one process, memory bus) or decoupled (processes over Kafka)."""
    algo: str = "ppo"
    """ppo, grpo, dapo, agro, tba."""
    env_id: str = "HalfCheetah-v5"
    """Gymnasium env id (``module:EnvId-v0`` imports the module first)."""
    wrappers: tuple[str, ...] = ()
    """Per-env gymnasium wrappers by name (``actor.envs.WRAPPERS``)."""
    total_steps: int = 100_000
    """Environment steps to train for (summed over envs and actors)."""
    num_actors: int = 1
    """Actors (co-located: in-process; decoupled: processes)."""
    num_envs: int | None = None
    """Vector env width per actor; None: the algorithm's default (``ALGO_DEFAULTS``)."""
    fragment_steps: int | None = None
    """Steps per env per SampleBatch; None: train_batch_size // (num_envs * num_actors), or the
    env's episode horizon in group mode (``effective_fragment_steps``)."""
    train_batch_size: int | None = None
    """Transitions per learner update; None: the algorithm's default."""
    seed: int = 0
    """Seed of envs, action noise and the learner."""
    group_size: int | None = None
    """Envs per start-state group (GRPO/DAPO; 0: no groups); None: the algorithm's default."""
    algo_overrides: dict = field(default_factory=dict)
    """Algorithm config fields to override (from --set key=value)."""
    run_dir: Path = Path("runs/latest")
    """Where snapshots, the summary and the plot go."""
    run_id: str = ""
    """Bound into logs and events; default: random."""
    snapshot_store: str | None = None
    """Snapshot store URL/path; None: <run_dir>/snapshots."""
    snapshot_every: int = 10
    """Updates between snapshots."""
    resume: bool = False
    """Resume from the newest snapshot (and committed offsets)."""
    plot: bool = True
    """Write <run_dir>/returns.png (return vs steps)."""
    tensorboard: str | None = None
    """TensorBoard log directory (each role writes its own run under it); None: off."""
    metrics_port: int | None = None
    """Prometheus/health port; None: the role default; -1: no server."""
    log_every_s: float = 5.0
    """Seconds between progress lines."""
    device: str = "cpu"
    """torch device of the learner: cpu, cuda, cuda:1, or one per rank, cuda:0,1,2,3."""
    learners: int | None = None
    """Data-parallel learner ranks (docs/learners.md); None: one per device of ``device``."""
    grad_compression: str = "none"
    """Gradient all-reduce between ranks: none, fp16 or bf16 (torch's DDP compress hooks)."""
    redis_url: str | None = None
    """Redis for claim-check weights (None: inline only)."""
    breaker_open_above: float = 256.0
    """Circuit breaker: pause training when the stream processors' backlog on rl.samples.raw
    (records) passes this; the learner would otherwise keep versioning ahead of stale data."""
    breaker_close_below: float = 32.0
    """Circuit breaker: resume once the backlog is back under this."""
    streams: PrepareConfig | None = None
    """Stream-processor settings (staleness window, reorder, IS); None: the algorithm's defaults
    (``PrepareConfig.for_algo``). Its ``policy_id`` is always this config's ``policy_id``."""
    policy_id: str = "policy"
    """The policy this run trains: the learner publishes PolicyVersions under it; actors and
    stream processors follow only its versions (other policies on the same topic are ignored)."""
    max_batches_per_version: int | None = None
    """Decoupled, on-policy algorithms: fragments an actor publishes under one policy version
    before it waits for a newer one; None: its share of one learner batch,
    ceil(train_batch_size / (num_actors * num_envs * fragment_steps))."""
    policy_wait_s: float = 20.0
    """Decoupled, on-policy: the most an actor waits for a newer version before it sends one
    more fragment under the old one (a batch lost on the way must not stall training)."""
    max_backlog: int = 64
    """Decoupled, off-policy: actors pause while the stream processors' backlog on
    rl.samples.raw (records not yet committed by their group) is above this, and resume at half.
    All algorithms: the end-to-end backlog (that plus the learner's on rl.samples.prepared) above
    which an actor ``max_steps_ahead`` ahead of the learner waits for it."""
    dynamic_fragments: bool = True
    """Decoupled, off-policy, no ``fragment_steps`` given: the fragment length follows that
    backlog (``learner.batch_size.BatchSizeController``, 32..256 steps per env)."""
    actor_steps: int | None = None
    """Decoupled: env steps each actor collects before it stops; None: its share of the budget,
    ceil(total_steps / num_actors)."""
    max_steps_ahead: int | None = None
    """Decoupled: env steps an actor may publish since the policy version last advanced before it
    waits for the learner, while the end-to-end backlog is above ``max_backlog``
    (``actor.flow.LearnerGate``); None: 4 x the larger of one learner batch and one fragment of
    the actor (``steps_ahead_bound``)."""
    torch_threads: int | None = None
    """Intra-op threads of torch in this process; None: 1 in the decoupled role processes (they
    share the machine: small-MLP updates on contended cores run several times slower with more),
    torch's default in co-located mode."""
    bus: BusConfig = field(default_factory=BusConfig)

    def __post_init__(self) -> None:
        d = ALGO_DEFAULTS.get(self.algo, _PPO_LIKE)
        for name in ("num_envs", "train_batch_size", "group_size"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, getattr(d, name))
        if self.fragment_steps is None and d.fragment_steps is not None:
            object.__setattr__(self, "fragment_steps", d.fragment_steps)

    def prepare_config(self) -> PrepareConfig:
        base = self.streams if self.streams is not None else PrepareConfig.for_algo(self.algo)
        return base if base.policy_id == self.policy_id else replace(base, policy_id=self.policy_id)

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
        return self.run_id or os.environ.get(ENV_RUN_ID) or uuid.uuid4().hex[:12]

    def effective_fragment_steps(self) -> int:
        if self.fragment_steps:
            return self.fragment_steps
        if self.group_size:
            return episode_horizon(self.env_id)
        return max(1, self.train_batch_size // max(1, self.num_envs * self.num_actors))

    def snapshot_url(self) -> str:
        return self.snapshot_store or os.environ.get(ENV_SNAPSHOT_STORE) or str(self.run_dir / "snapshots")

    def redis(self) -> str | None:
        return self.redis_url or os.environ.get(ENV_REDIS_URL)
