"""Point-in-time policy: ``PolicyFeed`` and ``rlstream serve`` pinned to a version or a time."""

from __future__ import annotations

import datetime as dt
import json
import urllib.request

import pytest

from config import BusConfig
from logtools.serve import PolicyServer
from logtools.subscribe import PinNotFound, PolicyFeed, parse_at
from logtools.timetravel.record import load

from .recorded import copy_run


@pytest.fixture
def run_copy(colocated_run, tmp_path):
    """A copy of the recorded run (a server opening the log may append schema records)."""
    run_dir, _ = colocated_run
    return copy_run(run_dir, tmp_path / "run")


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def test_feed_pinned_to_a_version_or_a_time_hands_out_that_one_version(run_copy):
    versions = {v: pv for v, (_, pv) in load(run_copy).versions.items()}
    bus = BusConfig(kind="memory", log_dir=str(run_copy / "log"))
    assert versions[3].created_at_ms > versions[2].created_at_ms
    between = (versions[2].created_at_ms + versions[3].created_at_ms) // 2
    for pin, expected in (({"version": 1}, 1), ({"at_ms": between}, 2), ({"at_ms": versions[4].created_at_ms}, 4)):
        with PolicyFeed(bus, **pin) as feed:
            got = feed.poll(0.1)
            assert [u.version for u in got] == [expected], pin
            assert got[0].policy.obs_dim == 4
            assert feed.poll(0.1) == []  # pinned: it never moves on
    with pytest.raises(PinNotFound):
        PolicyFeed(bus, version=99)
    with pytest.raises(PinNotFound):
        PolicyFeed(bus, at_ms=versions[0].created_at_ms - 1)
    with pytest.raises(ValueError):
        PolicyFeed(bus, version=1, from_version=0)


def test_serve_pinned_to_a_time_answers_with_that_version(run_copy):
    versions = {v: pv for v, (_, pv) in load(run_copy).versions.items()}
    bus = BusConfig(kind="memory", log_dir=str(run_copy / "log"))
    at = versions[2].created_at_ms
    with PolicyServer(bus, host="127.0.0.1", port=0, at_ms=at) as server:
        assert server.wait_ready(timeout=30)
        info = get(server.url + "/policy")
        assert info["version"] == 2 and info["pinned"] == {"at_ms": at}
        req = urllib.request.Request(server.url + "/act", data=json.dumps({"obs": [0.0, 0.0, 0.0, 0.0]}).encode(),
                                     method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.loads(r.read())["policy_version"] == 2


def test_serve_command_refuses_a_pin_that_matches_no_version(run_copy):
    from .test_verify_colocated import cli

    p = cli("serve", "--log-dir", str(run_copy / "log"), "--version", "99", "--port", "0", "--metrics-port", "-1")
    assert p.returncode == 2 and "no version 99 of policy 'policy'" in p.stderr, p.stderr[-2000:]


def test_parse_at_reads_clock_times_iso_and_epoch_ms():
    assert parse_at("1700000000000") == 1_700_000_000_000
    assert parse_at("2026-12-03T14:02:00+00:00") == int(dt.datetime(2026, 12, 3, 14, 2, tzinfo=dt.timezone.utc)
                                                        .timestamp() * 1000)
    today = dt.datetime.combine(dt.date.today(), dt.time(14, 2)).astimezone()
    assert parse_at("14:02") == int(today.timestamp() * 1000)
    with pytest.raises(ValueError, match="cannot read"):
        parse_at("yesterday")
