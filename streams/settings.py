"""Settings of a stream-processor process (the Faust worker, ``python -m rlstream.entry worker``): typed,
made once at its entry point from a run config (``config.TrainConfig``) or the environment
(``config.Environment``), and passed to the composition root (``rlstream.wiring``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from config import Environment, PrepareConfig, TrainConfig, read_config
from config.bus import Replication
from config.limits import DEFAULT_BOOTSTRAP
from runtime.rundir import RunDir
from streams.topics import LEGACY, STREAMS_GROUP, Namespace

#: The file in the run directory where a worker started from a run config records its settings.
EFFECTIVE_CONFIG_FILE = RunDir(".").config_file("streams").name
#: The metrics/web port of a streams worker (``runtime.ports.DEFAULT_PORTS["streams"]``).
DEFAULT_WEB_PORT = 9102


def prepare_config_of(env: Environment) -> PrepareConfig:
    """The processors' settings of a worker started without a run config: ``RLSTREAM_ALGO``'s
    defaults, then ``RLSTREAM_STALENESS_*``, ``RLSTREAM_REORDER_TIMEOUT_MS`` and
    ``RLSTREAM_POLICY_ID``; ``ValueError`` names a bad value."""
    return PrepareConfig.for_algo(env.algo, **env.streams_overrides())


@dataclass(frozen=True)
class StreamsSettings:
    """Settings of a streams worker process."""

    brokers: str = DEFAULT_BOOTSTRAP
    """Kafka bootstrap servers, comma separated host:port."""
    app_id: str = STREAMS_GROUP
    """Faust app id (= consumer group): the namespace's ``STREAMS_GROUP``."""
    namespace: Namespace = LEGACY
    """Run namespace of the topics read and written (``RLSTREAM_NAMESPACE``)."""
    topic_partitions: int = 1
    """Partitions of topics Faust creates when they do not exist."""
    replication: Replication = field(default_factory=Replication)
    """Copies of the topics the worker creates (its changelogs too) and how many in sync
    (``RLSTREAM_REPLICATION_FACTOR``, ``RLSTREAM_MIN_INSYNC_REPLICAS``; the run's bus setting)."""
    web_port: int = DEFAULT_WEB_PORT
    """Port of the worker's web server (``/metrics``); ``faust worker --web-port`` overrides."""
    tick_interval_s: float = 0.1
    """How often reorder timeouts are checked."""
    stats_interval_s: float = 30.0
    """How often the processor stats are logged."""
    state_interval_s: float = 1.0
    """How often the freshness counts are written to ``<run_dir>/<process_name>.state.json``
    (with ``run_dir`` set: what a decoupled run's supervisor reads)."""
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    """The pipeline settings."""
    client_config: Mapping[str, str] = field(default_factory=dict, repr=False)
    """librdkafka-style security settings (security.protocol, sasl.*, ssl.*)."""
    torch_threads: int = 1
    """Intra-op threads for the IS forward pass (small MLPs are fastest on one; 0: torch's default)."""
    commit_interval_s: float = 0.5
    """How often acked offsets of rl.samples.raw are committed (the backlog others watch)."""
    gap_check_s: float = 1.0
    """How often each owned partition is checked for records the consumer dropped: nothing has
    arrived for ``gap_stall_s`` although the partition's end is past the next offset expected."""
    gap_stall_s: float = 3.0
    policy_backlog: int | None = None
    """PolicyVersion records read back from the end of each partition on start (None: the
    staleness window's K + 1)."""
    policy_catchup_s: float = 30.0
    """Most seconds sample processing waits on start for the policy reader to catch up."""
    raw_partitions: int | None = None
    """Partitions of rl.samples.raw, which the per-actor state table's changelog must match
    (None: asked of the broker when the app is built, ``raw_partitions_of``)."""
    redis_url: str | None = None
    """Redis of claim-checked weights (None: inline weights only)."""
    blob_cache: str | None = None
    """The host blob cache directory (None: off)."""
    run_dir: str | None = None
    """Where the worker writes its summary (``<run_dir>/<process_name>.summary.json``); None: nowhere."""
    process_name: str = "streams"
    """The name the supervisor gave this worker (its summary file's name)."""
    run_config: TrainConfig | None = field(default=None, repr=False, compare=False)
    """The run config the settings came from, if any (its effective settings are recorded)."""

    @classmethod
    def from_environment(cls, env: Environment, default_port: int = DEFAULT_WEB_PORT) -> "StreamsSettings":
        """From the run config file ``RLSTREAM_CONFIG`` names if set (``from_train_config``), else
        from ``KAFKA_BROKERS``, ``RLSTREAM_NAMESPACE``, ``RLSTREAM_ALGO``, ``RLSTREAM_STALENESS_*``,
        ``RLSTREAM_REORDER_TIMEOUT_MS``, ``RLSTREAM_POLICY_ID``, ``REDIS_URL``,
        ``RLSTREAM_BLOB_CACHE`` and ``RLSTREAM_REPLICATION_FACTOR``/``_MIN_INSYNC_REPLICAS``.
        ``ValueError`` names a bad value."""
        from config.train import cache_dir_of

        port = env.metrics_port(default_port)
        common = {"web_port": port, "process_name": env.process or "streams"}
        if env.run_dir:
            common["run_dir"] = env.run_dir
        if env.config_path:
            return cls.from_train_config(read_config(env.config_path, env), **common)
        ns = Namespace(env.namespace or "")
        return cls(brokers=env.kafka_brokers or DEFAULT_BOOTSTRAP, app_id=ns.group(STREAMS_GROUP), namespace=ns,
                   prepare=prepare_config_of(env), replication=Replication(*env.replication()),
                   redis_url=env.redis_url, client_config=env.kafka_security(),
                   blob_cache=cache_dir_of(env.blob_cache),
                   **common)

    @classmethod
    def from_train_config(cls, cfg: TrainConfig, **kwargs) -> "StreamsSettings":
        """The settings of a run's config: its bus, stream-processor settings, claim-check store
        and torch threads."""
        ns = Namespace(cfg.bus.namespace)
        fields = {"brokers": cfg.bus.bootstrap, "app_id": ns.group(STREAMS_GROUP), "namespace": ns,
                  "topic_partitions": cfg.bus.partitions, "replication": cfg.bus.replication,
                  "prepare": cfg.prepare_config(),
                  "torch_threads": cfg.deploy.torch_threads or 1, "redis_url": cfg.redis(),
                  "blob_cache": cfg.blob_cache_dir(), "run_dir": str(cfg.run.run_dir), "run_config": cfg,
                  "client_config": dict(cfg.bus.security)}
        return cls(**{**fields, **kwargs})

    def effective(self) -> dict:
        """The settings as JSON values, secrets and the source config left out."""
        import dataclasses
        import json

        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("client_config", "run_config")}
        return json.loads(json.dumps({k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v)
                                      for k, v in d.items()}, default=str))
