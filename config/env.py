"""The process environment: every variable rlstream reads, named once and read once.

This module is the only reader of ``os.environ`` in rlstream (``tests/test_layers.py`` checks).
An entry point (``rlstream.cli``, the Faust entry, ``python -m rlstream.entry worker``, a bench script,
``localkafka``'s CLI) calls ``Environment.read()`` once and passes the typed values down; nothing
deeper looks at the environment. Standard library only: ``localkafka`` uses it before the package
is installed.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

#: Overrides the role's metrics port (``runtime.ports.DEFAULT_PORTS``; 0 = pick a free port).
ENV_METRICS_PORT = "RLSTREAM_METRICS_PORT"
#: Kafka bootstrap servers, comma separated ``host:port`` (e.g. ``kafka:9092``).
ENV_KAFKA_BROKERS = "KAFKA_BROKERS"
#: Redis URL (``redis://host:6379/0``) for claim-check weights and snapshots.
ENV_REDIS_URL = "REDIS_URL"
#: Directory of the host's one verified copy of each claim-checked blob (``streams.blobcache``),
#: or ``off``; unset: ``/dev/shm/rlstream-blobs-<uid>``.
ENV_BLOB_CACHE = "RLSTREAM_BLOB_CACHE"
#: Bus backend: ``memory`` (co-located default) or ``kafka``.
ENV_BUS = "RLSTREAM_BUS"
#: Snapshot store URL or path (``file:///data/snapshots``, ``redis://redis:6379/0``,
#: ``s3://bucket/prefix``).
ENV_SNAPSHOT_STORE = "RLSTREAM_SNAPSHOT_STORE"
#: An ``s3://`` snapshot store: the S3-compatible endpoint (unset: AWS), region and credentials,
#: under the AWS SDKs' standard names (``config.storage.ObjectStoreConfig``).
ENV_AWS_ENDPOINT_URL = "AWS_ENDPOINT_URL"
ENV_AWS_REGION, ENV_AWS_DEFAULT_REGION = "AWS_REGION", "AWS_DEFAULT_REGION"
ENV_AWS_ACCESS_KEY_ID, ENV_AWS_SECRET_ACCESS_KEY = "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"
ENV_AWS_SESSION_TOKEN = "AWS_SESSION_TOKEN"
#: Run identifier bound into every log line and event.
ENV_RUN_ID = "RLSTREAM_RUN_ID"
#: Actor index (its id is ``actor-<index>``), set per pod from the StatefulSet ordinal.
ENV_ACTOR_INDEX = "RLSTREAM_ACTOR_INDEX"
#: Stream processors started without a run config (the Faust worker, ``python -m rlstream.entry worker``):
#: staleness window (versions, ms, ``drop``/``downweight``), reorder timeout, algorithm, policy.
ENV_STALENESS_K = "RLSTREAM_STALENESS_K"
ENV_STALENESS_MS = "RLSTREAM_STALENESS_MS"
ENV_STALENESS_MODE = "RLSTREAM_STALENESS_MODE"
ENV_REORDER_TIMEOUT_MS = "RLSTREAM_REORDER_TIMEOUT_MS"
ENV_ALGO = "RLSTREAM_ALGO"
ENV_POLICY_ID = "RLSTREAM_POLICY_ID"
#: Run namespace of every role and tool started without ``--namespace``; unset: the legacy
#: unscoped topic and group names.
ENV_NAMESPACE = "RLSTREAM_NAMESPACE"
#: The learner's consumer group on rl.samples.prepared (``--learner-group``; default ``learner``).
ENV_LEARNER_GROUP = "RLSTREAM_LEARNER_GROUP"
#: Per-topic retention over the defaults (``config.bus.parse_retention``).
ENV_RETENTION = "RLSTREAM_RETENTION"
#: Copies of every topic a role creates (rlstream's topics and the Faust worker's changelogs), and
#: how many of them must be in sync for an ``acks=all`` write (the topics' ``min.insync.replicas``);
#: unset: the broker's ``default.replication.factor`` and ``min.insync.replicas``. A factor the
#: cluster cannot hold is refused where the topics are made (``streams.bus.kafka.ReplicationError``).
ENV_REPLICATION_FACTOR = "RLSTREAM_REPLICATION_FACTOR"
ENV_MIN_INSYNC_REPLICAS = "RLSTREAM_MIN_INSYNC_REPLICAS"
#: Run directory of a decoupled run, set for the Faust worker, which writes its summary there.
ENV_RUN_DIR = "RLSTREAM_RUN_DIR"
#: The name the supervisor gave this child (``streams``, ``streams-1``): its summary file's name.
ENV_PROCESS = "RLSTREAM_PROCESS"
#: A run's config file (``<run-dir>/config.json``): roles and the Faust worker take every setting
#: from it instead of flags and the variables above.
ENV_CONFIG = "RLSTREAM_CONFIG"
#: Prefix of the Kafka client security settings: ``RLSTREAM_KAFKA_SECURITY_PROTOCOL`` ->
#: ``security.protocol``, ``RLSTREAM_KAFKA_SASL_USERNAME`` -> ``sasl.username``,
#: ``RLSTREAM_KAFKA_SSL_CA_LOCATION`` -> ``ssl.ca.location`` (``kafka_security``): TLS with a CA and
#: optionally a client certificate, SASL PLAIN or SCRAM-SHA-256/512 (docs/howto/security.md).
ENV_KAFKA_PREFIX = "RLSTREAM_KAFKA_"
#: Pod or host name (the actor id's host part).
ENV_HOSTNAME = "HOSTNAME"
#: torchrun's variables of a data-parallel learner rank.
ENV_RANK, ENV_WORLD_SIZE, ENV_LOCAL_RANK = "RANK", "WORLD_SIZE", "LOCAL_RANK"
ENV_MASTER_ADDR, ENV_MASTER_PORT = "MASTER_ADDR", "MASTER_PORT"
#: The local Kafka manager (``localkafka``): Kafka version, cache directory, extra JVM options, JDK.
ENV_KAFKA_VERSION = "RLSTREAM_KAFKA_VERSION"
ENV_CACHE = "RLSTREAM_CACHE"
ENV_KAFKA_JAVA_OPTS = "RLSTREAM_KAFKA_JAVA_OPTS"
ENV_JAVA_HOME = "JAVA_HOME"

#: The variables a deployment manifest may set on an rlstream container (``tests/ops``).
ENV_VARS: tuple[str, ...] = (
    ENV_METRICS_PORT, ENV_KAFKA_BROKERS, ENV_REDIS_URL, ENV_BLOB_CACHE, ENV_BUS, ENV_SNAPSHOT_STORE,
    ENV_RUN_ID, ENV_ACTOR_INDEX, ENV_STALENESS_K, ENV_STALENESS_MS, ENV_STALENESS_MODE, ENV_ALGO,
    ENV_POLICY_ID, ENV_NAMESPACE, ENV_RUN_DIR, ENV_CONFIG, ENV_LEARNER_GROUP, ENV_AWS_ENDPOINT_URL, ENV_AWS_REGION,
    ENV_AWS_DEFAULT_REGION, ENV_AWS_ACCESS_KEY_ID, ENV_AWS_SECRET_ACCESS_KEY, ENV_AWS_SESSION_TOKEN,
    ENV_REPLICATION_FACTOR, ENV_MIN_INSYNC_REPLICAS,
)

_KAFKA_TOOL_VARS = (ENV_KAFKA_VERSION, ENV_KAFKA_JAVA_OPTS)


#: The Kafka clients' security protocols and the SASL mechanisms both kinds of client speak
#: (librdkafka: the roles and the in-process shell; aiokafka: the Faust shell).
KAFKA_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
#: librdkafka settings naming a file the client reads at start (a CA, a certificate, a key).
_KAFKA_FILES = ("ssl.ca.location", "ssl.certificate.location", "ssl.key.location")


def check_kafka_security(conf: Mapping[str, str], names: Mapping[str, str] | None = None, *,
                         complete: bool = True) -> None:
    """``ValueError`` for security settings no Kafka client could use: a protocol other than
    ``KAFKA_PROTOCOLS``, a SASL mechanism other than ``SASL_MECHANISMS``; with ``complete`` (the
    settings a client is about to be made with) also a SASL protocol without a mechanism, username
    or password, and a certificate or key file that cannot be read. The message names the
    variable (``names``: setting -> variable; else ``RLSTREAM_KAFKA_`` + the setting), never a
    password."""
    def var(key: str) -> str:
        return (names or {}).get(key) or ENV_KAFKA_PREFIX + key.upper().replace(".", "_")

    protocol = conf.get("security.protocol", "PLAINTEXT").strip().upper() or "PLAINTEXT"
    if protocol not in KAFKA_PROTOCOLS:
        raise ValueError(f"{var('security.protocol')}={conf['security.protocol']!r}: use one of "
                         f"{', '.join(KAFKA_PROTOCOLS)}")
    mechanism = (conf.get("sasl.mechanism") or conf.get("sasl.mechanisms") or "").strip().upper()
    if mechanism and mechanism not in SASL_MECHANISMS:
        raise ValueError(f"{var('sasl.mechanism')}={mechanism!r}: use one of {', '.join(SASL_MECHANISMS)}")
    if not complete:
        return
    if protocol.startswith("SASL_"):
        missing = [var(k) for k in ("sasl.mechanism", "sasl.username", "sasl.password")
                   if not conf.get(k) and not (k == "sasl.mechanism" and conf.get("sasl.mechanisms"))]
        if missing:
            raise ValueError(f"{var('security.protocol')}={protocol} logs in with a password: set {', '.join(missing)}")
    for key in _KAFKA_FILES:
        path = conf.get(key, "").strip()
        if path and not os.access(path, os.R_OK):
            why = "no such file" if not os.path.exists(path) else "not readable by this user"
            raise ValueError(f"{var(key)}={path}: {why}")


@dataclass(frozen=True)
class RankEnv:
    """torchrun's variables: the rank, the world, and whether a launcher set them."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launched: bool = False
    """True under a launcher (``learner.distributed.launch_ranks``, torchrun): one rank of many."""


@dataclass(frozen=True)
class Environment:
    """A snapshot of the process environment with typed accessors (``Environment.read()``)."""

    values: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def read(cls) -> "Environment":
        """The process environment now. Call once, at an entry point."""
        return cls(dict(os.environ))

    def get(self, name: str, default: str = "") -> str:
        """The variable stripped of spaces; ``default`` when unset or blank."""
        return self.values.get(name, "").strip() or default

    def optional(self, name: str) -> str | None:
        return self.get(name) or None

    # -- typed settings ----------------------------------------------------------------------
    def visible_devices(self) -> str:
        """Which GPUs this process may see, as the CUDA and NVIDIA container runtimes say."""
        return ", ".join(f"{n}={self.get(n, '(unset)')}" for n in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"))

    @property
    def kafka_brokers(self) -> str | None:
        return self.optional(ENV_KAFKA_BROKERS)

    @property
    def redis_url(self) -> str | None:
        return self.optional(ENV_REDIS_URL)

    @property
    def bus(self) -> str | None:
        return self.optional(ENV_BUS)

    @property
    def namespace(self) -> str | None:
        """The namespace variable; None when unset (blank is the legacy namespace, "")."""
        return self.values[ENV_NAMESPACE].strip() if ENV_NAMESPACE in self.values else None

    @property
    def learner_group(self) -> str | None:
        return self.optional(ENV_LEARNER_GROUP)

    @property
    def retention(self) -> str:
        return self.get(ENV_RETENTION)

    def replication(self) -> tuple[int | None, int | None]:
        """``(RLSTREAM_REPLICATION_FACTOR, RLSTREAM_MIN_INSYNC_REPLICAS)`` as positive integers,
        None where unset; ``ValueError`` naming the variable for anything else, or for more
        replicas in sync than there are copies."""
        out: list[int | None] = []
        for var in (ENV_REPLICATION_FACTOR, ENV_MIN_INSYNC_REPLICAS):
            raw = self.get(var)
            if not raw:
                out.append(None)
                continue
            try:
                value = int(raw)
            except ValueError:
                value = 0
            if value < 1:
                raise ValueError(f"{var} must be a positive integer, not {raw!r}")
            out.append(value)
        factor, insync = out
        if factor is not None and insync is not None and insync > factor:
            raise ValueError(f"{ENV_MIN_INSYNC_REPLICAS}={insync} is more than {ENV_REPLICATION_FACTOR}={factor}: "
                             "no write could ever be acknowledged")
        return factor, insync

    @property
    def snapshot_store(self) -> str | None:
        return self.optional(ENV_SNAPSHOT_STORE)

    @property
    def run_id(self) -> str | None:
        return self.optional(ENV_RUN_ID)

    @property
    def blob_cache(self) -> str | None:
        """The blob-cache setting as given (``off``, a directory); None when unset."""
        return self.optional(ENV_BLOB_CACHE)

    @property
    def config_path(self) -> str | None:
        return self.optional(ENV_CONFIG)

    @property
    def run_dir(self) -> str | None:
        return self.optional(ENV_RUN_DIR)

    @property
    def process(self) -> str | None:
        return self.optional(ENV_PROCESS)

    @property
    def hostname(self) -> str:
        """The pod or host name with characters other than ``A-Z a-z 0-9 _ . -`` made ``-``."""
        name = self.get(ENV_HOSTNAME) or socket.gethostname() or "actor"
        return re.sub(r"[^A-Za-z0-9_.-]", "-", name)[:100]

    def metrics_port(self, default: int) -> int:
        """``RLSTREAM_METRICS_PORT`` if set, else ``default``; ``ValueError`` for a non-port."""
        raw = self.get(ENV_METRICS_PORT)
        if not raw:
            return default
        try:
            port = int(raw)
        except ValueError:
            port = -1
        if not 0 <= port <= 65535:
            raise ValueError(f"{ENV_METRICS_PORT}={raw!r} is not a port number")
        return port

    def kafka_security(self) -> dict[str, str]:
        """librdkafka security settings: ``RLSTREAM_KAFKA_SASL_MECHANISM`` -> ``sasl.mechanism``
        (underscores become dots); only ``security.protocol``, ``sasl.*`` and ``ssl.*`` pass.

        ``ValueError`` naming the variable for a value no client could use: a protocol other than
        ``KAFKA_PROTOCOLS``, a SASL mechanism other than ``SASL_MECHANISMS``. Whether the files
        and the login are there is checked where a client is made (``check_kafka_security``
        with ``complete=True``): settings may be completed in code."""
        out: dict[str, str] = {}
        where: dict[str, str] = {}
        for name, value in self.values.items():
            if not name.startswith(ENV_KAFKA_PREFIX) or name in _KAFKA_TOOL_VARS:
                continue
            key = name[len(ENV_KAFKA_PREFIX):].lower().replace("_", ".")
            if key == "security.protocol" or key.startswith(("sasl.", "ssl.")):
                out[key], where[key] = value, name
        check_kafka_security(out, where, complete=False)
        return out

    def rank(self) -> RankEnv:
        rank = int(self.get(ENV_RANK, "0"))
        return RankEnv(rank, int(self.get(ENV_WORLD_SIZE, "1")), int(self.get(ENV_LOCAL_RANK, str(rank))),
                       launched=ENV_RANK in self.values)

    def streams_overrides(self) -> dict[str, object]:
        """``PrepareConfig`` fields the ``RLSTREAM_STALENESS_*``, ``RLSTREAM_REORDER_TIMEOUT_MS`` and
        ``RLSTREAM_POLICY_ID`` variables set; ``ValueError`` naming a bad value."""
        out: dict[str, object] = {}
        for var, key in ((ENV_REORDER_TIMEOUT_MS, "reorder_timeout_ms"), (ENV_STALENESS_K, "max_versions"),
                         (ENV_STALENESS_MS, "max_ms")):
            raw = self.get(var)
            if not raw:
                continue
            if key == "max_ms" and raw.lower() in ("none", "-1"):
                out[key] = None
                continue
            try:
                out[key] = int(raw)
            except ValueError:
                raise ValueError(f"{var} must be an integer, not {raw!r}") from None
        mode = self.get(ENV_STALENESS_MODE)
        if mode:
            if mode not in ("drop", "downweight"):
                raise ValueError(f"{ENV_STALENESS_MODE} must be drop or downweight, not {mode!r}")
            out["staleness_mode"] = mode
        if self.get(ENV_POLICY_ID):
            out["policy_id"] = self.get(ENV_POLICY_ID)
        return out

    @property
    def algo(self) -> str:
        return self.get(ENV_ALGO, "ppo")

    # -- the local Kafka manager -------------------------------------------------------------
    @property
    def kafka_version(self) -> str | None:
        return self.optional(ENV_KAFKA_VERSION)

    @property
    def cache_dir(self) -> str | None:
        return self.optional(ENV_CACHE)

    @property
    def kafka_java_opts(self) -> list[str]:
        return self.get(ENV_KAFKA_JAVA_OPTS).split()

    @property
    def java_home(self) -> str | None:
        return self.optional(ENV_JAVA_HOME)

    # -- children ----------------------------------------------------------------------------
    def child(self, set: Mapping[str, str | None] | None = None) -> dict[str, str]:
        """The environment of a child process: this one's with ``set`` applied (None removes)."""
        out = dict(self.values)
        for name, value in (set or {}).items():
            if value is None:
                out.pop(name, None)
            else:
                out[name] = value
        return out
