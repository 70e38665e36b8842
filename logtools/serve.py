"""``rlstream serve``: an inference server that follows PolicyVersion events.

One port (8080 by default) serves inference, metrics and probes::

    POST /act      {"obs": [[...], ...], "deterministic": true}
                   -> {"actions": [[...], ...], "policy_version": 7, "policy_id": "policy"}
    GET  /policy   -> the version in use (number, parent, algo, architecture, weights sha256)
    GET  /metrics  Prometheus (role="serve"): policy version, publish->loaded latency,
                   request time (phase "act"), observations served (stage "serve")
    GET  /healthz  200 while the follower loop is alive and /act is fast enough: 503 while the
                   p99 of /act over the last ``act_window_s`` (60 s) is over ``max_act_p99_ms``
                   (100 ms, the guide's decoupled bound; ``--max-act-p99-ms``) and at least
                   ``act_min_requests`` (20) answered in that window (fewer count as healthy).
                   Kubernetes' livenessProbe reads this path and restarts a slow server.
    GET  /readyz   200 once a policy is loaded

``obs`` is a batch ``[B, obs_dim]`` (or one observation ``[obs_dim]``, answered with one
action). ``deterministic`` (default true) returns the mean action; false samples. Actions are
unclipped, as the policy emits them (clipping to the action bounds is the caller's job, as it
is the actor's). Bad input -> 400 with a message saying what is wrong; no policy yet -> 503.

A background thread follows the versions (``PolicyFeed`` over the shared
``streams.policies.PolicyFollower``, newest first) and swaps each new one in atomically: it is
loaded into a fresh module, so a request never sees half-loaded weights. A version whose
weights fail to load is dead-lettered and the previous one stays in use.

Pinned (``rlstream serve --version 42`` or ``--at 14:02``; ``version=``/``at_ms=`` here): the
server loads that one version (or the one current at that time) and never moves from it;
``/policy`` then says ``"pinned"``. No such version: the server does not start (PinNotFound).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from agents.networks import Policy
from config import BusConfig
from config.limits import MAX_MESSAGE_BYTES
from runtime.http import HealthChecks, LatencyWindow, MetricsServer, Request, Response, json_response
from runtime.logging import get_logger
from runtime.metrics import Metrics
from logtools.subscribe import PolicyFeed, open_events
from schemas.errors import CodecError
from streams.bus.base import Bus
from streams.events import EventBus
from streams.policies import BlobStore, PolicyUpdate, arch_of

__all__ = ["PolicyServer", "serve", "MAX_BATCH", "MAX_ACT_P99_MS"]

MAX_ACT_P99_MS = 100.0
"""Default bound on the p99 of /act (ms) past which /healthz fails: the guide's decoupled bound."""
MAX_BATCH = 4096
"""Most observations one /act request may carry."""
MAX_BODY = MAX_MESSAGE_BYTES

_log = get_logger(__name__)


class BadRequest(ValueError):
    """The request is malformed; the message goes back to the client with a 400."""


@dataclass(frozen=True)
class _Current:
    policy: Policy
    update: PolicyUpdate
    loaded_at_ms: int


def parse_obs(body: bytes, obs_dim: int) -> tuple[torch.Tensor, bool, bool]:
    """``(obs [B, obs_dim] float32, single, deterministic)`` from an /act body; BadRequest if bad."""
    if len(body) > MAX_BODY:
        raise BadRequest(f"body of {len(body)} bytes is over the {MAX_BODY} byte limit")
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, ValueError) as e:
        raise BadRequest(f"body is not JSON: {e}") from None
    if not isinstance(doc, dict) or "obs" not in doc:
        raise BadRequest('expected a JSON object {"obs": [[...], ...], "deterministic": true}')
    det = doc.get("deterministic", True)
    if not isinstance(det, bool):
        raise BadRequest(f"deterministic must be true or false, not {det!r}")
    obs = doc["obs"]
    if not isinstance(obs, list) or not obs:
        raise BadRequest("obs must be a non-empty list (one observation) or list of lists (a batch)")
    single = not isinstance(obs[0], list)
    rows = [obs] if single else obs
    if len(rows) > MAX_BATCH:
        raise BadRequest(f"batch of {len(rows)} observations is over the limit of {MAX_BATCH}")
    for i, row in enumerate(rows):
        if not isinstance(row, list):
            raise BadRequest(f"obs[{i}] is not a list: every row of a batch must be a list of numbers")
        if len(row) != obs_dim:
            raise BadRequest(f"obs[{i}] has {len(row)} values; this policy takes obs_dim={obs_dim}")
        for j, x in enumerate(row):
            # bool is an int in Python; JSON NaN/Infinity parse to floats and are caught below.
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                raise BadRequest(f"obs[{i}][{j}] = {x!r} is not a number")
            if not math.isfinite(x):
                raise BadRequest(f"obs[{i}][{j}] = {x} is not finite (NaN/inf)")
    t = torch.tensor(rows, dtype=torch.float32)
    if not torch.isfinite(t).all():  # finite doubles beyond float32 range
        raise BadRequest("obs has values outside the float32 range")
    return t, single, det


class PolicyServer:
    """Follows versions of ``policy_id`` and answers /act and /policy on a MetricsServer.

        server = PolicyServer(events, "policy", port=8080).start()
        ...
        server.stop()
    """

    def __init__(self, source: BusConfig | Bus | EventBus, policy_id: str = "policy", *,
                 host: str = "0.0.0.0", port: int = 8080, metrics: Metrics | None = None,
                 blob_store: BlobStore | None = None, poll_interval: float = 0.2,
                 heartbeat_timeout_s: float = 30.0, version: int | None = None,
                 at_ms: int | None = None, max_act_p99_ms: float = MAX_ACT_P99_MS,
                 act_window_s: float = 60.0, act_min_requests: int = 20) -> None:
        # first: a bad bound is a ValueError before anything is opened
        self.act_latency = LatencyWindow(max_act_p99_ms / 1e3, window_s=act_window_s, min_count=act_min_requests)
        self.metrics = metrics or Metrics(role="serve")
        self.events, self._owned = open_events(source, self.metrics)
        self.policy_id = policy_id
        self.blob_store = blob_store
        self.poll_interval = poll_interval
        self.health = HealthChecks(heartbeat_timeout_s=heartbeat_timeout_s)
        self.http = MetricsServer(self.metrics, self.health, host=host, port=port)
        self.http.add_route("POST", "/act", self._act)
        self.http.add_route("GET", "/policy", self._policy)
        self.health.register("policy", self._ready)
        self.health.register_liveness("act_p99", self.act_latency.check)
        self._current: _Current | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._feed: PolicyFeed | None = None
        self.versions_loaded = 0
        self.load_failures = 0
        self.requests = 0
        self.pin = {k: v for k, v in (("version", version), ("at_ms", at_ms)) if v is not None}

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "PolicyServer":
        self._feed = PolicyFeed(self.events, policy_id=self.policy_id, blob_store=self.blob_store,
                                stage="serve", **self.pin)
        self.health.expect_heartbeat("follower")
        self._thread = threading.Thread(target=self._follow, name="rlstream-serve-follower", daemon=True)
        self._thread.start()
        self.http.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.http.stop()
        if self._thread is not None:
            self._thread.join(10.0)
        if self._feed is not None:
            self._feed.close()
        if self._owned is not None:
            self._owned.close()
            self._owned = None

    def __enter__(self) -> "PolicyServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return self.http.port

    @property
    def url(self) -> str:
        return self.http.url

    @property
    def version(self) -> int | None:
        cur = self._current
        return None if cur is None else cur.update.version

    def wait_ready(self, timeout: float = 10.0, min_version: int = 0) -> bool:
        """Block until a version >= ``min_version`` is loaded (tests, scripts)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            v = self.version
            if v is not None and v >= min_version:
                return True
            time.sleep(0.02)
        return False

    # -- following -----------------------------------------------------------------------------
    def _follow(self) -> None:
        assert self._feed is not None
        while not self._stop.is_set():
            try:
                ups = self._feed.poll(self.poll_interval)
            except Exception as e:  # the bus failing must not kill the thread silently
                _log.error("serve_follow_failed", error=f"{type(e).__name__}: {e}")
                self._stop.wait(1.0)
                continue
            self.health.heartbeat("follower")
            for u in reversed(ups):  # the newest that loads wins; older ones in the poll are moot
                if self._adopt(u):
                    break

    def _adopt(self, u: PolicyUpdate) -> bool:
        try:
            policy = u.policy  # a fresh module: requests keep the old one until the swap below
        except CodecError as e:
            self.load_failures += 1
            if u.record is not None:
                self.events.dead_letters.send(u.record, e.reason, e, "serve")
            _log.error("serve_policy_rejected", version=u.version, error=str(e))
            return False
        self._current = _Current(policy, u, time.time_ns() // 1_000_000)
        self.versions_loaded += 1
        self.metrics.set_policy_version(u.version)
        lat = u.latency_s()
        if lat is not None and self.versions_loaded > 1:  # the first is catch-up, not propagation
            self.metrics.observe_policy_latency(lat)
        _log.info("serve_policy_loaded", version=u.version, parent_version=u.parent_version)
        return True

    # -- routes ----------------------------------------------------------------------------------
    def _ready(self) -> tuple[bool, Any]:
        cur = self._current
        return cur is not None, {"policy_id": self.policy_id, "version": None if cur is None else cur.update.version}

    def _act(self, req: Request) -> Response:
        cur = self._current
        if cur is None:
            return json_response({"error": f"no version of policy {self.policy_id!r} loaded yet"}, 503)
        t0 = time.perf_counter()
        try:
            obs, single, det = parse_obs(req.body, cur.policy.obs_dim)
        except BadRequest as e:
            return json_response({"error": str(e)}, 400)
        with torch.no_grad():
            actions, _, _ = cur.policy.act(obs, deterministic=det)
        out = actions[0].tolist() if single else actions.tolist()
        self.requests += 1
        self.metrics.count_samples(int(obs.shape[0]), "serve")
        took = time.perf_counter() - t0
        self.metrics.observe_step_time(took, "act")
        self.act_latency.observe(took)
        return json_response({"actions": out, "policy_version": cur.update.version, "policy_id": self.policy_id,
                              "deterministic": det})

    def _policy(self, req: Request) -> Response:
        cur = self._current
        if cur is None:
            return json_response({"error": f"no version of policy {self.policy_id!r} loaded yet",
                                  "policy_id": self.policy_id}, 503)
        info = cur.update.describe()
        info.pop("event", None)
        info.update({"arch": arch_of(cur.policy), "obs_dim": cur.policy.obs_dim, "act_dim": cur.policy.act_dim,
                     "loaded_at_ms": cur.loaded_at_ms, "versions_loaded": self.versions_loaded,
                     "load_failures": self.load_failures, "pinned": self.pin or None})
        return json_response(info)


def serve(bus_config: BusConfig | Bus | EventBus, policy_id: str = "policy", port: int = 8080,
          stop: threading.Event | None = None, *, host: str = "0.0.0.0", metrics: Metrics | None = None,
          blob_store: BlobStore | None = None,
          on_started: Callable[[PolicyServer], None] | None = None, version: int | None = None,
          at_ms: int | None = None, max_act_p99_ms: float = MAX_ACT_P99_MS, act_window_s: float = 60.0,
          act_min_requests: int = 20) -> int:
    """Run the policy server until ``stop`` is set; returns the exit code (0).
    ``on_started(server)`` is called once it listens (``server.port`` is the bound port)."""
    stop = stop or threading.Event()
    server = PolicyServer(bus_config, policy_id, host=host, port=port, metrics=metrics, blob_store=blob_store,
                          version=version, at_ms=at_ms, max_act_p99_ms=max_act_p99_ms,
                          act_window_s=act_window_s, act_min_requests=act_min_requests)
    server.start()
    _log.info("serve_started", url=server.url, policy_id=policy_id, **server.pin)
    try:
        if on_started is not None:
            on_started(server)
        while not stop.wait(0.5):
            pass
    finally:
        server.stop()
    return 0
