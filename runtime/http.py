"""One small HTTP server per process: ``/metrics``, ``/healthz``, ``/readyz``.

Usage at an entry point::

    health = HealthChecks(heartbeat_timeout_s=30)
    health.register("bus", lambda: (bus.connected, {"brokers": brokers}))
    health.register("policy", lambda: (actor.version is not None, {"version": actor.version}))
    server = MetricsServer(metrics, health, port=metrics_port("actor", env)).start()
    try:
        while not stop.is_set():
            actor.step()
            health.heartbeat("loop")      # liveness: the loop is making progress
    finally:
        server.stop()

* ``/metrics``: the ``Metrics`` registry in Prometheus text format (OpenMetrics
  when the scraper asks for it).
* ``/healthz`` (liveness): 200 while every expected heartbeat is younger than its
  timeout, 503 otherwise. A heartbeat is expected from its first
  ``heartbeat()`` or from ``expect_heartbeat()`` (which starts the clock at once,
  so a loop that never starts also fails). No heartbeats: 200.
  Liveness checks (``register_liveness``) join the heartbeats: ``rlstream serve``
  registers one that fails while the p99 of ``/act`` over a recent window is over
  its bound (``LatencyWindow``), so the orchestrator restarts a slow server.
* ``/readyz`` (readiness): 200 when every registered check passes, 503
  otherwise; the JSON body has each check's ``ok`` and ``detail``. A check that
  raises counts as failed. Checks run on the request thread: keep them cheap
  (read state, do not do network round trips).

The server is aiohttp's, on its own event loop in a daemon thread (handlers run on
worker threads, so a slow one never blocks a probe); ``stop()`` closes the
socket (the port is free again), ends the loop and joins the thread. ``port=0`` binds a free port; ``.port`` tells which. Extra routes
(``add_route``) let ``rlstream serve`` put its inference endpoints on the same
port.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from runtime.logging import get_logger

__all__ = [
    "HealthChecks",
    "LatencyWindow",
    "MetricsServer",
    "Request",
    "Response",
    "json_response",
]

_log = get_logger(__name__)

#: A readiness check: returns ``(ok, detail)`` (detail JSON-serialisable) or just ``ok``.
Check = Callable[[], "tuple[bool, Any] | bool"]


@dataclass(frozen=True)
class _Heartbeat:
    last: float
    timeout_s: float


class HealthChecks:
    """Liveness heartbeats and readiness checks of one process.

    Args:
        heartbeat_timeout_s: default age after which a heartbeat counts as missed.
        clock: monotonic clock in seconds (tests pass a fake).
    """

    def __init__(
        self,
        heartbeat_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if heartbeat_timeout_s <= 0:
            raise ValueError("heartbeat_timeout_s must be positive")
        self._default_timeout = heartbeat_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._checks: dict[str, Check] = {}
        self._beats: dict[str, _Heartbeat] = {}
        self._live_checks: dict[str, Check] = {}

    # -- readiness -------------------------------------------------------

    def register(self, name: str, fn: Check) -> None:
        """Add (or replace) readiness check ``name``."""
        with self._lock:
            self._checks[name] = fn

    def unregister(self, name: str) -> None:
        with self._lock:
            self._checks.pop(name, None)

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """``(all_ok, {"status": ..., "checks": {name: {"ok", "detail"}}})``."""
        with self._lock:
            checks = list(self._checks.items())
        results = _run_checks(checks)
        all_ok = all(r["ok"] for r in results.values())
        return all_ok, {"status": "ok" if all_ok else "fail", "checks": results}

    def register_liveness(self, name: str, fn: Check) -> None:
        """Add (or replace) liveness check ``name``: ``/healthz`` fails while it fails."""
        with self._lock:
            self._live_checks[name] = fn


    # -- liveness --------------------------------------------------------

    def expect_heartbeat(self, name: str, timeout_s: float | None = None) -> None:
        """Expect heartbeats from ``name``; the first one is due within ``timeout_s`` from now."""
        timeout = self._default_timeout if timeout_s is None else timeout_s
        if timeout <= 0:
            raise ValueError("timeout_s must be positive")
        with self._lock:
            self._beats[name] = _Heartbeat(self._clock(), timeout)

    def heartbeat(self, name: str = "loop") -> None:
        """Record that loop ``name`` made progress now."""
        now = self._clock()
        with self._lock:
            prev = self._beats.get(name)
            timeout = prev.timeout_s if prev else self._default_timeout
            self._beats[name] = _Heartbeat(now, timeout)

    def forget_heartbeat(self, name: str) -> None:
        """Stop expecting ``name`` (a loop that ended on purpose)."""
        with self._lock:
            self._beats.pop(name, None)

    def liveness(self) -> tuple[bool, dict[str, Any]]:
        """``(alive, {"status": ..., "heartbeats": {name: {"ok", "age_s", "timeout_s"}}, "checks": {...}})``."""
        now = self._clock()
        with self._lock:
            beats = dict(self._beats)
            live_checks = list(self._live_checks.items())
        results = {}
        for name, hb in beats.items():
            age = now - hb.last
            results[name] = {"ok": age <= hb.timeout_s, "age_s": round(age, 3), "timeout_s": hb.timeout_s}
        checks = _run_checks(live_checks)
        alive = all(r["ok"] for r in results.values()) and all(r["ok"] for r in checks.values())
        body: dict[str, Any] = {"status": "ok" if alive else "fail", "heartbeats": results}
        if checks:
            body["checks"] = checks
        return alive, body


def _run_checks(checks: list[tuple[str, Check]]) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    for name, fn in checks:
        try:
            out = fn()
            if isinstance(out, tuple):
                ok, detail = out
            else:
                ok, detail = out, None
            ok = bool(ok)
        except Exception as exc:  # a broken check means failed, never a 500
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        results[name] = {"ok": ok, "detail": detail}
    return results


class LatencyWindow:
    """Durations of the last ``window_s`` seconds, and a check on their p99.

    ``observe(seconds)`` per request; ``check()`` is ``(ok, detail)`` for ``register_liveness``:
    failed while at least ``min_count`` requests fell in the window and their p99 is over
    ``max_p99_s`` (fewer requests say too little, and count as healthy). At most
    ``max_samples`` durations are kept (the newest).
    """

    def __init__(self, max_p99_s: float, window_s: float = 60.0, min_count: int = 20,
                 max_samples: int = 10_000, clock: Callable[[], float] = time.monotonic) -> None:
        if max_p99_s <= 0 or window_s <= 0 or min_count < 1:
            raise ValueError("max_p99_s and window_s must be positive, min_count at least 1")
        self.max_p99_s, self.window_s, self.min_count = max_p99_s, window_s, min_count
        self._clock = clock
        self._lock = threading.Lock()
        self._samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=max_samples)

    def observe(self, seconds: float) -> None:
        with self._lock:
            self._samples.append((self._clock(), seconds))

    def recent(self) -> list[float]:
        """The durations observed within the window."""
        cutoff = self._clock() - self.window_s
        with self._lock:
            while self._samples and self._samples[0][0] < cutoff:
                self._samples.popleft()
            return [d for _, d in self._samples]

    def p99(self) -> float | None:
        """Nearest-rank p99 of the window's durations (None when empty)."""
        xs = sorted(self.recent())
        if not xs:
            return None
        return xs[max(0, math.ceil(0.99 * len(xs)) - 1)]

    def check(self) -> tuple[bool, dict[str, Any]]:
        xs = self.recent()
        n = len(xs)
        p99 = self.p99() if n else None
        ok = n < self.min_count or p99 is None or p99 <= self.max_p99_s
        return ok, {"requests": n, "p99_ms": None if p99 is None else round(p99 * 1e3, 3),
                    "max_p99_ms": round(self.max_p99_s * 1e3, 3), "window_s": self.window_s,
                    "min_requests": self.min_count}


@dataclass(frozen=True)
class Request:
    """An HTTP request as extra route handlers see it."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes


@dataclass(frozen=True)
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


def json_response(obj: Any, status: int = 200) -> Response:
    """A JSON response (values that JSON cannot encode are written with ``str``)."""
    return Response(status, (json.dumps(obj, default=str) + "\n").encode("utf-8"))


Handler = Callable[[Request], Response]


#: Largest request body read; handlers apply their own, smaller limits (``rlstream serve``: 16 MiB).
MAX_REQUEST_BYTES = 64 * 1024 * 1024


class MetricsServer:
    """HTTP server for ``/metrics``, ``/healthz``, ``/readyz`` (and extra routes).

    Args:
        metrics: a ``runtime.metrics.Metrics`` (anything with ``.registry``)
            or a prometheus ``Collector``/``CollectorRegistry``.
        health: the process's ``HealthChecks``; a fresh, empty one if omitted.
        host: address to bind (``0.0.0.0`` in containers, ``127.0.0.1`` in tests).
        port: port to bind; 0 picks a free one (see ``.port`` after ``start()``).
    """

    def __init__(
        self,
        metrics: Any,
        health: HealthChecks | None = None,
        host: str = "0.0.0.0",
        port: int = 0,
    ) -> None:
        registry = getattr(metrics, "registry", metrics)
        if not hasattr(registry, "collect"):
            raise TypeError("metrics must be a Metrics object or a prometheus Collector")
        self._registry: Collector = registry
        self.health = health if health is not None else HealthChecks()
        self._host = host
        self._requested_port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._port: int | None = None
        self._thread: threading.Thread | None = None
        self._routes: dict[tuple[str, str], Handler] = {}
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------

    def start(self) -> MetricsServer:
        """Bind and serve from an event loop in a daemon thread. Returns ``self``."""
        with self._lock:
            if self._runner is not None:
                raise RuntimeError("server already started")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((self._host, self._requested_port))
            except OSError:
                sock.close()
                raise
            loop = asyncio.new_event_loop()
            app = web.Application(client_max_size=MAX_REQUEST_BYTES)
            app.router.add_route("*", "/{path:.*}", self._serve)
            runner = web.AppRunner(app, access_log=None, handle_signals=False)
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.SockSite(runner, sock).start())
            port = int(sock.getsockname()[1])
            thread = threading.Thread(target=loop.run_forever, name=f"rlstream-http-{port}", daemon=True)
            thread.start()
            self._loop, self._runner, self._port, self._thread = loop, runner, port, thread
        _log.info("http_server_started", host=self._host, port=port)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving, release the port and join the thread (idempotent)."""
        with self._lock:
            loop, runner, port, thread = self._loop, self._runner, self._port, self._thread
            self._loop = self._runner = self._port = self._thread = None
        if loop is None or runner is None:
            return
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout_s)
        with contextlib.suppress(TimeoutError):  # a handler still running keeps its thread
            asyncio.run_coroutine_threadsafe(loop.shutdown_default_executor(), loop).result(timeout_s)
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(timeout_s)
        if not loop.is_running():
            loop.close()
        _log.info("http_server_stopped", port=port)

    @property
    def running(self) -> bool:
        return self._runner is not None

    @property
    def port(self) -> int:
        """The bound port (only while running)."""
        if self._port is None:
            raise RuntimeError("server not running")
        return self._port

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self._host in ("0.0.0.0", "") else self._host
        return f"http://{host}:{self.port}"

    def __enter__(self) -> MetricsServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        req = Request(
            method=request.method,
            path=request.path,
            query={k: request.query.getall(k) for k in request.query.keys()},
            headers={k.lower(): v for k, v in request.headers.items()},
            body=await request.read(),
        )
        # Handlers are plain functions (inference, readiness checks): a worker thread runs
        # them, so a slow one never holds up the probes.
        resp = await asyncio.get_running_loop().run_in_executor(None, self._handle_safely, req)
        return web.Response(status=resp.status, body=resp.body,
                            headers={**resp.headers, "Content-Type": resp.content_type})

    def _handle_safely(self, req: Request) -> Response:
        try:
            return self._handle(req)
        except Exception as exc:
            _log.exception("http_handler_failed", path=req.path, method=req.method)
            return json_response({"error": f"{type(exc).__name__}: {exc}"}, status=500)

    # -- routing ---------------------------------------------------------

    def add_route(self, method: str, path: str, handler: Handler) -> None:
        """Serve ``handler`` at ``method path`` (e.g. ``"POST", "/act"`` for ``rlstream serve``)."""
        if path in ("/metrics", "/healthz", "/readyz"):
            raise ValueError(f"{path} is reserved")
        self._routes[(method.upper(), path)] = handler

    def _handle(self, req: Request) -> Response:
        method = "GET" if req.method == "HEAD" else req.method
        if req.path in ("/metrics", "/healthz", "/readyz"):
            if method != "GET":
                return json_response({"error": "method not allowed"}, status=405)
            if req.path == "/metrics":
                encoder, content_type = choose_encoder(req.headers.get("accept", ""))
                return Response(200, encoder(self._registry), content_type)
            ok, body = self.health.liveness() if req.path == "/healthz" else self.health.readiness()
            return json_response(body, status=200 if ok else 503)
        handler = self._routes.get((method, req.path))
        if handler is not None:
            return handler(req)
        if any(p == req.path for _, p in self._routes):
            return json_response({"error": "method not allowed"}, status=405)
        return json_response({"error": "not found", "path": req.path}, status=404)
