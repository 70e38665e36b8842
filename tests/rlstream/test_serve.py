"""rlstream serve over real HTTP (port 0, memory bus): readiness, /act follows new versions,
/policy, /metrics, 400s for bad input, a version whose weights do not load is dead-lettered."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest
import torch

from agents.networks import Policy
from logtools.serve import serve
from config import BusConfig
from rlstream.wiring import build_bus, build_events
from schemas.events import PolicyVersion, now_ms
from streams.policies import RedisBlobStore, make_policy_version, publish_policy_version
from streams.topics import DEADLETTER, POLICY_VERSIONS
from tests.ops.conftest import redis_server_url  # noqa: F401  (fixture)
from tests.support import free_port, wait_for
from tests.timetravel.test_verify_colocated import ROOT


def call(url: str, body: bytes | None = None, method: str | None = None) -> tuple[int, dict | str]:
    req = urllib.request.Request(url, data=body, method=method or ("POST" if body is not None else "GET"),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    text = raw.decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def act(url: str, obs, deterministic=True) -> tuple[int, dict]:
    return call(url + "/act", json.dumps({"obs": obs, "deterministic": deterministic}).encode())


@pytest.fixture
def server(events):
    stop = threading.Event()
    started: dict = {}
    ready = threading.Event()
    rc: dict = {}

    def on_started(s):
        started["server"] = s
        ready.set()

    def run():
        rc["rc"] = serve(events, policy_id="policy", port=0, stop=stop, host="127.0.0.1", on_started=on_started)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert ready.wait(60)
    yield started["server"]
    stop.set()
    t.join(60)
    assert rc.get("rc") == 0


def test_serves_the_newest_policy_and_follows_new_versions(server, events, pv):
    url = server.url
    assert call(url + "/healthz")[0] == 200
    status, body = call(url + "/readyz")
    assert status == 503 and body["checks"]["policy"]["ok"] is False
    assert act(url, [[0.0] * pv.OBS])[0] == 503

    p0 = pv.publish(events, 0)
    assert server.wait_ready(60, min_version=0)
    assert call(url + "/readyz")[0] == 200
    obs = [[0.5, -1.0, 2.0], [0.0, 0.1, -0.3]]
    status, body = act(url, obs)
    assert status == 200 and body["policy_version"] == 0
    want0 = p0.act(torch.tensor(obs), deterministic=True)[0]
    assert torch.allclose(torch.tensor(body["actions"]), want0, atol=1e-6)

    p1 = pv.publish(events, 1)
    assert server.wait_ready(60, min_version=1)
    status, body = act(url, obs)
    assert body["policy_version"] == 1
    want1 = p1.act(torch.tensor(obs), deterministic=True)[0]
    assert torch.allclose(torch.tensor(body["actions"]), want1, atol=1e-6)
    assert not torch.allclose(want0, want1)

    status, single = act(url, obs[0])  # one observation -> one action
    assert status == 200 and len(single["actions"]) == pv.ACT
    status, sampled = act(url, obs, deterministic=False)
    assert status == 200 and not torch.allclose(torch.tensor(sampled["actions"]), want1)

    status, info = call(url + "/policy")
    assert status == 200 and info["version"] == 1 and info["parent_version"] == 0
    assert info["obs_dim"] == pv.OBS and info["act_dim"] == pv.ACT and len(info["weights"]["sha256"]) == 64
    status, text = call(url + "/metrics")
    assert status == 200 and 'rlstream_policy_version{role="serve"} 1.0' in text
    assert 'rlstream_samples_total{role="serve",stage="serve"}' in text


@pytest.mark.parametrize("body, needle", [
    (b"{not json", "not JSON"),
    (b'{"observations": [[1, 2, 3]]}', '"obs"'),
    (json.dumps({"obs": [[1.0, 2.0]]}).encode(), "obs_dim=3"),
    (json.dumps({"obs": [[1.0, 2.0, 3.0], [1.0]]}).encode(), "obs[1] has 1 values"),
    (b'{"obs": [[1.0, NaN, 3.0]]}', "not finite"),
    (json.dumps({"obs": [[1.0, "x", 3.0]]}).encode(), "not a number"),
    (json.dumps({"obs": []}).encode(), "non-empty"),
    (json.dumps({"obs": [[1, 2, 3]], "deterministic": "yes"}).encode(), "deterministic"),
    (json.dumps({"obs": [[1e300, 2, 3]]}).encode(), "float32"),
])
def test_bad_input_is_a_400_with_a_reason(server, events, pv, body, needle):
    pv.publish(events, 0)
    assert server.wait_ready(60)
    status, resp = call(server.url + "/act", body)
    assert status == 400, resp
    assert needle in resp["error"]


def test_wrong_method_and_unknown_path(server, events, pv):
    assert call(server.url + "/act", method="GET")[0] == 405
    assert call(server.url + "/nothing")[0] == 404


def test_a_version_that_does_not_load_is_skipped_and_the_old_one_stays(server, events, pv):
    pv.publish(events, 0)
    assert server.wait_ready(60)
    bad = PolicyVersion(policy_id="policy", version=1, created_at_ms=now_ms(), learner_id="x", algo="ppo",
                        weights=b"definitely not safetensors", parent_version=0)
    events.publish(POLICY_VERSIONS, bad, key="policy")
    wait_for(lambda: server.load_failures, 60, "the server to try loading version 1", every=0.05)
    assert server.load_failures == 1 and server.version == 0
    assert act(server.url, [[0.0, 0.0, 0.0]])[1]["policy_version"] == 0
    assert list(events.bus.read_all(DEADLETTER)) == []  # the learner dead-letters policy records
    assert events.dead_letters.skipped == {(POLICY_VERSIONS, "invalid"): 1}


def test_the_serve_command_loads_claim_checked_weights_from_redis_url(tmp_path, redis_server_url):  # noqa: F811
    """A version over the inline size is a claim check: ``rlstream serve`` takes the store from
    REDIS_URL (before, it had none and never became ready on such a run)."""
    log = tmp_path / "log"
    bus = build_bus(BusConfig(kind="memory", log_dir=str(log)))
    p = Policy(4, 2, hidden=(8, 8))
    pv = make_policy_version(p, policy_id="policy", version=3, parent_version=None, learner_id="L", algo="ppo",
                             blob_store=RedisBlobStore(redis_server_url), claim_check_above=0)
    publish_policy_version(build_events(bus, None), pv)
    bus.close()
    port = free_port()
    env = {**os.environ, "REDIS_URL": redis_server_url, "RLSTREAM_BLOB_CACHE": str(tmp_path / "blobs"),
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "rlstream.cli", "serve", "--log-dir", str(log),
                             "--port", str(port), "--metrics-port", "-1"], cwd=str(ROOT), env=env,
                            stdout=out, stderr=subprocess.STDOUT)
    try:
        def ready():
            if proc.poll() is not None:
                raise AssertionError((tmp_path / "serve.log").read_text()[-2000:])
            try:
                return call(f"http://127.0.0.1:{port}/policy")[1]
            except OSError:
                return None
        info = wait_for(lambda: (r := ready()) and isinstance(r, dict) and r.get("version") == 3 and r, 120,
                        "serve's policy at version 3", on_timeout=lambda: (tmp_path / "serve.log").read_text()[-2000:])
        assert info["version"] == 3
        assert os.path.exists(tmp_path / "blobs" / pv.weights_ref.sha256)  # through the host cache
    finally:
        proc.terminate()
        proc.wait(30)
        out.close()
