"""Settings of the bus: backend, brokers, partitions, retention, namespace, client security."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from config.env import ENV_LEARNER_GROUP, ENV_MIN_INSYNC_REPLICAS, ENV_REPLICATION_FACTOR, ENV_RETENTION, Environment
from config.limits import DEFAULT_BOOTSTRAP

DAY_MS = 24 * 3600 * 1000

#: Consumer group of the learner on rl.samples.prepared unless ``--learner-group`` /
#: ``RLSTREAM_LEARNER_GROUP`` names another (the deployment guide's ``rl-trainers``).
DEFAULT_LEARNER_GROUP = "learner"
_GROUP_RE = re.compile(r"[A-Za-z0-9._-]{1,200}")

#: The file in a decoupled run's directory that names the run's namespace (``rlstream.decoupled``).
NAMESPACE_FILE = "namespace"
#: Where runs go (``runs/<run-id>``), and the link to the newest: the run a tool reads its
#: namespace from when it is named neither by flag nor environment.
RUNS_ROOT = Path("runs")
LATEST_RUN = RUNS_ROOT / "latest"


def run_namespace(run_dir: str | Path | None) -> str | None:
    """The namespace ``run_dir`` records in its ``namespace`` file; None without one."""
    if run_dir is None:
        return None
    try:
        return (Path(run_dir) / NAMESPACE_FILE).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None


def check_group(name: str) -> str:
    """``name`` if it is a usable consumer-group name (1-200 of ``A-Z a-z 0-9 . _ -``), else ValueError."""
    if not _GROUP_RE.fullmatch(name):
        raise ValueError(f"consumer group {name!r}: use 1-200 of A-Z a-z 0-9 . _ -")
    return name


@dataclass(frozen=True)
class Retention:
    """Kafka's ``retention.ms`` and ``retention.bytes`` (per partition) of one topic; -1: unbounded."""

    ms: int = -1
    bytes: int = -1

    def config(self) -> dict[str, str]:
        return {"retention.ms": str(self.ms), "retention.bytes": str(self.bytes)}


_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": DAY_MS}
_UNITS_BYTES = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_retention(text: str) -> dict[str, Retention]:
    """``"rl.samples.raw=7d,rl.samples.prepared=30d/50g,rl.preferences=forever"`` -> per-topic
    ``Retention``: a time (``ms``/``s``/``m``/``h``/``d`` suffix, ``forever`` or -1), optionally
    ``/`` a size per partition (``k``/``m``/``g``/``t`` suffix, powers of 1024). Raises ValueError
    naming what is wrong; a topic without a retention default is refused where the topics are
    made (``streams.topics.all_topics``)."""
    out: dict[str, Retention] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        topic, sep, value = item.partition("=")
        if not sep or not topic.strip().startswith("rl."):
            raise ValueError(f"retention {item!r}: expected TOPIC=TIME[/SIZE] with TOPIC an rl.* topic")
        when, _, size = value.strip().partition("/")
        out[topic.strip()] = Retention(_amount(when, _UNITS_MS, item), _amount(size or "-1", _UNITS_BYTES, item))
    return out


def parse_duration_ms(text: str) -> int:
    """``"30d"``, ``"12h"``, ``"90m"``, ``"45s"``, ``"500ms"`` -> milliseconds (ValueError if not)."""
    ms = _amount(text, _UNITS_MS, text)
    if ms < 0:
        raise ValueError(f"duration {text!r}: must be a time, not forever")
    return ms


def _amount(text: str, units: dict[str, int], item: str) -> int:
    text = text.strip().lower()
    if text in ("forever", "-1"):
        return -1
    m = re.fullmatch(r"(\d+)\s*([a-z]*)", text)
    if m is None or m[2] not in units:
        raise ValueError(f"retention {item!r}: cannot read {text!r} (units: {', '.join(u for u in units if u)})")
    return int(m[1]) * units[m[2]]


@dataclass(frozen=True)
class Replication:
    """How many copies of each topic this process creates, and how many must be in sync for a
    write to be acknowledged (producers use ``acks=all``): ``RLSTREAM_REPLICATION_FACTOR`` and
    ``RLSTREAM_MIN_INSYNC_REPLICAS``. None: the broker's default (``default.replication.factor``,
    ``min.insync.replicas``)."""

    factor: int | None = None
    """Replication factor of the topics created (3 on a 3-broker cluster: one broker may be lost)."""
    min_insync: int | None = None
    """``min.insync.replicas`` of the topics created (2 with factor 3)."""

    #: The variables, for messages (``streams.bus.kafka.ReplicationError`` names the setting).
    FACTOR_SETTING = ENV_REPLICATION_FACTOR
    MIN_INSYNC_SETTING = ENV_MIN_INSYNC_REPLICAS

    def topic_config(self) -> dict[str, str]:
        """The per-topic config it sets (``min.insync.replicas``; nothing when unset)."""
        return {} if self.min_insync is None else {"min.insync.replicas": str(self.min_insync)}

    @property
    def replicated(self) -> bool:
        """More than one copy of each topic: partition leaders can move between brokers."""
        return (self.factor or 1) > 1

    def bus_options(self) -> dict[str, int | None]:
        """``KafkaBus``'s keyword arguments for the topics it creates (-1: the broker's default)."""
        return {"replication_factor": self.factor or -1, "min_insync_replicas": self.min_insync}


@dataclass(frozen=True)
class BusConfig:
    kind: str = "memory"
    """memory (in-process, co-located default) or kafka."""
    bootstrap: str = DEFAULT_BOOTSTRAP
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
    learner_group: str = DEFAULT_LEARNER_GROUP
    """The learner's consumer group on rl.samples.prepared (scoped by ``namespace`` like every
    group): every role of a run must agree on it (actors read its backlog)."""
    replication: Replication = field(default_factory=Replication)
    """Copies of every topic created and how many in sync (``RLSTREAM_REPLICATION_FACTOR``,
    ``RLSTREAM_MIN_INSYNC_REPLICAS``): one setting for every role of a run."""
    security: dict[str, str] = field(default_factory=dict, compare=False, repr=False,
                                     metadata={"secret": True})
    """librdkafka security settings (``security.protocol``, ``sasl.*``, ``ssl.*``) from
    ``RLSTREAM_KAFKA_*``; never written to a run config file (each process reads its own)."""

    @classmethod
    def from_environment(cls, env: Environment, kind: str | None = None, bootstrap: str | None = None,
                         log_dir: str | None = None, namespace: str | None = None,
                         learner_group: str | None = None, run_dir: str | Path | None = None) -> "BusConfig":
        """Flags win over the environment (RLSTREAM_BUS, KAFKA_BROKERS, RLSTREAM_NAMESPACE,
        RLSTREAM_RETENTION, RLSTREAM_LEARNER_GROUP, RLSTREAM_REPLICATION_FACTOR,
        RLSTREAM_MIN_INSYNC_REPLICAS, RLSTREAM_KAFKA_*). The namespace: ``namespace``, else
        RLSTREAM_NAMESPACE, else the one ``run_dir`` records (a tool reading a run), else legacy."""
        try:
            retention = parse_retention(env.retention)
        except ValueError as e:
            raise SystemExit(f"{ENV_RETENTION}: {e}") from None
        try:
            replication = Replication(*env.replication())
        except ValueError as e:
            raise SystemExit(str(e)) from None
        try:
            security = env.kafka_security()
        except ValueError as e:
            raise SystemExit(str(e)) from None
        group = learner_group or env.learner_group or DEFAULT_LEARNER_GROUP
        try:
            check_group(group)
        except ValueError as e:
            raise SystemExit(f"--learner-group / {ENV_LEARNER_GROUP}: {e}") from None
        return cls(
            kind=kind or env.bus or "memory",
            bootstrap=bootstrap or env.kafka_brokers or DEFAULT_BOOTSTRAP,
            log_dir=log_dir,
            retention=retention,
            namespace=(namespace if namespace is not None else env.namespace if env.namespace is not None
                       else run_namespace(run_dir) or "").strip(),
            learner_group=group,
            replication=replication,
            security=security,
        )
