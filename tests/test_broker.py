"""Tests for localkafka's broker: paths, render, fetch, probe and the ``LocalKafka`` lifecycle.

Unit tests run everywhere; the ``kafka`` marked tests probe the real broker with both clients
(librdkafka's admin client and Kafka's own api-versions tool) and one starts a private broker
(needs java, and mvn unless the jars are already cached)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from localkafka import broker
from localkafka.broker import LocalKafka
from localkafka.cli import main
from localkafka.fetch import fetch, fetch_maven, find_java, is_fetched, maven_is_fetched
from localkafka.paths import KAFKA_VERSION, BrokerError, PortBusyError, default_version
from localkafka.probe import is_ready, port_is_free, probe
from localkafka.render import render_log4j, render_maven_pom, render_pom, render_properties, server_properties
from tests.support import free_port


# ---------------------------------------------------------------- helpers


class DummyServer:
    """A TCP server on 127.0.0.1 that runs ``handler(conn)`` per connection."""

    def __init__(self, handler):
        self.handler = handler
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self._stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        self.sock.settimeout(0.1)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                try:
                    self.handler(conn)
                except OSError:
                    pass

    def close(self):
        self._stop = True
        self.thread.join(2)
        self.sock.close()


@pytest.fixture
def serve():
    servers = []

    def start(handler):
        srv = DummyServer(handler)
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.close()


def _host_port(bootstrap: str) -> tuple[str, int]:
    host, port = bootstrap.split(",")[0].rsplit(":", 1)
    return host, int(port)


# ---------------------------------------------------------------- probe


def test_probe_closed_port_not_ready():
    out = probe("127.0.0.1", free_port(), timeout=0.5)
    assert out == {**out, "listening": False, "kafka": False, "ready": False}


def test_probe_http_server_is_not_kafka(serve):
    def http(conn):
        conn.recv(1024)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    srv = serve(http)
    out = probe("127.0.0.1", srv.port, timeout=1)
    assert out["listening"] and not out["kafka"] and not out["ready"]
    assert not is_ready(srv.port)


def test_probe_accept_and_close_is_not_kafka(serve):
    srv = serve(lambda conn: None)
    out = probe("127.0.0.1", srv.port, timeout=1)
    assert out["listening"] and not out["kafka"] and not out["ready"]


def test_probe_silent_server_times_out(serve):
    answered = threading.Event()
    srv = serve(lambda conn: answered.wait(60))  # silent until the probe has given up
    out = probe("127.0.0.1", srv.port, timeout=0.5)
    answered.set()
    assert out["listening"] and not out["ready"] and not out["kafka"]
    assert "timed out" in out["error"], out


def _admin(bootstrap: str):
    from confluent_kafka.admin import AdminClient

    return AdminClient({"bootstrap.servers": bootstrap})


def _topics(bootstrap: str) -> set[str]:
    return set(_admin(bootstrap).list_topics(timeout=30).topics)


@pytest.mark.kafka
@pytest.mark.parametrize("via", ["confluent-kafka", "java"])
def test_probe_agrees_with_the_real_broker(kafka_bootstrap, via):
    """Either client's probe sees the session's real broker as the cluster describes itself."""
    host, port = _host_port(kafka_bootstrap)
    if via == "java" and not is_fetched(default_version()):
        pytest.skip("Kafka jars not fetched (the session broker is not a LocalKafka)")
    out = probe(host, port, timeout=10, via=via)
    assert out["listening"] and out["kafka"] and out["ready"] and out["via"] == via, out
    admin = _admin(kafka_bootstrap)  # kept alive until its future resolves
    cluster = admin.describe_cluster(request_timeout=30).result(60)
    assert sorted((n.id, n.host, n.port) for n in cluster.nodes) == out["brokers"]


@pytest.mark.parametrize("via", ["confluent-kafka", "java"])
def test_probe_closed_port_not_ready_with_either_client(via):
    """The TCP check comes first: neither client is asked about a closed port."""
    out = probe("127.0.0.1", free_port(), timeout=0.5, via=via)
    assert not out["listening"] and not out["ready"] and "connect" in out["error"]
    assert out["via"] is None  # no client ran


@pytest.mark.parametrize("via", ["confluent-kafka", "java"])
def test_probe_listener_that_is_not_kafka_with_either_client(serve, via):
    """A port that accepts and hangs up: the client itself (Kafka's Java tool for ``java``)
    must say it is not Kafka."""
    if via == "java" and not is_fetched(default_version()):
        msg = "Kafka jars not fetched: the java probe has no tool to run"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    srv = serve(lambda conn: None)
    out = probe("127.0.0.1", srv.port, timeout=2, via=via)
    assert out["listening"] and not out["kafka"] and not out["ready"] and out["via"] == via, out
    if via == "java":  # the answer came from the tool's JVM, not from the TCP check
        assert out["error"].startswith("kafka-broker-api-versions exit"), out


def test_port_held_by_non_kafka_is_refused(serve, tmp_path):
    srv = serve(lambda conn: None)
    kafka = LocalKafka(port=srv.port, controller_port=free_port(), data_dir=tmp_path, quiet=True)
    with pytest.raises(PortBusyError) as err:
        kafka.start(timeout=5)
    assert not err.value.is_kafka and "not Kafka" in str(err.value)


@pytest.mark.kafka
def test_port_held_by_another_kafka_is_reported(kafka_bootstrap, tmp_path):
    _, port = _host_port(kafka_bootstrap)
    kafka = LocalKafka(port=port, controller_port=free_port(), data_dir=tmp_path, quiet=True)
    with pytest.raises(PortBusyError) as err:
        kafka.start(timeout=30)
    assert err.value.is_kafka
    # the CLI treats "a Kafka already answers" as success, and leaves that broker alone
    assert main(["start", "--port", str(port), "--controller-port", str(free_port()), "--data-dir", str(tmp_path)]) == 0
    assert probe("127.0.0.1", port, timeout=10)["ready"]


# ---------------------------------------------------------------- rendering


def test_server_properties_single_node():
    props = server_properties(port=19092, controller_port=19093, log_dir="/x/logs")
    assert props["process.roles"] == "broker,controller"
    assert props["controller.quorum.voters"] == "1@127.0.0.1:19093"
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:19092,CONTROLLER://127.0.0.1:19093"
    assert props["advertised.listeners"] == "PLAINTEXT://127.0.0.1:19092"
    assert props["log.dirs"] == "/x/logs"
    assert props["message.max.bytes"] == props["replica.fetch.max.bytes"] == "16777216"
    assert props["transaction.state.log.min.isr"] == "1"
    assert props["offsets.topic.replication.factor"] == "1"
    assert props["auto.create.topics.enable"] == "true"
    assert props["num.partitions"] == "1"
    assert props["log.retention.hours"] == "-1"
    assert props["group.initial.rebalance.delay.ms"] == "0"
    assert not any(k.startswith("share.") for k in props)
    assert "share.coordinator.state.topic.min.isr" in server_properties(
        port=1, controller_port=2, log_dir="/x", version="4.1.1")
    assert server_properties(port=1, controller_port=2, log_dir="/x",
                             extra={"num.partitions": 4})["num.partitions"] == "4"


def test_server_properties_and_broker_on_another_address(tmp_path):
    """``host``: the address a broker listens on and advertises (a simulated host's, in
    tests/hosts); 127.0.0.1 stays the default."""
    props = server_properties(port=9092, controller_port=9093, log_dir="/x", host="10.213.7.11")
    assert props["listeners"] == "PLAINTEXT://10.213.7.11:9092,CONTROLLER://10.213.7.11:9093"
    assert props["advertised.listeners"] == "PLAINTEXT://10.213.7.11:9092"
    assert props["controller.quorum.voters"] == "1@10.213.7.11:9093"
    kafka = LocalKafka(port=29092, data_dir=tmp_path, host="10.213.7.11")
    assert kafka.bootstrap == "10.213.7.11:29092"
    assert "PLAINTEXT://10.213.7.11:29092" in kafka.write_properties().read_text()
    assert LocalKafka(port=29092, data_dir=tmp_path).bootstrap == "127.0.0.1:29092"
    # an address this host lacks is held by nothing here (the stop waits on it)
    assert port_is_free(29092, "198.51.100.7")


def test_render_properties_round_trips():
    props = server_properties(port=9092, controller_port=9093, log_dir="/d")
    text = render_properties(props)
    parsed = dict(line.split("=", 1) for line in text.splitlines()
                  if line and not line.startswith("#"))
    assert parsed == props


def test_default_paths_and_controller_port(tmp_path, monkeypatch):
    monkeypatch.setenv("RLSTREAM_CACHE", str(tmp_path))
    monkeypatch.delenv("RLSTREAM_KAFKA_VERSION", raising=False)
    kafka = LocalKafka(port=29092)
    assert kafka.version == KAFKA_VERSION == "3.9.1"
    assert kafka.controller_port == 29093
    assert kafka.bootstrap == "127.0.0.1:29092"
    assert kafka.data_dir == tmp_path / "kafka-3.9.1" / "data-29092"
    monkeypatch.setenv("RLSTREAM_KAFKA_VERSION", "3.9.2")
    assert LocalKafka().version == "3.9.2"


def test_pom_and_log4j():
    pom = render_pom("3.9.1")
    for needle in ("<artifactId>kafka_2.13</artifactId>", "<version>3.9.1</version>",
                   "<artifactId>slf4j-reload4j</artifactId>", "<version>1.7.36</version>",
                   "<artifactId>reload4j</artifactId>", "<version>1.2.25</version>"):
        assert needle in pom
    assert "log4j-slf4j-impl" in render_pom("4.1.1")
    log4j = render_log4j()
    assert "${kafka.logs.dir}/server.log" in log4j
    assert "log4j.logger.kafka.request.logger=WARN" in log4j


def test_maven_fetch_of_any_coordinates(tmp_path, monkeypatch):
    pom = render_maven_pom("tools", [("org.apache.kafka", "kafka-tools", "3.9.1")])
    assert "<artifactId>kafka-tools</artifactId>" in pom and "<artifactId>tools</artifactId>" in pom
    coords = [("org.apache.avro", "avro", "1.12.1")]
    assert not maven_is_fetched(tmp_path / "lib", coords)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(BrokerError, match="mvn not found"):
        fetch_maven(tmp_path, coords, what="Avro")


def test_cluster_id_format():
    for _ in range(200):
        cid = broker.new_cluster_id()
        assert len(cid) == 22 and not cid.startswith("-")
        assert len(base64.urlsafe_b64decode(cid + "==")) == 16


def test_cli_status_and_stop_when_nothing_runs(tmp_path, capsys):
    port = free_port()
    args = ["--port", str(port), "--data-dir", str(tmp_path)]
    assert main(["status", *args]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status == {**status, "running": False, "pid": None, "port": port,
                      "version": "3.9.1", "data_dir": str(tmp_path.resolve()), "ready": False}
    assert main(["stop", *args]) == 0


def test_stale_pid_file_is_ignored(tmp_path):
    kafka = LocalKafka(port=free_port(), data_dir=tmp_path)
    (tmp_path / "broker.pid").write_text("999999999\n")
    assert kafka.pid is None and not kafka.is_running()
    assert kafka.stop() is False
    assert not (tmp_path / "broker.pid").exists()


def test_missing_mvn_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("RLSTREAM_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(BrokerError, match="mvn not found"):
        fetch("3.9.1", quiet=True)


# ---------------------------------------------------------------- real broker


def _kafka_available() -> str | None:
    try:
        find_java()
    except BrokerError as exc:
        return f"no java: {exc}"
    if not is_fetched(default_version()) and shutil.which("mvn") is None:
        return "Kafka jars not cached and mvn not installed (apt-get install -y maven)"
    return None


def _pick_port(preferred: int) -> int:
    return preferred if port_is_free(preferred) else free_port()


@pytest.mark.kafka
@pytest.mark.slow
def test_start_stop_restart_keeps_data(tmp_path):
    reason = _kafka_available()
    if reason:
        pytest.skip(reason)
    port = _pick_port(19092)
    ctrl = _pick_port(port + 1)
    kafka = LocalKafka(port=port, controller_port=ctrl, data_dir=tmp_path / "kafka", quiet=True)
    topic = "rlstream-test-" + uuid.uuid4().hex[:8]
    try:
        kafka.start(timeout=120)
        assert kafka.is_ready() and kafka.is_running()
        pid1 = kafka.pid
        assert kafka.status()["ready"] is True
        from confluent_kafka.admin import NewTopic

        admin = _admin(kafka.bootstrap)
        admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(60)
        out = probe("127.0.0.1", port, timeout=10, via="java")
        assert out["ready"], out
        del admin  # no client left to retry against the stopped broker below

        # graceful restart on the same data dir keeps the topic
        kafka.restart(timeout=120)
        assert kafka.pid != pid1 and kafka.is_ready()
        assert topic in _topics(kafka.bootstrap)

        # crash (SIGKILL) and recover
        pid2 = kafka.pid
        assert kafka.kill()
        assert not broker._pid_alive(pid2) and not kafka.is_ready()
        kafka.start(timeout=120)
        assert topic in _topics(kafka.bootstrap)
    finally:
        kafka.stop()
    for via in ("confluent-kafka", "java"):
        assert not probe("127.0.0.1", port, timeout=2, via=via)["ready"]
    assert not kafka.is_running()
    assert port_is_free(port) and port_is_free(ctrl)
    assert not (tmp_path / "kafka" / "broker.pid").exists()


@pytest.mark.kafka
@pytest.mark.slow
def test_stdlib_cli_starts_a_ready_broker_and_stops_it(tmp_path):
    """The CLI as .ci/run runs it, before the package is installed: ``python -S`` sees no
    site-packages, so readiness comes from Kafka's own tools, not confluent-kafka."""
    reason = _kafka_available()
    if reason:
        pytest.skip(reason)
    port, ctrl = free_port(), free_port()
    root = Path(__file__).resolve().parents[1]

    keep = ("HOME", "JAVA_HOME", "PATH", "RLSTREAM_CACHE", "RLSTREAM_TEST_PROCS")  # the last: tests.support.reaper
    env = {k: v for k, v in os.environ.items() if k in keep}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-S", "-m", "localkafka", *args, "--port", str(port),
                               "--data-dir", str(tmp_path)], cwd=root, env=env, capture_output=True,
                              text=True, timeout=300)

    try:
        started = cli("start", "--controller-port", str(ctrl))
        assert started.returncode == 0 and f"ready on 127.0.0.1:{port}" in started.stderr, started.stderr
        assert probe("127.0.0.1", port, timeout=10)["ready"]  # confluent-kafka agrees
        status = cli("status")
        assert json.loads(status.stdout)["ready"] is True, status.stderr
    finally:
        assert cli("stop").returncode == 0
    status = json.loads(cli("status").stdout)
    assert not status["running"] and not status["ready"]
    assert not probe("127.0.0.1", port, timeout=2)["ready"]


def test_server_properties_of_dedicated_broker_and_controller_nodes():
    """A broker-only node listens and advertises PLAINTEXT alone; a controller-only one its
    CONTROLLER listener alone, with nothing advertised (Kafka refuses otherwise); both take the
    replication defaults of the cluster's brokers, not of its voters."""
    from localkafka.paths import BrokerError
    from localkafka.render import BROKER, CONTROLLER

    voters = "4@127.0.0.1:9099"
    broker = server_properties(port=9092, controller_port=9093, log_dir="/x", node_id=1, voters=voters,
                               roles=BROKER, brokers=3)
    assert broker["process.roles"] == "broker"
    assert broker["listeners"] == broker["advertised.listeners"] == "PLAINTEXT://127.0.0.1:9092"
    assert broker["controller.quorum.voters"] == voters and broker["controller.listener.names"] == "CONTROLLER"
    controller = server_properties(port=9099, controller_port=9099, log_dir="/x", node_id=4, voters=voters,
                                   roles=CONTROLLER, brokers=3)
    assert controller["process.roles"] == "controller"
    assert controller["listeners"] == "CONTROLLER://127.0.0.1:9099"
    assert "advertised.listeners" not in controller and "inter.broker.listener.name" not in controller
    assert controller["listener.security.protocol.map"] == "CONTROLLER:PLAINTEXT"
    for props in (broker, controller):  # one voter, three brokers: the brokers' count rules
        assert (props["default.replication.factor"], props["min.insync.replicas"]) == ("3", "2")
        assert props["offsets.topic.replication.factor"] == props["transaction.state.log.replication.factor"] == "3"
    with pytest.raises(BrokerError, match="must be"):  # a broker among the voters, a controller not
        server_properties(port=1, controller_port=2, log_dir="/x", node_id=4, voters=voters, roles=BROKER)
    with pytest.raises(BrokerError, match="must be"):
        server_properties(port=1, controller_port=2, log_dir="/x", node_id=1, voters=voters, roles=CONTROLLER)


def test_cluster_with_dedicated_controllers_layout(tmp_path):
    """``LocalCluster(3, controllers=1)``: brokers 1-3 on the usual pairs, controller 4 after them,
    the only voter; the bootstrap names the brokers alone; ``cluster.json`` brings it back."""
    from localkafka.cluster import LocalCluster
    from localkafka.paths import BrokerError

    c = LocalCluster(3, controllers=1, port=30000, data_dir=tmp_path, quiet=True)
    assert (c.broker_ids, c.controller_ids) == ([1, 2, 3], [4])
    assert c.voters == "4@127.0.0.1:30006"
    assert c.bootstrap == "127.0.0.1:30000,127.0.0.1:30002,127.0.0.1:30004"
    assert [c.node(i).roles for i in (1, 2, 3, 4)] == ["broker"] * 3 + ["controller"]
    assert not c.node(4).is_broker and c.node(4).address == "127.0.0.1:30006"
    props = c.node(4).write_properties().read_text()
    assert "process.roles=controller\n" in props and "default.replication.factor=3\n" in props
    again = LocalCluster.open(tmp_path, quiet=True)
    assert (again.controller_ids, again.cluster_id) == ([4], c.cluster_id)
    with pytest.raises(BrokerError, match="another cluster"):  # the same dir, combined: refused
        LocalCluster(3, port=30000, data_dir=tmp_path, quiet=True)
    combined = LocalCluster(3, port=31000, data_dir=tmp_path / "combined", quiet=True)
    assert combined.controller_ids == combined.broker_ids == [1, 2, 3]
    assert "controllers" not in (tmp_path / "combined" / "cluster.json").read_text()


def test_cli_controllers_need_nodes(tmp_path, capsys):
    assert main(["start", "--controllers", "1", "--port", "30100", "--data-dir", str(tmp_path)]) == 1
    assert "--controllers K goes with --nodes N" in capsys.readouterr().err
