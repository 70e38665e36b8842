"""Per-algorithm run defaults (``config.algos.ALGO_DEFAULTS``): ``--algo X`` alone is enough."""

from __future__ import annotations

import pytest

from rlstream.cli import build_parser, train_config
from config.algos import TRAINABLE
from config import TrainConfig


@pytest.mark.parametrize("algo", ["ppo", "agro", "tba"])
def test_value_baseline_algorithms_cut_fragments_anywhere(algo):
    cfg = TrainConfig(algo=algo, env_id="InvertedPendulum-v5")
    assert (cfg.num_envs, cfg.group_size, cfg.train_batch_size) == (1, 0, 2048)
    assert cfg.effective_fragment_steps() == 2048


@pytest.mark.parametrize("algo", ["grpo", "dapo"])
def test_group_algorithms_get_groups_and_episode_long_fragments(algo):
    cfg = TrainConfig(algo=algo, env_id="Pendulum-v1")
    assert (cfg.num_envs, cfg.group_size, cfg.train_batch_size) == (8, 8, 512)
    assert cfg.effective_fragment_steps() == 200  # Pendulum's time limit: every rollout ends inside
    assert TrainConfig(algo=algo, env_id="HalfCheetah-v5").effective_fragment_steps() == 1000
    # explicit values win, including switching groups off
    cfg = TrainConfig(algo=algo, num_envs=4, group_size=0, train_batch_size=64, fragment_steps=16)
    assert (cfg.num_envs, cfg.group_size, cfg.train_batch_size, cfg.effective_fragment_steps()) == (4, 0, 64, 16)


def test_cli_leaves_unset_flags_to_the_algorithm(tmp_path):
    for algo in TRAINABLE:  # every online algorithm of the table is a --algo choice
        assert build_parser().parse_args(["train", "--algo", algo]).train.algo == algo
    a = build_parser().parse_args(["train", "--algo", "dapo", "--env", "Pendulum-v1", "--run-dir", str(tmp_path)])
    cfg = train_config(a)
    assert (cfg.num_envs, cfg.group_size, cfg.train_batch_size) == (8, 8, 512)
    a = build_parser().parse_args(["train", "--algo", "dapo", "--num-envs", "16", "--group-size", "4",
                                   "--run-dir", str(tmp_path / "b")])
    cfg = train_config(a)
    assert (cfg.num_envs, cfg.group_size) == (16, 4)


def test_an_actor_lag_is_refused_outside_decoupled_mode_and_below_zero(tmp_path):
    from rlstream.colocated import run_colocated

    with pytest.raises(ValueError, match="decoupled mode only"):
        run_colocated(TrainConfig(env_id="Pendulum-v1", actor_lag_versions=4, run_dir=tmp_path))
    assert not any(tmp_path.iterdir())  # refused before anything ran
    with pytest.raises(ValueError, match=">= 0"):
        TrainConfig(mode="decoupled", actor_lag_versions=-1)
