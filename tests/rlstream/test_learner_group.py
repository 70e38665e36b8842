"""The learner's consumer group can be named (``--learner-group`` / ``RLSTREAM_LEARNER_GROUP``; the
deployment guide's ``rl-trainers``): the name reaches the run config, the learner's consumer (its
commits are under it), and the actors' backlog reading (``wiring.build_flow``)."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from config import TrainConfig
from config.env import ENV_LEARNER_GROUP, ENV_VARS, Environment
from rlstream import wiring
from rlstream.cli import build_parser, train_config
from runtime.metrics import Metrics
from streams.topics import SAMPLES_PREPARED
from tests.learner.test_learner import events, prepared  # noqa: F401 (fixture)


def config_of(argv: list[str], env: dict[str, str] | None = None) -> TrainConfig:
    a = build_parser().parse_args(argv, namespace=argparse.Namespace(env=Environment(env or {})))
    return train_config(a, default_bus="kafka")


def test_flag_and_variable_name_the_group_and_the_flag_wins() -> None:
    assert ENV_LEARNER_GROUP in ENV_VARS  # a manifest may set it
    assert config_of(["learner"]).bus.learner_group == "learner"  # the default, as before
    assert config_of(["learner"], {ENV_LEARNER_GROUP: "rl-trainers"}).bus.learner_group == "rl-trainers"
    assert config_of(["actor", "--learner-group", "g2"], {ENV_LEARNER_GROUP: "rl-trainers"}).bus.learner_group == "g2"
    with pytest.raises(SystemExit, match="consumer group"):
        config_of(["learner", "--learner-group", "no spaces"])


def test_the_group_survives_the_run_config_file(tmp_path) -> None:
    cfg = config_of(["learner", "--learner-group", "rl-trainers", "--run-dir", str(tmp_path)])
    back = TrainConfig.from_dict(cfg.to_dict())
    assert back.bus.learner_group == "rl-trainers"
    older = cfg.to_dict()
    del older["bus"]["learner_group"]  # a run config written before the field: its run used "learner"
    assert TrainConfig.from_dict(older).bus.learner_group == "learner"
    older["bus"]["learner_grup"] = "x"  # an unknown field is still an error
    with pytest.raises(ValueError, match="learner_grup"):
        TrainConfig.from_dict(older)


def test_the_learner_commits_under_the_named_group_and_actors_read_its_backlog(events, tmp_path) -> None:  # noqa: F811
    cfg = replace(TrainConfig(algo="ppo", env_id="Pendulum-v1", run_dir=tmp_path, train_batch_size=32,
                              snapshot_store=str(tmp_path / "snaps")),
                  bus=replace(TrainConfig().bus, learner_group="rl-trainers"))
    algo = wiring.build_algo(cfg, 3, 1)
    lr = wiring.build_learner(cfg, events, Metrics(role="learner", gpu=False), algo)
    lr.start(resume=True)
    bus = events.bus
    for s in range(2):
        events.publish(SAMPLES_PREPARED, prepared(s), key="actor-0")
        assert lr.step(0) is not None
    assert bus.group_lag("rl-trainers", SAMPLES_PREPARED) == 0  # committed under the named group
    assert bus.group_lag("learner", SAMPLES_PREPARED) == 2  # and not under the default one
    gate = wiring.build_flow(cfg, bus, None)
    events.publish(SAMPLES_PREPARED, prepared(2), key="actor-0")
    assert gate.backlog() == bus.group_lag("rlstream-streams", "rl.samples.raw") + 1
