"""Per-environment presets (``config.algos.ENV_PRESETS``) and old env versions: ``rlstream train
--env Hopper-v5`` uses its preset with no flag; flags and ``--set`` win; ``HalfCheetah-v3`` fails
before anything starts, naming the version to use."""

from __future__ import annotations

import dataclasses

import pytest

from actor.envs import check_env_id, newest_version
from agents.registry import make_config
from config import TrainConfig
from config.algos import ENV_PRESETS, env_family, env_preset
from rlstream.cli import build_parser, train_config
from rlstream.wiring import build_algo


def parsed(*argv: str, tmp_path) -> TrainConfig:
    return train_config(build_parser().parse_args(["train", *argv, "--run-dir", str(tmp_path)]))


@pytest.mark.parametrize("env_id, family", [("HalfCheetah-v5", "HalfCheetah"), ("pkg.mod:Ant-v3", "Ant"),
                                            ("CartPole", "CartPole"), ("Walker2d-v5", "Walker2d"),
                                            ("my-env", "my-env")])
def test_env_family(env_id, family):
    assert env_family(env_id) == family


def test_every_preset_is_a_valid_algorithm_config():
    for (algo, family), rows in ENV_PRESETS.items():
        for name, row in rows.items():
            cfg = make_config(algo, row.algo)  # an unknown field raises
            for key, value in row.algo.items():
                assert getattr(cfg, key) == value, (family, name, key)
            if row.train_batch_size is not None:
                assert row.train_batch_size % cfg.num_minibatches == 0, (family, name)


def test_walker_defaults_to_cleanrl_and_takes_the_zoo_row_when_asked(tmp_path):
    default = parsed("--env", "Walker2d-v5", tmp_path=tmp_path / "a")
    assert default.preset_name() == "cleanrl" and default.algo_overrides == {} and default.train_batch_size == 2048
    cfg = parsed("--env", "Walker2d-v5", "--preset", "zoo", tmp_path=tmp_path / "b")
    assert cfg.preset_name() == "zoo"
    assert cfg.train_batch_size == 512 and cfg.effective_fragment_steps() == 512
    algo_cfg = build_algo(cfg, 17, 6).config  # what the learner actually trains with
    assert (algo_cfg.learning_rate, algo_cfg.gamma, algo_cfg.gae_lambda) == (5.05041e-05, 0.99, 0.95)
    assert (algo_cfg.num_minibatches, algo_cfg.update_epochs, algo_cfg.clip_coef) == (16, 20, 0.1)
    assert not algo_cfg.anneal_lr and not algo_cfg.clip_vloss


@pytest.mark.parametrize("env_id", ["Hopper-v5", "Walker2d-v5", "Ant-v5", "Humanoid-v5"])
def test_every_mujoco_task_defaults_to_the_measured_best_row_and_keeps_the_zoo_row(env_id):
    # CleanRL's settings beat the zoo's rows at 1M steps on these four (docs/algorithms.md);
    # HalfCheetah is the other way round (its own test)
    assert env_preset("ppo", env_id)[0] == "cleanrl" and TrainConfig(env_id=env_id).algo_overrides == {}
    assert TrainConfig(env_id=env_id, preset="zoo").algo_overrides


def test_ant_defaults_to_cleanrl_and_takes_the_zoo_row_when_asked(tmp_path):
    default = parsed("--env", "Ant-v5", tmp_path=tmp_path / "a")
    assert default.preset_name() == "cleanrl" and default.algo_overrides == {} and default.train_batch_size == 2048
    algo_cfg = build_algo(default, 105, 8).config
    assert algo_cfg.anneal_lr and algo_cfg.clip_vloss and algo_cfg.num_minibatches == 32
    zoo = build_algo(parsed("--env", "Ant-v5", "--preset", "zoo", tmp_path=tmp_path / "b"), 105, 8).config
    assert not zoo.anneal_lr and not zoo.clip_vloss and zoo.num_minibatches == 32


def test_agro_on_ant_defaults_to_its_measured_row_with_no_flag(tmp_path):
    # AGRO's own row does not learn Ant in 1M steps; its Ant row (PPO's update count and lambda,
    # beta 2) does (docs/algorithms.md). --preset none keeps AGRO's row (and v5's contact forces).
    cfg = parsed("--env", "Ant-v5", "--algo", "agro", tmp_path=tmp_path / "a")
    assert cfg.preset_name() == "rlstream" and cfg.train_batch_size == 2048
    algo_cfg = build_algo(cfg, 105, 8).config
    assert (algo_cfg.update_epochs, algo_cfg.num_minibatches, algo_cfg.gae_lambda, algo_cfg.beta) == (10, 32, 0.95, 2.0)
    own = build_algo(parsed("--env", "Ant-v5", "--algo", "agro", "--preset", "none", tmp_path=tmp_path / "b"), 105, 8)
    assert (own.config.update_epochs, own.config.num_minibatches, own.config.beta) == (4, 8, 1.0)
    with pytest.raises(ValueError, match="no preset 'zoo' for agro on Ant"):
        TrainConfig(algo="agro", env_id="Ant-v5", preset="zoo")


def test_hopper_defaults_to_cleanrl_and_takes_the_zoo_row_when_asked(tmp_path):
    default = parsed("--env", "Hopper-v5", tmp_path=tmp_path / "a")
    assert default.preset_name() == "cleanrl" and default.algo_overrides == {} and default.train_batch_size == 2048
    cfg = parsed("--env", "Hopper-v5", "--preset", "zoo", tmp_path=tmp_path / "b")
    assert cfg.preset_name() == "zoo"
    assert cfg.train_batch_size == 512 and cfg.effective_fragment_steps() == 512
    algo_cfg = build_algo(cfg, 11, 3).config  # what the learner actually trains with
    assert (algo_cfg.learning_rate, algo_cfg.gamma, algo_cfg.gae_lambda) == (9.80828e-05, 0.999, 0.99)
    assert (algo_cfg.num_minibatches, algo_cfg.update_epochs, algo_cfg.clip_coef) == (16, 5, 0.2)
    assert (algo_cfg.hidden, algo_cfg.activation, algo_cfg.init_log_std) == ((256, 256), "relu", -2.0)
    assert not algo_cfg.anneal_lr and not algo_cfg.clip_vloss


def test_flags_and_set_win_over_the_preset(tmp_path):
    cfg = parsed("--env", "Hopper-v5", "--preset", "zoo", "--train-batch-size", "1024", "--set",
                 "learning_rate=0.001", tmp_path=tmp_path)
    assert cfg.train_batch_size == 1024
    assert cfg.algo_overrides["learning_rate"] == 0.001
    assert cfg.algo_overrides["gamma"] == 0.999  # the rest of the preset stays


def test_halfcheetah_defaults_to_the_zoo_row_and_takes_the_algorithm_row_when_asked(tmp_path):
    cfg = parsed("--env", "HalfCheetah-v5", tmp_path=tmp_path / "a")
    assert cfg.preset_name() == "zoo" and cfg.train_batch_size == 512
    assert cfg.algo_overrides["update_epochs"] == 20 and cfg.algo_overrides["num_minibatches"] == 8
    assert cfg.algo_overrides["hidden"] == (256, 256) and cfg.algo_overrides["gamma"] == 0.98
    cleanrl = parsed("--env", "HalfCheetah-v5", "--preset", "cleanrl", tmp_path=tmp_path / "b")
    assert cleanrl.algo_overrides == {} and cleanrl.train_batch_size == 2048
    none = parsed("--env", "Hopper-v5", "--preset", "none", tmp_path=tmp_path / "c")
    assert none.preset_name() is None and none.algo_overrides == {} and none.train_batch_size == 2048


def test_other_algorithms_and_envs_have_no_preset():
    assert env_preset("agro", "Hopper-v5") is None
    assert env_preset("ppo", "Pendulum-v1") is None
    assert TrainConfig(algo="agro", env_id="Hopper-v5").algo_overrides == {}


def test_unknown_preset_names_fail_clearly():
    with pytest.raises(ValueError, match=r"no preset 'zoo' for ppo on Pendulum; choose from auto, none$"):
        TrainConfig(env_id="Pendulum-v1", preset="zoo")
    with pytest.raises(ValueError, match="--preset must be one of"):
        TrainConfig(preset="tuned")


def test_a_preset_config_survives_its_run_file():
    cfg = dataclasses.replace(TrainConfig(env_id="Humanoid-v5", preset="zoo"), algo_overrides={"ent_coef": 0.0})
    again = TrainConfig.from_dict(cfg.to_dict())
    assert again == cfg and again.algo_overrides["ent_coef"] == 0.0 and again.algo_overrides["gamma"] == 0.95


def test_old_mujoco_versions_point_to_v5():
    assert newest_version("HalfCheetah-v3") == "HalfCheetah-v5"
    with pytest.raises(ValueError, match="use Ant-v5"):
        check_env_id("Ant-v3")
    check_env_id("HalfCheetah-v5")  # loads
    with pytest.raises(ValueError, match="doesn't exist"):
        check_env_id("NoSuchEnv-v1")


def test_train_refuses_an_old_version_before_starting(tmp_path):
    with pytest.raises(SystemExit, match="use HalfCheetah-v5"):
        parsed("--env", "HalfCheetah-v3", tmp_path=tmp_path / "run")
    assert not (tmp_path / "run").exists()
    assert parsed("--env-name", "HalfCheetah", tmp_path=tmp_path / "ok").env_id == "HalfCheetah"


def test_the_guides_flag_spellings(tmp_path):
    cfg = parsed("--mode", "decoupled", "--algo", "agro", "--env-name", "Ant-v5", "--total-timesteps", "2000000",
                 "--importance", tmp_path=tmp_path)
    assert (cfg.env_id, cfg.total_steps, cfg.prepare_config().importance) == ("Ant-v5", 2_000_000, True)


# -- gymnasium.make keyword arguments: the preset's, --env-arg over them, to every env the run makes

NO_CONTACT = {"include_cfrc_ext_in_observation": False}


def test_ant_observes_what_the_references_observed_unless_told(tmp_path):
    from actor.rollout import Rollout
    from rlstream.wiring import actor_config, env_info

    default = parsed("--env", "Ant-v5", tmp_path=tmp_path / "a")
    assert default.run.env_kwargs == NO_CONTACT and env_info(default).obs_dim == 27
    rollout = Rollout(actor_config(default, "actor-0", 0))  # what an actor steps
    try:
        assert rollout.spec.obs_dim == 27 and rollout.env.single_observation_space.shape == (27,)
    finally:
        rollout.env.close()
    assert parsed("--env", "Ant-v5", "--preset", "zoo", tmp_path=tmp_path / "b").run.env_kwargs == NO_CONTACT
    plain = parsed("--env", "Ant-v5", "--preset", "none", tmp_path=tmp_path / "c")
    assert plain.run.env_kwargs == {} and env_info(plain).obs_dim == 105
    mine = parsed("--env", "Ant-v5", "--env-arg", "include_cfrc_ext_in_observation=true",
                  "--env-arg", "ctrl_cost_weight=0.25", tmp_path=tmp_path / "d")  # the user's wins
    assert mine.run.env_kwargs == {"include_cfrc_ext_in_observation": True, "ctrl_cost_weight": 0.25}
    assert env_info(mine).obs_dim == 105 and mine.preset_name() == "cleanrl"


def test_env_kwargs_survive_the_run_config_file():
    cfg = TrainConfig(env_id="Ant-v5")
    again = TrainConfig.from_dict(cfg.to_dict())
    assert again.run.env_kwargs == NO_CONTACT == cfg.run.env_kwargs and again == cfg


@pytest.mark.parametrize("args, says", [
    (["--env-arg", "no_such_kwarg=1"], "no_such_kwarg"),
    (["--env-arg", "include_cfrc_ext_in_observation"], "--env-arg expects key=value"),
])
def test_a_keyword_the_env_does_not_take_fails_before_anything_starts(tmp_path, args, says):
    with pytest.raises(SystemExit) as e:
        parsed("--env", "Ant-v5", *args, tmp_path=tmp_path)
    assert says in str(e.value) and "Traceback" not in str(e.value)
    assert str(e.value).startswith("--env-arg")  # the flag to fix, not --env


def test_the_entry_point_makes_the_env_once_with_its_kwargs(tmp_path, monkeypatch):
    import actor.envs as envs

    made = []
    real = envs.gym.make
    monkeypatch.setattr(envs, "_loads", set())
    monkeypatch.setattr(envs.gym, "make", lambda *a, **kw: made.append(kw) or real(*a, **kw))
    parsed("--env", "Ant-v5", tmp_path=tmp_path)
    assert made == [NO_CONTACT]  # the check, once, as the run makes it


def test_the_summary_and_eval_use_the_runs_env_kwargs(tmp_path):
    from logtools.evaluate import evaluate
    from rlstream.colocated import run_colocated

    cfg = parsed("--env", "Ant-v5", "--total-steps", "256", "--actor.num-envs", "1",
                 "--learner.train-batch-size", "128", "--no-plot", tmp_path=tmp_path / "run")
    summary = run_colocated(cfg)
    assert summary["env_kwargs"] == NO_CONTACT and summary["preset"] == "cleanrl"
    out = evaluate(cfg.run.run_dir, episodes=1)  # a 27-wide policy: the plain env (105) would be refused
    assert out["env_kwargs"] == NO_CONTACT and out["mean_length"] > 0


def test_the_tasks_env_kwargs_hold_for_every_algorithm_but_not_under_preset_none():
    tba = TrainConfig(algo="tba", env_id="Ant-v5")  # TBA has no Ant preset: the task's kwargs still hold
    assert tba.preset_name() is None and tba.run.env_kwargs == NO_CONTACT
    assert TrainConfig(algo="agro", env_id="Ant-v5").run.env_kwargs == NO_CONTACT  # beside AGRO's Ant preset
    assert TrainConfig(algo="agro", env_id="Ant-v5", preset="none").run.env_kwargs == {}
    assert TrainConfig(env_id="Hopper-v5").run.env_kwargs == {}
