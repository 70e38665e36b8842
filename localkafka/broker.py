"""One local Kafka node's lifecycle: ``LocalKafka`` formats a KRaft storage directory, launches a
combined broker+controller on 127.0.0.1 (detached or in the foreground), waits until a Kafka client
sees it (``localkafka.probe``, never a sleep), and stops, kills or restarts it, finding its process
again from the pid file in its data dir. A single-node cluster by default, or one node of an
N-node cluster (``node_id``, ``voters``, ``cluster_id``; ``localkafka.cluster.LocalCluster``), which
may also be a broker-only or a controller-only node (``roles``).
Standard library only.

Python API (used by tests)::

    kafka = LocalKafka(port=19092)
    kafka.start()            # fetch + format + launch + wait until ready
    kafka.bootstrap          # "127.0.0.1:19092"
    kafka.kill()             # simulate a crash (SIGKILL), data dir kept
    kafka.restart()          # stop + start on the same data dir
    kafka.stop()

Environment: ``RLSTREAM_KAFKA_VERSION`` (default version), ``RLSTREAM_CACHE`` (cache root, default
``~/.cache/rlstream``), ``RLSTREAM_KAFKA_JAVA_OPTS`` (extra JVM options), ``JAVA_HOME``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Mapping, Sequence

from config.env import Environment  # standard library only: this runs before the package is installed
from localkafka.fetch import check_java, fetch, write_log_config
from localkafka.paths import (
    DEFAULT_PORT,
    HOST,
    BrokerError,
    PortBusyError,
    _atomic_write,
    _file_lock,
    _tail,
    default_version,
    kafka_home,
    lib_dir,
    log_config_path,
    major_version,
    tail_file,
)
from localkafka.probe import _listening, _ReadyWatch, port_is_free, probe
from localkafka.render import BROKER, COMBINED, CONTROLLER, render_properties, server_properties
from localkafka.security import Security, scram_format_args

DEFAULT_START_TIMEOUT = 120.0
DEFAULT_STOP_TIMEOUT = 30.0
JVM_HEAP = ("-Xms256m", "-Xmx1g")

PID_FILE = "broker.pid"
STATE_FILE = "broker.json"
STDOUT_LOG = "broker.out"


def new_cluster_id() -> str:
    """A random 22-char base64url id, as ``kafka-storage.sh random-uuid`` makes.

    Like Kafka's own generator it never starts with '-' (it would be parsed
    as an option)."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


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
        security: Security | None = None,
        roles: str = COMBINED,
        brokers: int | None = None,
    ) -> None:
        """``node_id``, ``voters`` (every node's ``id@host:controller_port``) and ``cluster_id``
        (one 22-character id shared by the nodes, :func:`new_cluster_id`): this node's place in
        a cluster; by default a cluster of this node alone with a random id. ``security``: TLS and
        SASL listeners beside the PLAINTEXT one, and their accounts (``localkafka.security``;
        SCRAM accounts are stored when the node is formatted).
        ``roles``: ``process.roles`` (``localkafka.render``: ``COMBINED``, ``BROKER`` or
        ``CONTROLLER``; a controller-only node listens on ``controller_port`` alone and is ready
        when that port accepts a connection); ``brokers``: how many brokers the cluster has, which
        its replication defaults follow (None: every voter is one)."""
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
        self.security = security
        self.roles = roles
        self.brokers = brokers
        self._proc: subprocess.Popen | None = None

    # -- paths
    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def is_broker(self) -> bool:
        """Whether this node has the broker role (a controller-only node has no broker listener)."""
        return self.roles != CONTROLLER

    @property
    def address(self) -> str:
        """Where this node answers: its broker listener, or a controller-only node's controller port."""
        return self.bootstrap if self.is_broker else f"{self.host}:{self.controller_port}"

    def _ports(self) -> list[tuple[int, str]]:
        """The ports this node listens on, with what each is."""
        return [(p, w) for p, w, roles in ((self.port, "broker", (COMBINED, BROKER)),
                                           (self.controller_port, "controller", (COMBINED, CONTROLLER)))
                if self.roles in roles]

    def listener(self, protocol: str) -> str:
        """The bootstrap address of this node's ``protocol`` listener (``SSL``, ``SASL_SSL``,
        ``SASL_PLAINTEXT``; ``PLAINTEXT``: :attr:`bootstrap`); BrokerError if it has none."""
        if protocol == "PLAINTEXT":
            return self.bootstrap
        port = (self.security.listeners() if self.security else {}).get(protocol)
        if port is None:
            raise BrokerError(f"this node has no {protocol} listener (LocalKafka(security=...))")
        return f"{self.host}:{port}"

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
        """A Kafka client gets metadata from the broker; a controller-only node: its port answers."""
        if not self.is_broker:
            return _listening(self.host, self.controller_port, timeout) is None
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
            "roles": self.roles,
            "port": self.port,
            "controller_port": self.controller_port,
            "version": self.version,
            "data_dir": str(self.data_dir),
            "bootstrap": self.address,
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
            extra=self.extra_properties, host=self.host, security=self.security, roles=self.roles,
            brokers=self.brokers)
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
               "kafka.tools.StorageTool", "format", "-t", cid, "-c", str(self.properties_path),
               *scram_format_args(self.security)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            out = _tail(res.stdout + res.stderr)
            for password in (self.security.scram_users.values() if self.security else ()):
                out = out.replace(password, "***")
            raise BrokerError(f"kafka StorageTool format failed (exit {res.returncode}):\n{out}")
        self._say(f"formatted {self.log_dirs} (cluster id {cid})")

    def wipe(self) -> None:
        """Delete the data dir (stops our broker first)."""
        if self.is_running():
            self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def _preflight(self) -> None:
        """Refuse ports held by something else (and say whether it is a Kafka)."""
        for port, what in self._ports():
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
                 "node_id": self.node_id, "roles": self.roles, "version": self.version, "data_dir": str(self.data_dir),
                 "started_at": time.time()}
        _atomic_write(self.data_dir / STATE_FILE, json.dumps(state, indent=1) + "\n")

    def wait_ready(self, timeout: float = DEFAULT_START_TIMEOUT) -> None:
        """Until a Kafka client sees the broker (confluent-kafka's probe when importable, else
        one long-lived run of Kafka's own tool; a controller-only node: a TCP connect to its
        controller port), the node's exit or ``timeout``."""
        deadline = time.monotonic() + timeout
        try:
            import confluent_kafka  # noqa: F401

            watch = None
        except ImportError:
            watch = _ReadyWatch(self.version, self.bootstrap) if self.is_broker else None
        try:
            while True:
                if not self.is_running():
                    code = self._proc.returncode if self._proc is not None else None
                    raise BrokerError(
                        f"Kafka broker exited during startup (exit {code}); log tail "
                        f"({self.stdout_log}):\n{self.log_tail()}")
                if watch is not None:
                    ready, error = watch.ready(), watch.error
                elif not self.is_broker:  # a controller-only node: its controller port answers
                    error = _listening(self.host, self.controller_port, 2.0)
                    ready = error is None
                else:
                    last = probe(self.host, self.port, timeout=2.0)
                    ready, error = last["ready"], last["error"]
                if ready:
                    return
                if time.monotonic() >= deadline:
                    raise BrokerError(
                        f"Kafka node on {self.address} not ready after {timeout:g}s "
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
            if all(port_is_free(p, self.host) for p, _ in self._ports()):
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
