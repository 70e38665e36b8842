from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families as text_families

from runtime.http import HealthChecks, MetricsServer, Request, json_response
from runtime.metrics import Metrics


class FakeClock:
    def __init__(self) -> None:
        self.t = 50.0

    def __call__(self) -> float:
        return self.t


def get(url: str, method: str = "GET", data: bytes | None = None, headers: dict | None = None):
    req = urllib.request.Request(url, method=method, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def health(clock: FakeClock) -> HealthChecks:
    return HealthChecks(heartbeat_timeout_s=10.0, clock=clock)


@pytest.fixture
def metrics() -> Metrics:
    return Metrics(role="actor", gpu=False)


@pytest.fixture
def server(metrics: Metrics, health: HealthChecks) -> Iterator[MetricsServer]:
    srv = MetricsServer(metrics, health, host="127.0.0.1", port=0).start()
    yield srv
    srv.stop()


def test_metrics_endpoint_serves_the_registry(server: MetricsServer, metrics: Metrics) -> None:
    assert server.port > 0
    metrics.count_samples(42, "collected")
    status, headers, body = get(server.url + "/metrics")
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain")
    assert 'rlstream_samples_total{role="actor",stage="collected"} 42.0' in body.decode()
    status, headers, body = get(server.url + "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert status == 200 and headers["Content-Type"].startswith("application/openmetrics-text")
    # both bodies through prometheus_client's own parsers (the OpenMetrics one is strict: it
    # rejects a missing # EOF, bad escaping, a counter sample without _total, ...)
    om = {f.name: f for f in openmetrics_families(body.decode())}
    (sample,) = [s for s in om["rlstream_samples"].samples if s.name == "rlstream_samples_total"]
    assert om["rlstream_samples"].type == "counter"
    assert sample.labels == {"role": "actor", "stage": "collected"} and sample.value == 42.0
    text = {f.name: f for f in text_families(get(server.url + "/metrics")[2].decode())}
    assert {n for n in text if not n.endswith("_created")} == set(om)  # text: _created as own families
    assert text["rlstream_samples"].samples[0].value == 42.0


def test_healthz_follows_heartbeats(server: MetricsServer, health: HealthChecks, clock: FakeClock) -> None:
    status, _, body = get(server.url + "/healthz")
    assert status == 200 and json.loads(body)["status"] == "ok"  # nothing expected yet
    health.heartbeat("loop")
    clock.t += 9.0
    assert get(server.url + "/healthz")[0] == 200
    clock.t += 2.0  # 11 s since the last beat > 10 s timeout
    status, _, body = get(server.url + "/healthz")
    doc = json.loads(body)
    assert status == 503 and doc["status"] == "fail"
    assert doc["heartbeats"]["loop"]["ok"] is False and doc["heartbeats"]["loop"]["age_s"] == pytest.approx(11.0)
    health.heartbeat("loop")
    assert get(server.url + "/healthz")[0] == 200
    health.forget_heartbeat("loop")
    clock.t += 100
    assert get(server.url + "/healthz")[0] == 200


def test_expected_heartbeat_that_never_comes_fails(server: MetricsServer, health: HealthChecks, clock: FakeClock) -> None:
    health.expect_heartbeat("learner_loop", timeout_s=5.0)
    assert get(server.url + "/healthz")[0] == 200
    clock.t += 6.0
    assert get(server.url + "/healthz")[0] == 503
    health.heartbeat("learner_loop")  # keeps its 5 s timeout
    clock.t += 4.0
    assert get(server.url + "/healthz")[0] == 200
    clock.t += 2.0
    assert get(server.url + "/healthz")[0] == 503


def test_readyz_reports_each_check(server: MetricsServer, health: HealthChecks) -> None:
    state = {"bus": True, "version": None}
    health.register("bus", lambda: (state["bus"], {"brokers": "kafka:9092"}))
    health.register("policy", lambda: (state["version"] is not None, {"version": state["version"]}))
    status, headers, body = get(server.url + "/readyz")
    doc = json.loads(body)
    assert status == 503 and headers["Content-Type"] == "application/json"
    assert doc["checks"]["bus"] == {"ok": True, "detail": {"brokers": "kafka:9092"}}
    assert doc["checks"]["policy"]["ok"] is False
    state["version"] = 3
    status, _, body = get(server.url + "/readyz")
    assert status == 200 and json.loads(body)["checks"]["policy"]["detail"] == {"version": 3}

    def broken() -> bool:
        raise ConnectionError("broker down")

    health.register("broken", broken)
    health.register("plain_bool", lambda: True)
    status, _, body = get(server.url + "/readyz")
    doc = json.loads(body)
    assert status == 503 and "ConnectionError: broker down" in doc["checks"]["broken"]["detail"]
    assert doc["checks"]["plain_bool"] == {"ok": True, "detail": None}
    health.unregister("broken")
    assert get(server.url + "/readyz")[0] == 200


def test_unknown_path_method_and_head(server: MetricsServer) -> None:
    assert get(server.url + "/nope")[0] == 404
    assert get(server.url + "/metrics", method="POST", data=b"x")[0] == 405
    status, headers, body = get(server.url + "/healthz", method="HEAD")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0


def test_extra_routes(server: MetricsServer) -> None:
    def echo(req: Request):
        return json_response({"got": req.body.decode(), "q": req.query.get("x")})

    server.add_route("POST", "/act", echo)
    status, _, body = get(server.url + "/act?x=1", method="POST", data=b"obs")
    assert status == 200 and json.loads(body) == {"got": "obs", "q": ["1"]}
    assert get(server.url + "/act")[0] == 405
    with pytest.raises(ValueError):
        server.add_route("GET", "/metrics", echo)

    def boom(req: Request):
        raise RuntimeError("bad handler")

    server.add_route("GET", "/boom", boom)
    status, _, body = get(server.url + "/boom")
    assert status == 500 and "bad handler" in json.loads(body)["error"]


def test_slow_request_does_not_block_probes(server: MetricsServer) -> None:
    release = threading.Event()
    entered = threading.Event()

    def slow(req: Request):
        entered.set()
        release.wait(5)
        return json_response({"ok": True})

    server.add_route("GET", "/slow", slow)
    t = threading.Thread(target=get, args=(server.url + "/slow",))
    t.start()
    try:
        assert entered.wait(5)
        assert get(server.url + "/healthz")[0] == 200
    finally:
        release.set()
        t.join(5)


def test_stop_really_stops_and_frees_the_port(metrics: Metrics) -> None:
    srv = MetricsServer(metrics, host="127.0.0.1", port=0).start()
    port = srv.port
    thread = srv._thread
    assert get(f"http://127.0.0.1:{port}/healthz")[0] == 200
    srv.stop()
    assert not srv.running and thread is not None and not thread.is_alive()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    srv.stop()  # idempotent
    with pytest.raises(RuntimeError):
        _ = srv.port
    # the same port can be bound again at once
    again = MetricsServer(metrics, host="127.0.0.1", port=port).start()
    try:
        assert again.port == port and get(again.url + "/healthz")[0] == 200
        with pytest.raises(RuntimeError):
            again.start()
    finally:
        again.stop()


def test_context_manager_and_registry_argument(metrics: Metrics) -> None:
    with MetricsServer(metrics.registry, host="127.0.0.1") as srv:
        assert b"rlstream_policy_latency_seconds" in get(srv.url + "/metrics")[2]
    assert not srv.running
    with pytest.raises(TypeError):
        MetricsServer(object())
    with pytest.raises(ValueError):
        HealthChecks(heartbeat_timeout_s=0)


def test_bad_content_length_is_a_400(server: MetricsServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"POST /metrics HTTP/1.0\r\nContent-Length: abc\r\n\r\n")
        reply = s.recv(4096)
    assert reply.startswith(b"HTTP/1.0 400")
