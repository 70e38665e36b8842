"""Typed run configuration, parsed once at the entry point (rlstream/cli.py).

Nothing below the entry point reads the environment or argv: roles get these dataclasses.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from streams.processors.pipeline import PrepareConfig
from rlstream.obs.ports import ENV_BUS, ENV_KAFKA_BROKERS, ENV_REDIS_URL, ENV_RUN_ID, ENV_SNAPSHOT_STORE


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

    @classmethod
    def from_env(cls, kind: str | None = None, bootstrap: str | None = None,
                 log_dir: str | None = None) -> "BusConfig":
        return cls(
            kind=kind or os.environ.get(ENV_BUS, "memory"),
            bootstrap=bootstrap or os.environ.get(ENV_KAFKA_BROKERS, "127.0.0.1:9092"),
            log_dir=log_dir,
        )


@dataclass(frozen=True)
class TrainConfig:
    mode: str = "colocated"
    """colocated (one process, memory bus) or decoupled (processes over Kafka)."""
    algo: str = "ppo"
    """ppo, grpo, dapo, agro, tba."""
    env_id: str = "HalfCheetah-v5"
    """Gymnasium env id."""
    total_steps: int = 100_000
    """Environment steps to train for (summed over envs and actors)."""
    num_actors: int = 1
    """Actors (co-located: in-process; decoupled: processes)."""
    num_envs: int = 1
    """Vector env width per actor."""
    fragment_steps: int | None = None
    """Steps per env per SampleBatch; None: train_batch_size // (num_envs * num_actors)."""
    train_batch_size: int = 2048
    """Transitions per learner update."""
    seed: int = 0
    """Seed of envs, action noise and the learner."""
    group_size: int = 0
    """GRPO/DAPO: envs per start-state group (0: the algorithm's default)."""
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
    plot: bool = False
    """Write <run_dir>/returns.png (return vs steps)."""
    metrics_port: int | None = None
    """Prometheus/health port; None: the role default; -1: no server."""
    log_every_s: float = 5.0
    """Seconds between progress lines."""
    device: str = "cpu"
    """torch device of the learner (cpu, cuda)."""
    redis_url: str | None = None
    """Redis for claim-check weights (None: inline only)."""
    breaker_open_above: float = 256.0
    """Circuit breaker: pause training when the stream processors' backlog on rl.samples.raw
    (records) passes this; the learner would otherwise keep versioning ahead of stale data."""
    breaker_close_below: float = 32.0
    """Circuit breaker: resume once the backlog is back under this."""
    streams: PrepareConfig | None = None
    """Stream-processor settings (staleness window, reorder, IS); None: the algorithm's defaults
    (``PrepareConfig.for_algo``)."""
    bus: BusConfig = field(default_factory=BusConfig)

    def prepare_config(self) -> PrepareConfig:
        return self.streams if self.streams is not None else PrepareConfig.for_algo(self.algo)

    def effective_run_id(self) -> str:
        return self.run_id or os.environ.get(ENV_RUN_ID) or uuid.uuid4().hex[:12]

    def effective_fragment_steps(self) -> int:
        if self.fragment_steps:
            return self.fragment_steps
        return max(1, self.train_batch_size // max(1, self.num_envs * self.num_actors))

    def snapshot_url(self) -> str:
        return self.snapshot_store or os.environ.get(ENV_SNAPSHOT_STORE) or str(self.run_dir / "snapshots")

    def redis(self) -> str | None:
        return self.redis_url or os.environ.get(ENV_REDIS_URL)
