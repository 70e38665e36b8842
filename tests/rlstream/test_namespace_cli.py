"""Which namespace each command runs in (parsed once, in rlstream/cli.py)."""

from __future__ import annotations

import pytest

from rlstream.cli import build_parser, train_config
from rlstream.cli_tools import tool_bus


@pytest.fixture(autouse=True)
def no_env_namespace(monkeypatch):
    monkeypatch.delenv("RLSTREAM_NAMESPACE", raising=False)


def ns_of(argv: list[str], default_bus: str = "kafka") -> str:
    return train_config(build_parser().parse_args(argv), default_bus=default_bus).bus.namespace


def test_train_decoupled_defaults_to_its_run_id(tmp_path):
    base = ["train", "--mode", "decoupled", "--run-dir", str(tmp_path)]
    assert ns_of(base + ["--run-id", "run 7/b"]) == "run-7-b"
    assert len(ns_of(base)) == 12  # a random run id: every new run gets its own topics
    assert ns_of(base + ["--namespace", "shared"]) == "shared"
    assert ns_of(base + ["--namespace", ""]) == ""  # the legacy names, on request


def test_resume_reuses_the_recorded_namespace(tmp_path):
    (tmp_path / "namespace").write_text("abc123\n")
    argv = ["train", "--mode", "decoupled", "--run-dir", str(tmp_path), "--resume"]
    assert ns_of(argv) == "abc123"
    (tmp_path / "namespace").write_text("\n")  # a run in the legacy unscoped names stays in them
    assert ns_of(argv) == ""


def test_roles_and_tools_agree_through_the_environment(monkeypatch, tmp_path):
    assert ns_of(["actor", "--run-dir", str(tmp_path)]) == ""  # legacy unless told
    monkeypatch.setenv("RLSTREAM_NAMESPACE", "exp1")
    assert ns_of(["learner", "--run-dir", str(tmp_path)]) == "exp1"
    assert ns_of(["train", "--mode", "decoupled", "--run-dir", str(tmp_path)]) == "exp1"
    parser = build_parser()
    for argv in (["subscribe", "policies"], ["replay"], ["serve"], ["rollback", "--to", "1"]):
        assert tool_bus(parser.parse_args(argv)).namespace == "exp1"
        assert tool_bus(parser.parse_args(argv + ["--namespace", "other"])).namespace == "other"
