"""Local Apache Kafka broker manager (no Docker needed).

Fetches the Kafka jars from Maven Central with ``mvn``, formats a KRaft
storage directory and runs a combined broker+controller on 127.0.0.1: a
single-node cluster by default, or one node of an N-node cluster
(``node_id``, ``voters``, ``cluster_id``; ``localkafka.cluster.LocalCluster``).  Readiness is a Kafka client's metadata request listing this broker as alive
(librdkafka's admin client, or Kafka's own api-versions tool before the package's
dependencies are installed), never a sleep.

Standard library only: it must run before the package's dependencies are
installed (``python3 -m localkafka start`` from the repo root: ``localkafka/__main__.py``).

Command line (``localkafka.cli``)::

    rlstream broker fetch   [--version V]
    rlstream broker start   [--port 9092] [--controller-port P] [--data-dir D]
                            [--nodes N] [--fresh] [--foreground] [--timeout 120]
    rlstream broker stop    [--port 9092] [--data-dir D] [--nodes N] [--timeout 30]
    rlstream broker status  [--port 9092] [--data-dir D] [--nodes N]

One node keeps its data in ``--data-dir``, default ``<cache>/kafka-<ver>/data-<port>``.
``--nodes 3`` starts a local 3-node cluster (``localkafka.cluster.LocalCluster``): node i on
ports ``port + 2i`` (broker) and ``port + 2i + 1`` (controller), data under ``--data-dir``,
default ``<cache>/kafka-<ver>/cluster-<port>``; it prints the bootstrap list. ``start`` records
the data dir of its port, so ``status`` and ``stop`` with the same ``--port`` find the broker or
cluster without ``--data-dir`` or ``--nodes``.

Python API (used by tests)::

    kafka = LocalKafka(port=19092)
    kafka.start()            # fetch + format + launch + wait until ready
    kafka.bootstrap          # "127.0.0.1:19092"
    kafka.kill()             # simulate a crash (SIGKILL), data dir kept
    kafka.restart()          # stop + start on the same data dir
    kafka.stop()

Environment: ``RLSTREAM_KAFKA_VERSION`` (default version),
``RLSTREAM_CACHE`` (cache root, default ``~/.cache/rlstream``),
``RLSTREAM_KAFKA_JAVA_OPTS`` (extra JVM options), ``JAVA_HOME``.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Iterator, Mapping, NamedTuple, Sequence

from config.env import Environment  # standard library only: this runs before the package is installed
from config.limits import MAX_MESSAGE_BYTES

KAFKA_VERSION = "3.9.1"
SCALA_BINARY = "2.13"
DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"
# Kafka 3.x ships no logging backend at runtime; slf4j 1.7 + reload4j is what
# its own distribution uses.
LOGGING_DEPS_3X = (
    ("org.slf4j", "slf4j-reload4j", "1.7.36"),
    ("ch.qos.reload4j", "reload4j", "1.2.25"),
)
# Kafka 4.x moved to log4j2; kafka-server brings log4j-api/-core but the code
# still logs through slf4j 1.7, so the binding is log4j-slf4j-impl.
LOGGING_DEPS_4X = (
    ("org.apache.logging.log4j", "log4j-slf4j-impl", "2.24.3"),
    ("org.apache.logging.log4j", "log4j-core", "2.24.3"),
)

DEFAULT_PORT = 9092
DEFAULT_START_TIMEOUT = 120.0
DEFAULT_STOP_TIMEOUT = 30.0
HOST = "127.0.0.1"
JVM_HEAP = ("-Xms256m", "-Xmx1g")

MARKER = ".rlstream-complete"
PID_FILE = "broker.pid"
STATE_FILE = "broker.json"
STDOUT_LOG = "broker.out"

# Loggers that flood a dev broker's log at INFO.
NOISY_LOGGERS = (
    "kafka.request.logger",
    "kafka.network.RequestChannel$",
    "kafka.controller",
    "kafka.log",
    "kafka.log.LogCleaner",
    "kafka.coordinator",
    "kafka.cluster",
    "kafka.server.metadata",
    "kafka.server.KafkaConfig",
    "kafka.server.NodeToControllerRequestThread",
    "kafka.server.DelayedOperationPurgatory$ExpiredOperationReaper",
    "kafka.server.ClientQuotaManager$ThrottledChannelReaper",
    "kafka.server.ReplicaFetcherManager",
    "kafka.server.ReplicaAlterLogDirsManager",
    "kafka.authorizer.logger",
    "state.change.logger",
    "org.apache.kafka",
    "org.apache.zookeeper",
)


class BrokerError(RuntimeError):
    """Any failure to fetch, start or stop the local broker (message is user-facing)."""


class PortBusyError(BrokerError):
    """The port is held by something that is not a Kafka broker we manage."""

    def __init__(self, message: str, *, is_kafka: bool) -> None:
        super().__init__(message)
        self.is_kafka = is_kafka


# --------------------------------------------------------------------------
# paths and versions


def default_version(env: Environment | None = None) -> str:
    return (env or Environment.read()).kafka_version or KAFKA_VERSION


def cache_root(env: Environment | None = None) -> Path:
    """``RLSTREAM_CACHE``, else ``~/.cache/rlstream`` (``env`` None: this process's environment)."""
    given = (env or Environment.read()).cache_dir
    if given:
        return Path(given).expanduser()
    return Path.home() / ".cache" / "rlstream"


def kafka_home(version: str) -> Path:
    """``<cache>/kafka-<version>``: pom.xml, lib/, log4j config, default data dirs."""
    return cache_root() / f"kafka-{version}"


def major_version(version: str) -> int:
    try:
        return int(version.split(".", 1)[0])
    except ValueError:
        raise BrokerError(f"cannot parse Kafka version {version!r}") from None


def maven_coordinates(version: str) -> list[tuple[str, str, str]]:
    logging_deps = LOGGING_DEPS_4X if major_version(version) >= 4 else LOGGING_DEPS_3X
    return [("org.apache.kafka", f"kafka_{SCALA_BINARY}", version), *logging_deps]


def new_cluster_id() -> str:
    """A random 22-char base64url id, as ``kafka-storage.sh random-uuid`` makes.

    Like Kafka's own generator it never starts with '-' (it would be parsed
    as an option)."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


# --------------------------------------------------------------------------
# rendering


def render_pom(version: str) -> str:
    return render_maven_pom(f"kafka-runtime-{version}", maven_coordinates(version))


def render_maven_pom(artifact_id: str, coordinates: Sequence[tuple[str, str, str]]) -> str:
    """A throwaway pom whose only purpose is to list ``coordinates`` as dependencies."""
    deps = "\n".join(
        "    <dependency>\n"
        f"      <groupId>{g}</groupId>\n"
        f"      <artifactId>{a}</artifactId>\n"
        f"      <version>{v}</version>\n"
        "    </dependency>"
        for g, a, v in coordinates
    )
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        "<!-- Generated by localkafka.broker to fetch jars; throwaway. -->\n"
        '<project xmlns="http://maven.apache.org/POM/4.0.0">\n'
        "  <modelVersion>4.0.0</modelVersion>\n"
        "  <groupId>rlstream.local</groupId>\n"
        f"  <artifactId>{artifact_id}</artifactId>\n"
        "  <version>0</version>\n"
        "  <packaging>pom</packaging>\n"
        "  <dependencies>\n"
        f"{deps}\n"
        "  </dependencies>\n"
        "</project>\n"
    )


def render_log4j() -> str:
    """log4j 1.x config: console + rolling file in ``${kafka.logs.dir}``."""
    lines = [
        "# Generated by localkafka.broker",
        "log4j.rootLogger=INFO, stdout, file",
        "log4j.appender.stdout=org.apache.log4j.ConsoleAppender",
        "log4j.appender.stdout.layout=org.apache.log4j.PatternLayout",
        "log4j.appender.stdout.layout.ConversionPattern=[%d] %p %m (%c)%n",
        "log4j.appender.file=org.apache.log4j.RollingFileAppender",
        "log4j.appender.file.File=${kafka.logs.dir}/server.log",
        "log4j.appender.file.MaxFileSize=20MB",
        "log4j.appender.file.MaxBackupIndex=3",
        "log4j.appender.file.layout=org.apache.log4j.PatternLayout",
        "log4j.appender.file.layout.ConversionPattern=[%d] %p %m (%c)%n",
    ]
    lines += [f"log4j.logger.{name}=WARN" for name in NOISY_LOGGERS]
    # Keep the startup/shutdown milestones ("Kafka Server started") visible.
    lines += ["log4j.logger.kafka.server.KafkaRaftServer=INFO", "log4j.logger.kafka.Kafka=INFO"]
    return "\n".join(lines) + "\n"


def render_log4j2() -> str:
    """log4j2 config (Kafka 4.x), same shape as :func:`render_log4j`."""
    lines = [
        "# Generated by localkafka.broker",
        "status = warn",
        "appender.stdout.type = Console",
        "appender.stdout.name = STDOUT",
        "appender.stdout.layout.type = PatternLayout",
        "appender.stdout.layout.pattern = [%d] %p %m (%c)%n",
        "appender.file.type = RollingFile",
        "appender.file.name = FILE",
        "appender.file.fileName = ${sys:kafka.logs.dir}/server.log",
        "appender.file.filePattern = ${sys:kafka.logs.dir}/server.log.%i",
        "appender.file.layout.type = PatternLayout",
        "appender.file.layout.pattern = [%d] %p %m (%c)%n",
        "appender.file.policies.type = Policies",
        "appender.file.policies.size.type = SizeBasedTriggeringPolicy",
        "appender.file.policies.size.size = 20MB",
        "appender.file.strategy.type = DefaultRolloverStrategy",
        "appender.file.strategy.max = 3",
        "rootLogger.level = INFO",
        "rootLogger.appenderRef.stdout.ref = STDOUT",
        "rootLogger.appenderRef.file.ref = FILE",
    ]
    for i, name in enumerate(NOISY_LOGGERS):
        lines += [f"logger.n{i}.name = {name}", f"logger.n{i}.level = WARN"]
    return "\n".join(lines) + "\n"


def server_properties(
    *,
    port: int,
    controller_port: int,
    log_dir: Path | str,
    version: str = KAFKA_VERSION,
    node_id: int = 1,
    voters: str | None = None,
    extra: Mapping[str, object] | None = None,
    host: str = HOST,
) -> dict[str, str]:
    """Settings for a combined broker+controller listening on and advertising ``host``
    (127.0.0.1 unless told: a simulated host's address in ``testbed/netns.py``).

    ``voters`` is KRaft's ``controller.quorum.voters`` of every node of the cluster
    (``id@host:controller_port,...``); None: this node alone. The internal topics' replication
    (consumer offsets, transaction state) and the topic defaults (``default.replication.factor``,
    ``min.insync.replicas``) follow the number of voters: ``min(3, N)`` copies, and 2 of them
    in sync when there are 2 or more (a single node keeps Kafka's defaults)."""
    voters = voters or f"{node_id}@{host}:{controller_port}"
    copies = cluster_replication(len(quorum_nodes(voters)))
    props: dict[str, object] = {
        "process.roles": "broker,controller",
        "node.id": node_id,
        "controller.quorum.voters": voters,
        "listeners": f"PLAINTEXT://{host}:{port},CONTROLLER://{host}:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://{host}:{port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": str(log_dir),
        "num.partitions": 1,
        "auto.create.topics.enable": "true",
        "offsets.topic.replication.factor": copies.factor,
        "offsets.topic.num.partitions": 1,
        "transaction.state.log.replication.factor": copies.factor,
        # The default (2) makes every transaction fail on one node.
        "transaction.state.log.min.isr": copies.min_insync,
        "transaction.state.log.num.partitions": 1,
        "group.initial.rebalance.delay.ms": 0,
        # Large payloads (weights, batched trajectories) up to 16 MiB.
        "message.max.bytes": MAX_MESSAGE_BYTES,
        "replica.fetch.max.bytes": MAX_MESSAGE_BYTES,
        # Keep the whole history so runs are replayable.
        "log.retention.hours": -1,
        "log.retention.bytes": -1,
        # After a crash (SIGKILL) the restarted controller refuses the broker's
        # re-registration (DUPLICATE_BROKER_REGISTRATION) until the old session
        # expires: 9 s by default.  A shorter session makes crash-restart ~3 s.
        "broker.heartbeat.interval.ms": 500,
        "broker.session.timeout.ms": 3000,
    }
    if copies.factor > 1:
        props["default.replication.factor"] = copies.factor
        props["min.insync.replicas"] = copies.min_insync
    if major_version(version) >= 4:
        props["share.coordinator.state.topic.replication.factor"] = copies.factor
        props["share.coordinator.state.topic.min.isr"] = copies.min_insync
    if extra:
        props.update(extra)
    return {k: str(v) for k, v in props.items()}


class Replication(NamedTuple):
    """How many copies of a partition a cluster keeps, and how many must be in sync for a write
    with ``acks=all`` to succeed."""

    factor: int
    min_insync: int


def cluster_replication(nodes: int) -> Replication:
    """What a cluster of ``nodes`` brokers holds: ``min(3, nodes)`` copies, ``min(2, copies)``
    in sync (one node: 1 and 1; three or more: 3 and 2, so one broker may be lost)."""
    factor = max(1, min(3, nodes))
    return Replication(factor, min(2, factor))


def quorum_nodes(voters: str) -> list[tuple[int, str, int]]:
    """``controller.quorum.voters`` -> [(node id, host, controller port)]; BrokerError if malformed."""
    out = []
    for item in filter(None, (v.strip() for v in voters.split(","))):
        m = re.fullmatch(r"(\d+)@(.+):(\d+)", item)
        if m is None:
            raise BrokerError(f"controller.quorum.voters entry {item!r}: expected ID@HOST:PORT")
        out.append((int(m[1]), m[2], int(m[3])))
    if not out:
        raise BrokerError("controller.quorum.voters is empty")
    return out


def render_properties(props: Mapping[str, str]) -> str:
    body = "".join(f"{k}={v}\n" for k, v in props.items())
    return "# Generated by localkafka.broker; rewritten on every start.\n" + body


# --------------------------------------------------------------------------
# Readiness probe: a TCP connect, then a Kafka client asks the broker for its metadata.
# With confluent-kafka importable (the installed package) that is librdkafka's admin client;
# before the package is installed (``.ci/run`` starts the broker with the system python3,
# stdlib only) it is one of Kafka's own tools from the fetched jars: ``kafka-broker-api-versions``
# for a probe, and for the wait after a start one long-lived ``kafka-configs --describe``.


def _listening(host: str, port: int, timeout: float) -> str | None:
    """None when a TCP connect to host:port works, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return f"connect: {exc}"


def _admin_probe(host: str, port: int, timeout: float) -> tuple[list, str | None]:
    """(alive brokers, error) from librdkafka's metadata request."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": f"{host}:{port}", "log_level": 0,
                         "socket.connection.setup.timeout.ms": max(1000, int(timeout * 1000))})
    try:
        md = admin.list_topics(timeout=timeout)
    except KafkaException as exc:
        return [], f"no Kafka metadata within {timeout:g}s (timed out: {exc.args[0]})"
    return sorted((b.id, b.host, b.port) for b in md.brokers.values()), None


API_VERSIONS_LINE = re.compile(r"^(\S+):(\d+) \(id: (-?\d+) rack: \S+\) -> \(", re.M)


def api_versions_tool(version: str) -> str:
    """Main class of Kafka's broker-api-versions tool in ``version``."""
    return ("org.apache.kafka.tools.BrokerApiVersionsCommand" if major_version(version) >= 4
            else "kafka.admin.BrokerApiVersionsCommand")


def _tool_cmd(version: str, main: str, *args: str) -> list[str]:
    """Command line of one of Kafka's own command-line tools from the fetched jars."""
    log = ("-Dlog4j2.configurationFile=" if major_version(version) >= 4 else "-Dlog4j.configuration=file:")
    return [find_java(), "-Xmx128m", "-XX:TieredStopAtLevel=1", f"{log}{write_log_config(version)}",
            "-cp", str(lib_dir(version) / "*"), main, *args]


def _java_probe(host: str, port: int, timeout: float) -> tuple[list, str | None]:
    """(alive brokers, error) from Kafka's own ``kafka-broker-api-versions`` tool."""
    version = default_version()
    if not is_fetched(version):
        return [], f"Kafka {version} jars not fetched; cannot run its api-versions tool"
    cmd = _tool_cmd(version, api_versions_tool(version), "--bootstrap-server", f"{host}:{port}")
    # The JVM's start alone takes seconds on a loaded machine: the client's own timeout
    # bounds the request, this bounds the process.
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 60.0))
    except subprocess.TimeoutExpired:
        return [], "kafka-broker-api-versions timed out"
    brokers = [(int(i), h, int(p)) for h, p, i in API_VERSIONS_LINE.findall(res.stdout)]
    if brokers:
        return brokers, None
    lines = (res.stderr + res.stdout).splitlines()
    why = next((ln.strip() for ln in lines if "Exception" in ln or "Error" in ln), _tail(res.stderr, 1))
    return [], f"kafka-broker-api-versions exit {res.returncode}: {why}"


class _ReadyWatch:
    """Kafka's ``kafka-configs --describe`` on the broker, started with the broker: its admin
    client retries until the broker answers, so the tool's JVM starts while the broker's does
    (the stdlib path of ``wait_ready``; one JVM per start instead of one per probe)."""

    def __init__(self, version: str, bootstrap: str) -> None:
        self.cmd = _tool_cmd(version, "kafka.admin.ConfigCommand" if major_version(version) < 4
                             else "org.apache.kafka.tools.ConfigCommand", "--bootstrap-server", bootstrap,
                             "--describe", "--entity-type", "brokers", "--entity-default")
        self.error = "kafka-configs has not answered yet"
        self._proc: subprocess.Popen | None = None

    def ready(self) -> bool:
        """True once the tool described the cluster; restarts it after a failed try."""
        if self._proc is None:
            self._proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, text=True)
            return False
        if self._proc.poll() is None:
            return False
        out, self._proc = self._proc.communicate()[0], None
        if "configs for brokers" in out:
            return True
        self.error = f"kafka-configs: {_tail(out, 1)}"
        return False

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


def probe(host: str, port: int, timeout: float = 2.0, *, via: str | None = None) -> dict:
    """Whether a Kafka broker is ready on host:port.

    ``via`` picks the client (``confluent-kafka`` or ``java``); by default confluent-kafka
    when importable, else java.  Returns ``listening`` (TCP connect worked), ``kafka`` and ``ready`` (a Kafka client got
    metadata listing at least one alive broker), ``brokers`` ((id, host, port) each),
    ``via`` (``confluent-kafka`` or ``java``) and ``error`` (why not, as text)."""
    out: dict = {"listening": False, "kafka": False, "ready": False, "brokers": [],
                 "via": None, "error": _listening(host, port, timeout)}
    if out["error"] is not None:
        return out
    out["listening"] = True
    if via is None:
        try:
            import confluent_kafka  # noqa: F401  (installed with the package)
            via = "confluent-kafka"
        except ImportError:
            via = "java"
    out["via"] = via
    check = {"confluent-kafka": _admin_probe, "java": _java_probe}[via]
    out["brokers"], out["error"] = check(host, port, timeout)
    out["kafka"] = out["ready"] = bool(out["brokers"])
    return out


def is_ready(port: int = DEFAULT_PORT, host: str = HOST, timeout: float = 2.0) -> bool:
    return probe(host, port, timeout)["ready"]


def port_is_free(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRNOTAVAIL  # not an address of this host: nothing here holds it
    return True


# --------------------------------------------------------------------------
# tools


def find_java(env: Environment | None = None) -> str:
    home = (env or Environment.read()).java_home
    if home and (Path(home) / "bin" / "java").is_file():
        return str(Path(home) / "bin" / "java")
    java = shutil.which("java")
    if not java:
        raise BrokerError(
            "java not found: install a JDK/JRE 17+ "
            "(e.g. `apt-get install -y openjdk-17-jre-headless`) or set JAVA_HOME"
        )
    return java


def java_major(java: str) -> int | None:
    try:
        res = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in (res.stderr + res.stdout).splitlines():
        if "version" in line and '"' in line:
            ver = line.split('"')[1]
            head = ver.split(".")
            try:
                return int(head[1]) if head[0] == "1" else int(head[0].split("-")[0])
            except (ValueError, IndexError):
                return None
    return None


def check_java(version: str) -> str:
    java = find_java()
    need = 17 if major_version(version) >= 4 else 11
    have = java_major(java)
    if have is not None and have < need:
        raise BrokerError(f"{java} is Java {have}; Kafka {version} needs Java {need}+")
    return java


def find_mvn() -> str:
    mvn = shutil.which("mvn")
    if not mvn:
        raise BrokerError(
            "mvn not found: install Maven (e.g. `apt-get install -y maven`) "
            "to fetch the Kafka jars"
        )
    return mvn


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(_ANSI.sub("", text).rstrip().splitlines()[-lines:])


def tail_file(path: Path, lines: int = 60) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * 1024))
            return _tail(f.read().decode("utf-8", "replace"), lines)
    except OSError:
        return f"(no log at {path})"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


# --------------------------------------------------------------------------
# fetch


def lib_dir(version: str) -> Path:
    return kafka_home(version) / "lib"


def log_config_path(version: str) -> Path:
    name = "log4j2.properties" if major_version(version) >= 4 else "log4j.properties"
    return kafka_home(version) / name


def is_fetched(version: str) -> bool:
    return maven_is_fetched(lib_dir(version), maven_coordinates(version))


def maven_is_fetched(lib: Path, coordinates: Sequence[tuple[str, str, str]]) -> bool:
    """Whether ``lib`` holds a complete earlier fetch of exactly ``coordinates``."""
    try:
        info = json.loads((lib / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if info.get("coordinates") != [":".join(c) for c in coordinates]:
        return False
    return all((lib / j).is_file() for j in info.get("jars", []))


def write_log_config(version: str) -> Path:
    path = log_config_path(version)
    text = render_log4j2() if major_version(version) >= 4 else render_log4j()
    if not path.is_file() or path.read_text() != text:
        _atomic_write(path, text)
    return path


def fetch(version: str | None = None, *, quiet: bool = False) -> Path:
    """Download Kafka ``version`` and its runtime deps into ``<cache>/kafka-<ver>/lib``.

    Idempotent: a marker written after success makes later calls return at once."""
    version = version or default_version()
    write_log_config(version)
    return fetch_maven(kafka_home(version), maven_coordinates(version), what=f"Kafka {version}",
                       expect=f"kafka_{SCALA_BINARY}-{version}", quiet=quiet)


def fetch_maven(home: Path, coordinates: Sequence[tuple[str, str, str]], *, what: str,
                expect: str | None = None, quiet: bool = False) -> Path:
    """Download Maven ``coordinates`` (group, artifact, version) and their runtime deps from
    Maven Central into ``home/lib`` with ``mvn`` and the pinned dependency plugin; returns the
    lib dir. Idempotent and safe across processes (a lock, a marker written after success).
    ``expect``: a jar name prefix that must be among the jars; ``what`` names it in messages."""
    home = Path(home)
    lib = home / "lib"
    with _file_lock(home / ".fetch.lock"):
        if maven_is_fetched(lib, coordinates):
            return lib
        mvn = find_mvn()
        (home / "pom.xml").write_text(render_maven_pom(f"{home.name}-runtime", coordinates))
        staging = home / "lib.partial"
        shutil.rmtree(staging, ignore_errors=True)
        cmd = [
            mvn, "-B", "-q", "-f", str(home / "pom.xml"),
            # -U: retry artifacts whose earlier download failed (cached misses)
            "-U", "-Dstyle.color=never",
            f"{DEPENDENCY_PLUGIN}:copy-dependencies",
            "-DincludeScope=runtime",
            f"-DoutputDirectory={staging}",
        ]
        if not quiet:
            print(f"rlstream broker: fetching {what} jars with mvn into {lib} ...",
                  file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            res = subprocess.run(cmd, cwd=home, capture_output=True, text=True, timeout=1800)
        except subprocess.TimeoutExpired as exc:
            raise BrokerError(f"mvn timed out after {exc.timeout:.0f}s: {' '.join(cmd)}") from None
        if res.returncode != 0:
            raise BrokerError(
                f"mvn failed (exit {res.returncode}) fetching {what}:\n"
                f"  {' '.join(cmd)}\n{_tail(res.stdout + res.stderr)}"
            )
        jars = sorted(p.name for p in staging.glob("*.jar"))
        if expect and not any(j.startswith(expect) for j in jars):
            raise BrokerError(f"mvn succeeded but no {expect} jar in {staging}")
        shutil.rmtree(lib, ignore_errors=True)
        os.replace(staging, lib)
        info = {
            "what": what,
            "coordinates": [":".join(c) for c in coordinates],
            "jars": jars,
            "bytes": sum((lib / j).stat().st_size for j in jars),
            "fetch_seconds": round(time.monotonic() - t0, 1),
        }
        (lib / MARKER).write_text(json.dumps(info, indent=1) + "\n")
        if not quiet:
            print(f"rlstream broker: {len(jars)} jars, {info['bytes'] / 1e6:.1f} MB "
                  f"in {info['fetch_seconds']}s", file=sys.stderr, flush=True)
        return lib


# --------------------------------------------------------------------------
# process helpers


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still "exists" for kill(0); treat it as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return True


def _pid_cmdline(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return None


class LocalKafka:
    """A KRaft Kafka node (combined broker+controller) on 127.0.0.1 managed from Python: a
    single-node cluster by default, or node ``node_id`` of the cluster whose
    ``controller.quorum.voters`` is ``voters``, formatted with the cluster's ``cluster_id``
    (``localkafka.cluster.LocalCluster`` makes both for N nodes).

    The data dir (default ``<cache>/kafka-<ver>/data-<port>``) holds the
    formatted storage, server.properties, the pid/state files and logs; it
    survives :meth:`stop`, :meth:`kill` and :meth:`restart`, so topics and
    offsets persist across broker restarts."""

    def __init__(
        self,
        port: int = DEFAULT_PORT,
        version: str | None = None,
        data_dir: str | os.PathLike | None = None,
        *,
        controller_port: int | None = None,
        extra_properties: Mapping[str, object] | None = None,
        heap: Sequence[str] = JVM_HEAP,
        quiet: bool = False,
        env: Environment | None = None,
        host: str = HOST,
        node_id: int = 1,
        voters: str | None = None,
        cluster_id: str | None = None,
    ) -> None:
        """``node_id``, ``voters`` (every node's ``id@host:controller_port``) and ``cluster_id``
        (one 22-character id shared by the nodes, :func:`new_cluster_id`): this node's place in
        a cluster; by default a cluster of this node alone with a random id."""
        self.env = env or Environment.read()  # RLSTREAM_KAFKA_VERSION / _JAVA_OPTS, read once
        self.node_id = int(node_id)
        self.voters = voters
        self.cluster_id = cluster_id
        self.host = host  # the address it listens on and advertises
        self.port = int(port)
        self.controller_port = int(controller_port) if controller_port else self.port + 1
        self.version = version or default_version(self.env)
        major_version(self.version)
        self.data_dir = Path(data_dir).expanduser().resolve() if data_dir else (
            kafka_home(self.version) / f"data-{self.port}")
        self.extra_properties = dict(extra_properties or {})
        self.heap = tuple(heap)
        self.quiet = quiet
        self._proc: subprocess.Popen | None = None

    # -- paths
    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def log_dirs(self) -> Path:
        return self.data_dir / "kraft-logs"

    @property
    def properties_path(self) -> Path:
        return self.data_dir / "server.properties"

    @property
    def pid_path(self) -> Path:
        return self.data_dir / PID_FILE

    @property
    def stdout_log(self) -> Path:
        return self.data_dir / STDOUT_LOG

    @property
    def server_log(self) -> Path:
        return self.data_dir / "logs" / "server.log"

    def _say(self, msg: str) -> None:
        if not self.quiet:
            print(f"rlstream broker: {msg}", file=sys.stderr, flush=True)

    # -- state
    @property
    def pid(self) -> int | None:
        """Pid of the broker this data dir's pid file names, if it is alive."""
        if self._proc is not None:
            return self._proc.pid if self._proc.poll() is None else None
        try:
            pid = int(self.pid_path.read_text().strip())
        except (OSError, ValueError):
            return None
        if not _pid_alive(pid):
            return None
        cmd = _pid_cmdline(pid)
        if cmd is not None and str(self.properties_path) not in cmd:
            return None  # pid reused by an unrelated process
        return pid

    def is_running(self) -> bool:
        return self.pid is not None

    def is_ready(self, timeout: float = 2.0) -> bool:
        return probe(self.host, self.port, timeout)["ready"]

    def status(self) -> dict:
        """``running``: this data dir's broker process is alive; ``ready``: it is, and answers as
        Kafka on its port; ``answering``: some Kafka answers on the port (with a ``note`` when it
        is not this data dir's)."""
        pid = self.pid
        answering = self.is_ready()
        out = {
            "running": pid is not None,
            "pid": pid,
            "node_id": self.node_id,
            "port": self.port,
            "controller_port": self.controller_port,
            "version": self.version,
            "data_dir": str(self.data_dir),
            "bootstrap": self.bootstrap,
            "ready": pid is not None and answering,
            "answering": answering,
        }
        if answering and pid is None:
            out["note"] = (f"a Kafka broker answers on {self.bootstrap}, but none runs from {self.data_dir}: "
                           "give status and stop the --data-dir it was started with")
        return out

    def log_tail(self, lines: int = 60) -> str:
        path = self.stdout_log if self.stdout_log.exists() else self.server_log
        return tail_file(path, lines)

    # -- setup
    def fetch(self) -> Path:
        return fetch(self.version, quiet=self.quiet)

    def is_formatted(self) -> bool:
        return (self.log_dirs / "meta.properties").is_file()

    def write_properties(self) -> Path:
        props = server_properties(
            port=self.port, controller_port=self.controller_port, log_dir=self.log_dirs,
            version=self.version, node_id=self.node_id, voters=self.voters,
            extra=self.extra_properties, host=self.host)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.properties_path, render_properties(props))
        return self.properties_path

    def _log_opts(self) -> list[str]:
        logcfg = log_config_path(self.version)
        logprop = ("-Dlog4j2.configurationFile=" if major_version(self.version) >= 4
                   else "-Dlog4j.configuration=file:") + str(logcfg)
        return [logprop, f"-Dkafka.logs.dir={self.data_dir / 'logs'}"]

    def _java_cmd(self, java: str, main: str, *args: str) -> list[str]:
        extra = self.env.kafka_java_opts
        return [
            java, *self.heap, "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20",
            "-Djava.awt.headless=true", *self._log_opts(), *extra,
            "-cp", str(lib_dir(self.version) / "*"), main, *args,
        ]

    def format(self, java: str | None = None) -> None:
        """``StorageTool format`` the log dir once (no-op when meta.properties exists), with
        the cluster's id (``cluster_id``; a new random one for a node alone)."""
        if self.is_formatted():
            return
        java = java or check_java(self.version)
        self.write_properties()
        cid = self.cluster_id or new_cluster_id()
        cmd = [java, "-Xmx256m", *self._log_opts(), "-cp", str(lib_dir(self.version) / "*"),
               "kafka.tools.StorageTool", "format", "-t", cid, "-c", str(self.properties_path)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise BrokerError(f"kafka StorageTool format failed (exit {res.returncode}):\n"
                              f"{_tail(res.stdout + res.stderr)}")
        self._say(f"formatted {self.log_dirs} (cluster id {cid})")

    def wipe(self) -> None:
        """Delete the data dir (stops our broker first)."""
        if self.is_running():
            self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def _preflight(self) -> None:
        """Refuse ports held by something else (and say whether it is a Kafka)."""
        for port, what in ((self.port, "broker"), (self.controller_port, "controller")):
            p = probe(self.host, port, timeout=2.0)
            if p["kafka"]:
                raise PortBusyError(
                    f"a Kafka broker not managed from {self.data_dir} already answers on "
                    f"{self.host}:{port}", is_kafka=True)
            if p["listening"] or not port_is_free(port, self.host):
                raise PortBusyError(
                    f"{what} port {self.host}:{port} is in use by something that is not Kafka "
                    f"({p['error'] or 'bind failed'}); pick another with --port/--controller-port",
                    is_kafka=False)

    def _prepare(self) -> str:
        java = check_java(self.version)
        self.fetch()
        write_log_config(self.version)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "logs").mkdir(exist_ok=True)
        self.format(java)
        self.write_properties()
        return java

    # -- lifecycle
    def start(self, timeout: float = DEFAULT_START_TIMEOUT) -> None:
        """Fetch, format and launch the broker detached, then wait until ready.

        No-op (after waiting for readiness) if this data dir's broker already
        runs.  Raises :class:`PortBusyError` if another process holds the
        port, :class:`BrokerError` on any failure (with the log tail)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with _file_lock(self.data_dir / ".start.lock"):
            self._start_locked(timeout)

    def _start_locked(self, timeout: float) -> None:
        if self.is_running():
            self.wait_ready(timeout)
            return
        t0 = time.monotonic()
        self._launch()
        try:
            self.wait_ready(timeout)
        except BrokerError:
            self.kill()
            raise
        self._say(f"Kafka {self.version} ready on {self.bootstrap} (pid {self.pid}, "
                  f"{time.monotonic() - t0:.1f}s, data {self.data_dir})")

    def launch(self) -> None:
        """Format if needed and start the node detached, without waiting for it: the nodes of a
        cluster are launched together, since none is ready before a majority of them runs
        (``wait_ready`` then). No-op if this data dir's node already runs."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with _file_lock(self.data_dir / ".start.lock"):
            if not self.is_running():
                self._launch()

    def _launch(self) -> None:
        self._preflight()
        java = self._prepare()
        cmd = self._java_cmd(java, "kafka.Kafka", str(self.properties_path))
        with open(self.stdout_log, "ab") as out:
            out.write(f"\n===== rlstream broker start {time.strftime('%Y-%m-%dT%H:%M:%S')} "
                      f"=====\n".encode())
            out.flush()
            self._proc = subprocess.Popen(
                cmd, cwd=self.data_dir, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
        self._write_state(self._proc.pid)

    def _write_state(self, pid: int) -> None:
        _atomic_write(self.pid_path, f"{pid}\n")
        state = {"pid": pid, "port": self.port, "controller_port": self.controller_port,
                 "node_id": self.node_id, "version": self.version, "data_dir": str(self.data_dir),
                 "started_at": time.time()}
        _atomic_write(self.data_dir / STATE_FILE, json.dumps(state, indent=1) + "\n")

    def wait_ready(self, timeout: float = DEFAULT_START_TIMEOUT) -> None:
        """Until a Kafka client sees the broker (confluent-kafka's probe when importable, else
        one long-lived run of Kafka's own tool), the broker's exit or ``timeout``."""
        deadline = time.monotonic() + timeout
        try:
            import confluent_kafka  # noqa: F401

            watch = None
        except ImportError:
            watch = _ReadyWatch(self.version, self.bootstrap)
        try:
            while True:
                if not self.is_running():
                    code = self._proc.returncode if self._proc is not None else None
                    raise BrokerError(
                        f"Kafka broker exited during startup (exit {code}); log tail "
                        f"({self.stdout_log}):\n{self.log_tail()}")
                if watch is not None:
                    ready, error = watch.ready(), watch.error
                else:
                    last = probe(self.host, self.port, timeout=2.0)
                    ready, error = last["ready"], last["error"]
                if ready:
                    return
                if time.monotonic() >= deadline:
                    raise BrokerError(
                        f"Kafka broker on {self.bootstrap} not ready after {timeout:g}s "
                        f"(last probe: {error}); log tail ({self.stdout_log}):\n"
                        f"{self.log_tail()}")
                time.sleep(0.25)
        finally:
            if watch is not None:
                watch.close()

    def run_foreground(self) -> int:
        """Run attached (replaces this process with java; for users/compose)."""
        self._preflight()
        java = self._prepare()
        cmd = self._java_cmd(java, "kafka.Kafka", str(self.properties_path))
        self._write_state(os.getpid())  # exec keeps the pid
        sys.stdout.flush()
        sys.stderr.flush()
        os.chdir(self.data_dir)
        os.execv(java, cmd)
        return 0  # pragma: no cover

    def _signal(self, pid: int, sig: int) -> None:
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def _wait_exit(self, pid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.pid == pid:
                if self._proc.poll() is not None:
                    return True
            elif not _pid_alive(pid):
                return True
            time.sleep(0.1)
        return False

    def _cleanup(self) -> None:
        for name in (PID_FILE, STATE_FILE):
            with contextlib.suppress(FileNotFoundError):
                (self.data_dir / name).unlink()
        self._proc = None

    def stop(self, timeout: float = DEFAULT_STOP_TIMEOUT) -> bool:
        """SIGTERM the broker's process group, SIGKILL after ``timeout``.

        Returns True if a broker was running.  The data dir is kept."""
        pid = self.pid
        if pid is None:
            self._cleanup()
            return False
        self._signal(pid, signal.SIGTERM)
        if not self._wait_exit(pid, timeout):
            self._say(f"broker pid {pid} did not exit in {timeout:.0f}s; SIGKILL")
            self._signal(pid, signal.SIGKILL)
            self._wait_exit(pid, 10)
        self._cleanup()
        self._wait_port_free()
        return True

    def kill(self) -> bool:
        """SIGKILL the broker at once (crash simulation); data dir kept."""
        pid = self.pid
        if pid is None:
            self._cleanup()
            return False
        self._signal(pid, signal.SIGKILL)
        self._wait_exit(pid, 10)
        self._cleanup()
        self._wait_port_free()
        return True

    def _wait_port_free(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if port_is_free(self.port, self.host) and port_is_free(self.controller_port, self.host):
                return
            time.sleep(0.1)

    def restart(self, timeout: float = DEFAULT_START_TIMEOUT) -> None:
        """Stop (gracefully) and start again on the same data dir."""
        self.stop()
        self.start(timeout)

    def __enter__(self) -> "LocalKafka":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return (f"LocalKafka(port={self.port}, version={self.version!r}, "
                f"data_dir='{self.data_dir}')")


if __name__ == "__main__":  # the command line moved to localkafka/__main__.py (no import of cli here)
    print("python3 -m localkafka.broker moved: run python3 -m localkafka (fetch, start, stop, status)",
          file=sys.stderr)
    sys.exit(2)
