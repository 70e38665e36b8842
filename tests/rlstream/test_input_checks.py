"""Input ``rlstream train`` cannot use is refused before anything is created, through the real
``rlstream`` command: one line on stderr that says what to do, exit code 2, no traceback, no
``runs/`` directory and no process started. The deployment guide's two command lines, as typed,
are taken with their meaning or refused with the exact rlstream command that does the same
here, and that command parses (the on-policy one trains). A finished run prints a few lines,
not its JSON summary, and no MuJoCo deprecation warning."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlstream.cli import build_parser, train_config
from rlstream.guide import check_redis
from tests.support import free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
#: The installed console script (``pip install -e .``), else the module.
RLSTREAM = ([str(Path(sys.executable).with_name("rlstream"))] if Path(sys.executable).with_name("rlstream").exists()
            else [sys.executable, "-m", "rlstream.cli"])

GUIDE_ON_POLICY = "rlstream train --env-name HalfCheetah-v3 --strategy on-policy --device cuda:0"
GUIDE_OFF_POLICY = ("rlstream train --env-name Ant-v3 --strategy off-policy --importance-sampling "
                    "--device cuda:0,1,2,3")


def rlstream(args: list[str], cwd: Path, env: dict[str, str] | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess:
    full = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    full["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([*RLSTREAM, *args], cwd=str(cwd), env=full, capture_output=True, text=True,
                          timeout=timeout)


def refused(p: subprocess.CompletedProcess, cwd: Path) -> str:
    """The one line of a refusal (exit 2, no traceback, nothing created in ``cwd``), after the
    deprecation lines of the flat flags it used (``config.sections.rewrite_flat_flags``)."""
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    lines = [ln for ln in p.stderr.strip().splitlines() if not re.match(r"warning: --\S+ is deprecated", ln)]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.stdout == "" and not (cwd / "runs").exists() and not (cwd / "MUJOCO_LOG.TXT").exists()
    return lines[0]


@pytest.mark.parametrize("flags, says", [
    (["--total-steps", "0"], "--total-steps must be >= 1, got 0"),
    (["--total-steps", "-5", "--mode", "decoupled"], "--total-steps must be >= 1, got -5"),  # no process starts
    (["--total-timesteps", "-1", "--num-envs", "0"],  # (a flat flag of before: its section's name)
     "--total-steps must be >= 1, got -1; --actor.num-envs must be >= 1"),
    (["--actor.num-actors", "0"], "--actor.num-actors must be >= 1, got 0"),
    (["--learner.train-batch-size", "0"], "--learner.train-batch-size must be >= 1, got 0"),
    (["--deploy.stream-workers", "0", "--mode", "decoupled"], "--deploy.stream-workers must be >= 1, got 0"),
    (["--algo", "nope"], "unknown algorithm 'nope'"),
])
def test_nonsensical_budgets_and_sizes_are_refused_before_anything_starts(tmp_path, flags, says):
    line = refused(rlstream(["train", "--env", "Pendulum-v1", *flags], tmp_path), tmp_path)
    assert line.startswith("rlstream train: ") and says in line, line


def test_a_role_refuses_a_negative_budget_too(tmp_path):
    line = refused(rlstream(["learner", "--total-steps", "-1", "--run-dir", "r"], tmp_path), tmp_path)
    assert "--total-steps must be >= 1, got -1" in line and not (tmp_path / "r").exists()


@pytest.mark.parametrize("env_id, says", [
    ("HalfChetah-v5", "no environment 'HalfChetah-v5' is registered; use HalfCheetah-v5 if that is what you meant"),
    ("HalfCheetah-v3", "use HalfCheetah-v5, the same task on the maintained MuJoCo bindings"),
    ("Pendulum-v0", "use Pendulum-v1"),
])
def test_a_misspelled_or_old_env_says_what_to_use(tmp_path, env_id, says):
    line = refused(rlstream(["train", "--env", env_id], tmp_path), tmp_path)
    assert says in line, line


def test_an_unreachable_redis_is_refused_before_the_run_directory(tmp_path):
    port = free_port()  # nothing listens there
    store = f"redis://:hunter2@127.0.0.1:{port}/0?keep_last=3"
    line = refused(rlstream(["train", "--env", "Pendulum-v1", "--learner.snapshot-store", store], tmp_path), tmp_path)
    assert f"no Redis answers at redis://127.0.0.1:{port}/0 (--learner.snapshot-store" in line and "Connection refused" in line
    assert f"start one there (redis-server --port {port})" in line and "hunter2" not in line
    line = refused(rlstream(["train", "--env", "Pendulum-v1"], tmp_path, env={"REDIS_URL": f"redis://127.0.0.1:{port}"}),
                   tmp_path)
    assert f"no Redis answers at redis://127.0.0.1:{port} (--deploy.redis-url (or REDIS_URL))" in line


def test_a_redis_that_wants_another_password_is_refused(tmp_path):
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("no redis-server on PATH")
    port = free_port()
    server = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                               "--requirepass", "right"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        good = f"redis://:right@127.0.0.1:{port}/0"
        wait_for(lambda: check_redis(good, None) is None, 30, "redis-server", ignore=(SystemExit,))
        line = refused(rlstream(["train", "--env", "Pendulum-v1", "--deploy.redis-url", f"redis://:wrong@127.0.0.1:{port}/0"],
                                tmp_path), tmp_path)
        assert "refused the credentials" in line and "wrong" not in line.split("(")[0] and ":wrong@" not in line
    finally:
        server.terminate()
        server.wait(timeout=10)


def equivalent(line: str) -> list[str]:
    """The argv of the command a refusal ends with (``...; the same run here: rlstream train ...``)."""
    m = re.search(r"; the same run here: (rlstream train .*)$", line)
    assert m, line
    argv = shlex.split(m.group(1))
    assert argv[0] == "rlstream"
    return argv[1:]


def test_the_guides_command_lines_as_typed(tmp_path):
    """Both of the deployment guide's commands, through the real command on a machine without
    CUDA (``CUDA_VISIBLE_DEVICES=""``): refused before anything is created, each with the old
    env's v5 id and the CPU equivalent of its devices, in one line; the equivalents parse with the
    guide's meaning and the on-policy one trains."""
    on = refused(rlstream(shlex.split(GUIDE_ON_POLICY)[1:], tmp_path), tmp_path)
    assert "use HalfCheetah-v5" in on and "--learner.device cuda:0: this machine has no CUDA device" in on
    assert equivalent(on) == shlex.split("train --env-name HalfCheetah-v5 --strategy on-policy --learner.device cpu")
    off = refused(rlstream(shlex.split(GUIDE_OFF_POLICY)[1:], tmp_path), tmp_path)
    assert "use Ant-v5" in off and "--learner.device cuda:0,1,2,3: this machine has no CUDA device" in off
    assert equivalent(off) == shlex.split("train --env-name Ant-v5 --strategy off-policy --importance-sampling "
                                          "--learner.device cpu --learner.learners 4")

    cfg = train_config(build_parser().parse_args([*equivalent(on), "--run-dir", str(tmp_path / "on")]))
    assert (cfg.mode, cfg.algo, cfg.env_id, cfg.device) == ("colocated", "ppo", "HalfCheetah-v5", "cpu")
    cfg = train_config(build_parser().parse_args([*equivalent(off), "--run-dir", str(tmp_path / "off")]))
    assert (cfg.mode, cfg.algo, cfg.env_id, cfg.device, cfg.learners) == ("decoupled", "agro", "Ant-v5", "cpu", 4)
    assert cfg.prepare_config().importance is True

    p = rlstream([*equivalent(on), "--total-steps", "1024", "--metrics-port", "-1"], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "WARNING" not in p.stderr and "deprecated" not in p.stderr, p.stderr[-3000:]  # MuJoCo's settotalmass
    assert not (tmp_path / "MUJOCO_LOG.TXT").exists()
    (run,) = [d for d in (tmp_path / "runs").iterdir() if d.name != "latest"]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["algo"], summary["env"], summary["steps"]) == ("ppo", "HalfCheetah-v5", 1024)
    lines = p.stdout.strip().splitlines()
    assert len(lines) <= 5 and "{" not in p.stdout, p.stdout  # a few lines, not the JSON summary
    assert lines[0] == f"run {run.name} (ppo on HalfCheetah-v5, colocated): runs/{run.name}"
    assert re.fullmatch(r"1,024 env steps in [\d.]+ s \([\d,]+ steps/s\), 2 updates to policy version 2", lines[1])
    assert lines[2] == f"summary: runs/{run.name}/summary.json (--json prints it)"
    assert lines[-1].startswith("verdict: return ") and lines[-1].endswith(f"plot: runs/{run.name}/returns.png")


@pytest.mark.parametrize("argv, mode, algo", [
    (["--strategy", "on-policy"], "colocated", "ppo"),
    (["--strategy", "on-policy", "--algo", "grpo"], "colocated", "grpo"),
    (["--strategy", "off-policy"], "decoupled", "agro"),
    (["--strategy", "off-policy", "--algo", "tba", "--mode", "decoupled"], "decoupled", "tba"),
    ([], "colocated", "ppo"),
])
def test_strategy_is_a_mode_and_an_algorithm_family(tmp_path, argv, mode, algo):
    cfg = train_config(build_parser().parse_args(["train", "--env", "Pendulum-v1", *argv, "--run-dir", str(tmp_path)]))
    assert (cfg.mode, cfg.algo) == (mode, algo)


@pytest.mark.parametrize("argv, says", [
    (["--strategy", "off-policy", "--algo", "ppo"],
     "not --algo ppo; say what you mean with --mode and --algo alone: rlstream train --env Pendulum-v1 --algo ppo "
     "--mode decoupled"),
    (["--strategy", "on-policy", "--mode", "decoupled"],
     "not --mode decoupled; say what you mean with --mode and --algo alone: rlstream train --env Pendulum-v1 "
     "--mode decoupled --algo ppo"),
])
def test_a_strategy_against_an_explicit_mode_or_algo_is_refused_with_the_equivalent(tmp_path, argv, says):
    line = refused(rlstream(["train", "--env", "Pendulum-v1", *argv], tmp_path), tmp_path)
    assert says in line, line


def test_several_learner_ranks_need_decoupled_mode(tmp_path):
    line = refused(rlstream(["train", "--env", "Pendulum-v1", "--device", "cpu", "--learners", "2"], tmp_path), tmp_path)
    assert "co-located mode trains one learner, not 2 ranks" in line and "--mode decoupled" in line
    cfg = train_config(build_parser().parse_args(["train", "--env", "Pendulum-v1", "--mode", "decoupled", "--device",
                                                  "cpu", "--learners", "2", "--run-dir", str(tmp_path)]))
    assert (cfg.device, cfg.learners) == ("cpu", 2)


def test_the_short_summary_of_a_decoupled_run():
    from runtime.progress import short_summary

    summary = {"mode": "decoupled", "algo": "agro", "env": "Ant-v5", "steps": 4096, "return_mean20": 1.0,
               "processes": {"learner": {"wall_s": 8.0, "updates": 2, "final_version": 2}}}
    assert short_summary(summary, "abc", Path("runs/abc")).splitlines() == [
        "run abc (agro on Ant-v5, decoupled): runs/abc",
        "4,096 env steps in 8.0 s (512 steps/s), 2 updates to policy version 2",
        "summary: runs/abc/summary.json (--json prints it)"]
