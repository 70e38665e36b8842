"""``TrainConfig`` in sections (``config.sections``): the nested flags parse, every flat flag of
before maps to the same field with one deprecation line, a flat run config file of before still
loads, and a setting the mode does not allow is refused when the config is made."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from config import TrainConfig, read_config
from config.sections import FLAT, OLD_FLAGS, SECTIONS, ActorSection, field_of, flag_of
from rlstream.cli import build_parser, train_config

ROOT = Path(__file__).resolve().parents[2]
FLAT_CONFIG = Path(__file__).parent / "data" / "flat_config.json"  # written by the flat layout's code


def parse(argv: list[str]):
    return build_parser().parse_args(["train", *argv])


#: Where each old flat field went (written out, not derived: a changed map fails here).
SECTION_OF = {
    "actor": "num_actors num_envs fragment_steps group_size overlap actor_steps max_batches_per_version "
             "policy_wait_s actor_lag_versions max_backlog fixed_fragments max_steps_ahead",
    "learner": "train_batch_size device learners compile_update grad_compression dynamic_batch snapshot_store "
               "snapshot_every snapshot_interval_s snapshot_keep_timed breaker_open_above breaker_close_below "
               "breaker_policy_lag_versions",
    "replay": "replay replay_capacity replay_samples_per_insert replay_max_reuse replay_min_size",
    "deploy": "torch_threads stream_workers max_restarts liveness_probes redis_url claim_check_above blob_cache",
    "run": "algo env_id preset total_steps seed policy_id resume plot log_every_s wrappers algo_overrides run_dir "
           "run_id tensorboard metrics_port",
}


def test_every_flat_field_is_in_its_section_under_its_own_name():
    expected = {name: section for section, names in SECTION_OF.items() for name in names.split()}
    assert {name: section for name, (section, _) in FLAT.items()} == expected
    for name, (section, attr) in FLAT.items():
        assert attr == ("enabled" if name == "replay" else name.removeprefix("replay_") if section == "replay"
                        else name), name


def test_the_nested_flags_parse_into_their_sections():
    a = parse(["--learner.snapshot-every", "3", "--actor.num-envs", "4", "--actor.num-actors=2",
               "--deploy.no-liveness-probes", "--replay.capacity", "64", "--algo", "agro", "--env", "Pendulum-v1"])
    cfg = a.train
    assert cfg.learner.snapshot_every == 3 and cfg.actor.num_envs == 4 and cfg.actor.num_actors == 2
    assert cfg.deploy.liveness_probes is False and cfg.replay.capacity == 64
    assert (cfg.run.algo, cfg.run.env_id) == ("agro", "Pendulum-v1")


def _value(section: str, attr: str) -> list[str]:
    """A value of the field other than its default, as flag arguments ([] for a switch)."""
    f = field_of(section, attr)
    special = {"device": "cpu:0", "grad_compression": "fp16", "snapshot_store": "/tmp/snaps", "blob_cache": "off",
               "redis_url": "redis://127.0.0.1:1/0", "compile_update": "True", "num_envs": "3",
               "capacity": "100000", "learners": "2", "fragment_steps": "8"}
    if attr in special:
        return [special[attr]]
    if f.type in ("bool", bool):
        return []
    return ["2.5" if "float" in str(f.type) else "5"]


def _context(section: str, attr: str) -> list[str]:
    """Flags a field needs beside it to be allowed (its mode, an off-policy algorithm)."""
    if attr in ("actor_lag_versions", "learners"):
        return ["--mode", "decoupled"]
    if section == "replay":
        return ["--algo", "agro", "--replay.capacity", "100000"] if attr != "capacity" else ["--algo", "agro"]
    return []


def _sections(cfg: TrainConfig) -> dict:
    """The config's sections, but the run id (drawn at random for each parse)."""
    out = {name: getattr(cfg, name) for name in SECTIONS}
    out["run"] = dataclasses.replace(out["run"], run_id="")
    return out


@pytest.mark.parametrize("old", sorted(OLD_FLAGS))
def test_each_flat_flag_maps_to_its_section_field_with_one_deprecation_line(old, capsys):
    new = OLD_FLAGS[old]
    section, _, dashed = new[2:].partition(".")
    bare = old[2:].removeprefix("no-")  # the old field, dashed
    flat = "replay" if bare == "replay" else bare.replace("-", "_") if bare != "policy-wait" else "policy_wait_s"
    assert section in SECTION_OF and flat in SECTION_OF[section].split(), (old, new)
    attr = dashed.replace("-", "_")
    negated = attr.startswith("no_") and not any(f.name == attr for f in dataclasses.fields(SECTIONS[section]))
    attr = attr[3:] if negated else attr
    assert attr == ("enabled" if flat == "replay" else flat.removeprefix("replay_")), (old, new)
    value = _value(section, attr)
    context = _context(section, attr)
    capsys.readouterr()
    by_old = parse([*context, old, *value]).train
    err = capsys.readouterr().err
    assert err.splitlines() == [f"warning: {old} is deprecated (flat flags go in the next release); use {new}"]
    by_new = parse([*context, new, *value]).train
    assert "deprecated" not in capsys.readouterr().err
    assert _sections(by_old) == _sections(by_new)
    got = getattr(getattr(by_old, section), attr)
    default = field_of(section, attr).default
    if negated:
        assert got is False
    elif not value:
        assert got is True
    else:
        assert got != default and str(got).lower() in (value[0].lower(), str(float(value[0])) if value[0][0].isdigit() else "")
    # the old flat attribute still reads it, for one release
    flat = next(k for k, v in FLAT.items() if v == (section, attr))
    if flat != "replay":
        assert getattr(by_old, flat) == got


def test_every_flat_field_has_a_flag_or_is_an_entry_point_field():
    entry = {"wrappers", "algo_overrides", "run_dir", "run_id", "tensorboard", "metrics_port"}
    for flat, (section, attr) in FLAT.items():
        if section == "run":
            continue
        assert flag_of(section, attr) in OLD_FLAGS.values() or flat in entry, flat
        assert f"--{flat.replace('_', '-')}" in OLD_FLAGS


def test_a_flat_keyword_and_replace_go_into_the_sections():
    cfg = TrainConfig(num_envs=4, snapshot_every=3, algo="agro", replay=True, replay_capacity=100_000)
    assert cfg.actor.num_envs == 4 and cfg.learner.snapshot_every == 3 and cfg.replay.enabled
    again = dataclasses.replace(cfg, num_envs=2, resume=True)
    assert again.actor.num_envs == 2 and again.run.resume and again.learner.snapshot_every == 3


def test_a_run_config_file_of_the_flat_layout_loads_into_the_sections(tmp_path):
    cfg = read_config(FLAT_CONFIG)
    assert cfg.mode == "decoupled"
    assert (cfg.run.algo, cfg.run.env_id, cfg.run.total_steps, cfg.run.run_id) == ("agro", "Pendulum-v1", 4096, "oldrun")
    assert (cfg.actor.num_envs, cfg.actor.num_actors) == (4, 2)
    assert cfg.replay.enabled and cfg.replay.capacity == 50_000
    assert cfg.learner.snapshot_every == 3 and cfg.learner.snapshot_store == "runs/old/snapshots"
    assert (cfg.deploy.max_restarts, cfg.deploy.liveness_probes, cfg.deploy.blob_cache) == (5, False, "off")
    assert cfg.run.wrappers == ("normalize_obs",) and cfg.run.algo_overrides["lr"] == 0.001
    # written again, it is in sections, and reads back the same
    from config import write_config

    path = write_config(cfg, tmp_path / "config.json")
    assert "run" in path.read_text() and read_config(path) == cfg


def test_a_flat_config_file_with_an_unknown_field_is_still_refused(tmp_path):
    import json

    doc = json.loads(FLAT_CONFIG.read_text())
    doc["config"]["num_envz"] = 4
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(SystemExit, match="num_envz"):
        read_config(path)


@pytest.mark.parametrize("mode, kwargs, message", [
    ("decoupled", {"actor": ActorSection(overlap=True)}, "--actor.overlap applies to co-located mode only"),
    ("colocated", {"actor": ActorSection(actor_lag_versions=2)}, "--actor.actor-lag-versions applies to decoupled"),
    ("both", {}, "--mode must be one of colocated, decoupled"),
])
def test_a_setting_the_mode_does_not_allow_is_refused_when_the_config_is_made(mode, kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(mode=mode, **kwargs)
    with pytest.raises(ValueError, match=message):  # made another way, the same one check
        dataclasses.replace(TrainConfig(), mode=mode, **kwargs)


def test_rlstream_train_refuses_a_mode_invalid_combination_with_exit_2(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-m", "rlstream.cli", "train", "--mode", "decoupled", "--actor.overlap",
                        "--total-steps", "64"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, (p.stdout[-2000:], p.stderr[-2000:])
    assert p.stderr.strip().splitlines() == [
        "rlstream train: --actor.overlap applies to co-located mode only (decoupled actors and learner are "
        "separate processes: they already collect and train at once)"]
    assert not (tmp_path / "runs").exists()


def test_train_config_keeps_the_sections_of_the_flags(tmp_path):
    a = parse(["--learner.snapshot-every", "3", "--num-envs", "4", "--run-dir", str(tmp_path / "r")])
    cfg = train_config(a)
    assert cfg.learner.snapshot_every == 3 and cfg.actor.num_envs == 4 and cfg.run.run_dir == tmp_path / "r"
