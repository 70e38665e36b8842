from __future__ import annotations

import pytest

from rlstream.obs import ports


def test_default_ports_are_the_documented_ones() -> None:
    assert ports.DEFAULT_PORTS == {
        "colocated": 9100,
        "actor": 9101,
        "streams": 9102,
        "learner": 9103,
        "serve": 8080,
    }
    assert len(set(ports.DEFAULT_PORTS.values())) == len(ports.DEFAULT_PORTS)


def test_env_var_names() -> None:
    for name in ("RLSTREAM_METRICS_PORT", "KAFKA_BROKERS", "REDIS_URL", "RLSTREAM_BUS", "RLSTREAM_SNAPSHOT_STORE"):
        assert name in ports.ENV_VARS
    assert len(set(ports.ENV_VARS)) == len(ports.ENV_VARS)


def test_known_commands_and_roles() -> None:
    assert ports.KNOWN_COMMANDS == ("train", "actor", "learner", "serve", "replay", "subscribe", "broker", "rollback",
                                   "verify", "fork", "lineage")
    for cmd, role in ports.COMMAND_ROLES.items():
        assert cmd in ports.KNOWN_COMMANDS
        assert role in ports.DEFAULT_PORTS


def test_metrics_port_env_override() -> None:
    assert ports.metrics_port("learner", env={}) == 9103
    assert ports.metrics_port("learner", env={"RLSTREAM_METRICS_PORT": " "}) == 9103
    assert ports.metrics_port("actor", env={"RLSTREAM_METRICS_PORT": "0"}) == 0
    assert ports.metrics_port("actor", env={"RLSTREAM_METRICS_PORT": "9200"}) == 9200
    with pytest.raises(ValueError):
        ports.metrics_port("actor", env={"RLSTREAM_METRICS_PORT": "70000"})
    with pytest.raises(ValueError):
        ports.metrics_port("actor", env={"RLSTREAM_METRICS_PORT": "nine"})
    with pytest.raises(KeyError):
        ports.metrics_port("nobody", env={})
