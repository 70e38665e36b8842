from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from config import env as envvars
from config.env import Environment
from runtime import ports


def test_role_ports_are_distinct_and_the_readme_names_the_colocated_one() -> None:
    assert len(set(ports.DEFAULT_PORTS.values())) == len(ports.DEFAULT_PORTS)
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert f"port {ports.DEFAULT_PORTS['colocated']}" in readme


def test_known_commands_are_the_cli_parsers_commands() -> None:
    from rlstream.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(ports.KNOWN_COMMANDS) == set(sub.choices)
    assert set(ports.COMMAND_ROLES) <= set(sub.choices) and set(ports.COMMAND_ROLES.values()) <= set(ports.ROLES)


def test_the_streams_worker_reads_the_listed_variables() -> None:
    """The staleness, algorithm and policy variables named here are the ones the Faust worker reads."""
    from streams.settings import StreamsSettings

    assert len(set(envvars.ENV_VARS)) == len(envvars.ENV_VARS)
    env = {envvars.ENV_STALENESS_K: "3", envvars.ENV_STALENESS_MS: "1500", envvars.ENV_STALENESS_MODE: "downweight",
           envvars.ENV_ALGO: "grpo", envvars.ENV_POLICY_ID: "p-x", envvars.ENV_METRICS_PORT: "9555",
           envvars.ENV_KAFKA_BROKERS: "k:1"}
    assert set(env) <= set(envvars.ENV_VARS)
    s = StreamsSettings.from_environment(Environment(env))
    assert (s.prepare.max_versions, s.prepare.max_ms, s.prepare.staleness_mode, s.prepare.policy_id) == (
        3, 1500, "downweight", "p-x")
    assert (s.web_port, s.brokers) == (9555, "k:1")


def test_metrics_port_env_override() -> None:
    assert ports.metrics_port("learner", Environment({})) == 9103
    assert ports.metrics_port("learner", Environment({"RLSTREAM_METRICS_PORT": " "})) == 9103
    assert ports.metrics_port("actor", Environment({"RLSTREAM_METRICS_PORT": "0"})) == 0
    assert ports.metrics_port("actor", Environment({"RLSTREAM_METRICS_PORT": "9200"})) == 9200
    with pytest.raises(ValueError):
        ports.metrics_port("actor", Environment({"RLSTREAM_METRICS_PORT": "70000"}))
    with pytest.raises(ValueError):
        ports.metrics_port("actor", Environment({"RLSTREAM_METRICS_PORT": "nine"}))
    with pytest.raises(KeyError):
        ports.metrics_port("nobody", Environment({}))
