"""Whether a Kafka broker is ready on host:port: a TCP connect, then a Kafka client asks the broker
for its metadata. With confluent-kafka importable (the installed package) that is librdkafka's
admin client; before the package is installed (``.ci/run`` starts the broker with the system
python3, standard library only) it is one of Kafka's own tools from the fetched jars:
``kafka-broker-api-versions`` for a probe, and for the wait after a start one long-lived
``kafka-configs --describe`` (``_ReadyWatch``). Also whether a port is free."""

from __future__ import annotations

import errno
import re
import socket
import subprocess

from localkafka.fetch import find_java, is_fetched, write_log_config
from localkafka.paths import DEFAULT_PORT, HOST, _tail, default_version, lib_dir, major_version


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
