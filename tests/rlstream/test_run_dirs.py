"""Run directories through the real ``rlstream`` command: every run gets its own ``runs/<id>``
with its marker and ``runs/latest`` follows it; a role pointed at another run's directory
refuses (exit 2, nothing written) unless it resumes; a DPO replay is a run ``rlstream eval``
reads; ``rlstream runs`` lists them all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.rundir import RunDir, RunDirError, RunInfo, is_run

TINY = ["--total-steps", "1024", "--num-envs", "2", "--train-batch-size", "512", "--torch-threads", "1",
        "--metrics-port", "-1", "--no-plot", "--tensorboard", "off"]


def rlstream(cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLSTREAM_", "KAFKA_"))}
    return subprocess.run([sys.executable, "-m", "rlstream.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, start_new_session=True)


def files(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.stat().st_mtime for p in root.rglob("*") if p.is_file()}


def latest(cwd: Path) -> str:
    return os.readlink(cwd / "runs" / "latest")


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> tuple[Path, list[str]]:
    """Two co-located runs, one after the other, in one working directory; the run ids are the
    directories each made. ``NEW_AND_LATEST`` keeps (new directory, ``runs/latest``) after each,
    since tests in any order may move ``latest`` later."""
    cwd = tmp_path_factory.mktemp("work")
    ids = []
    for _ in range(2):
        before = set(os.listdir(cwd / "runs")) if (cwd / "runs").is_dir() else set()
        r = rlstream(cwd, "train", "--env", "Pendulum-v1", *TINY)
        assert r.returncode == 0, r.stderr[-2000:]
        new = set(os.listdir(cwd / "runs")) - before - {"latest"}
        assert len(new) == 1, new
        ids.append(new.pop())
        NEW_AND_LATEST.append((ids[-1], latest(cwd)))
    return cwd, ids


NEW_AND_LATEST: list[tuple[str, str]] = []


def test_each_run_has_its_own_directory_and_latest_follows(two_runs) -> None:
    cwd, (first, second) = two_runs
    assert first != second and NEW_AND_LATEST == [(first, first), (second, second)]
    for rid in (first, second):
        info = RunDir(cwd / "runs" / rid).info()
        assert info is not None and info.run_id == rid and info.mode == "colocated"
        assert info.env_id == "Pendulum-v1" and info.algo == "ppo"
        assert json.loads((cwd / "runs" / rid / "summary.json").read_text())["env"] == "Pendulum-v1"


COLOCATED_FILES = {"run.json", "summary.json", "actor-0.summary.json", "learner.summary.json", "streams.summary.json",
                   "curve.json", "timeline.json", "log", "snapshots"}


def test_every_file_a_colocated_run_writes_is_a_run_file(two_runs) -> None:
    """What a co-located run leaves at its top level (here without plot and TensorBoard): all of
    it named by ``runtime.rundir.RUN_FILES``, so a run from before markers is still recognised."""
    from runtime.rundir import RUN_FILES, _matches_run_file

    cwd, (first, _) = two_runs
    names = set(os.listdir(cwd / "runs" / first))
    assert names == COLOCATED_FILES
    assert all(_matches_run_file(n) for n in names), RUN_FILES


def test_a_role_refuses_another_runs_directory_and_writes_nothing(two_runs) -> None:
    cwd, (first, _) = two_runs
    run = cwd / "runs" / first
    before = files(run)
    for role in ("learner", "actor"):
        r = rlstream(cwd, role, "--env", "Pendulum-v1", "--run-dir", f"runs/{first}", "--bootstrap", "127.0.0.1:1",
                     *TINY, timeout=60)
        assert r.returncode == 2, (r.stdout[-1000:], r.stderr[-2000:])
        assert f"belongs to run '{first}'" in r.stderr and "--resume" in r.stderr
        assert "Traceback" not in r.stderr
    assert files(run) == before
    # the same for a second co-located run aimed at it
    r = rlstream(cwd, "train", "--env", "Pendulum-v1", "--run-dir", f"runs/{first}", *TINY)
    assert r.returncode == 2 and "--resume" in r.stderr
    assert files(run) == before


def test_a_directory_that_is_not_a_run_is_refused(two_runs, tmp_path: Path) -> None:
    cwd, _ = two_runs
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "todo.txt").write_text("keep")
    r = rlstream(cwd, "train", "--env", "Pendulum-v1", "--run-dir", str(mine), *TINY)
    assert r.returncode == 2 and "is not empty and is not a run directory" in r.stderr
    assert sorted(p.name for p in mine.iterdir()) == ["todo.txt"]


def test_resume_continues_the_latest_run_under_its_id(two_runs) -> None:
    cwd, (_, second) = two_runs
    RunDir(cwd / "runs" / second).point_latest()
    before = sorted(os.listdir(cwd / "runs"))
    r = rlstream(cwd, "train", "--env", "Pendulum-v1", "--resume", *TINY[2:], "--total-steps", "2048")
    assert r.returncode == 0, r.stderr[-2000:]
    assert latest(cwd) == second and sorted(os.listdir(cwd / "runs")) == before
    assert RunDir(cwd / "runs" / second).info().run_id == second
    assert json.loads((cwd / "runs" / second / "summary.json").read_text())["steps"] == 2048  # on to the new budget


def test_a_dpo_replay_is_a_run_that_eval_reads(two_runs) -> None:
    cwd, (first, second) = two_runs
    runs_before = set(os.listdir(cwd / "runs"))
    dpo_ids = []
    for _ in range(2):  # a second replay never overwrites the first
        r = rlstream(cwd, "replay", "--log-dir", f"runs/{first}/log", "--topic", "rl.samples.raw", "--train-dpo",
                     "--epochs", "2", "--segment", "16")
        assert r.returncode == 0, r.stderr[-2000:]
        dpo_ids.append(latest(cwd))
    assert len(set(dpo_ids)) == 2 and not set(dpo_ids) & runs_before
    for rid in dpo_ids:
        run = cwd / "runs" / rid
        assert RunDir(run).info().mode == "dpo" and (run / "policy.safetensors").is_file()
    r = rlstream(cwd, "eval", f"runs/{dpo_ids[0]}", "--episodes", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.splitlines()[0])["env"] == "Pendulum-v1"
    listed = rlstream(cwd, "runs", "--json")
    rows = {json.loads(line)["run_id"]: json.loads(line) for line in listed.stdout.splitlines()}
    assert {first, second, *dpo_ids} == set(rows)
    assert rows[dpo_ids[1]]["latest"] and rows[first]["mode"] == "colocated" and rows[first]["status"] == "finished"
    assert rows[first]["steps"] == 1024 and rows[first]["env"] == "Pendulum-v1"
    table = rlstream(cwd, "runs").stdout
    assert f"* {dpo_ids[1]}" in table and first in table and "4 run(s)" in table


def test_claim_rules(tmp_path: Path) -> None:
    rd = RunDir(tmp_path / "r")
    assert rd.claim("a", mode="decoupled") == "a" and is_run(rd.path)
    assert rd.claim("a", mode="decoupled", join=True) == "a"  # a role of the same run
    assert rd.claim("b", mode="decoupled", resume=True) == "a"  # resuming keeps the run's id
    with pytest.raises(RunDirError, match="belongs to run 'a'"):
        rd.claim("a", mode="decoupled")  # a new run with the same id: not without --resume
    with pytest.raises(RunDirError, match="belongs to run 'a'"):
        rd.claim("b", mode="decoupled", join=True)
    # a role not told its run's id joins the run of its mode and namespace, and no other
    assert rd.claim("c", mode="decoupled", join=True, adopt=True) == "a"
    with pytest.raises(RunDirError, match="namespace ''"):
        rd.claim("c", mode="decoupled", join=True, adopt=True, namespace="exp2")
    with pytest.raises(RunDirError, match="belongs to run 'a'"):
        rd.claim("c", mode="colocated", join=True, adopt=True)
    from config.bus import run_namespace

    RunDir(tmp_path / "role-run").claim("r", mode="decoupled", namespace="exp1")  # a role started alone
    assert run_namespace(tmp_path / "role-run") == "exp1"  # what the tools read without --namespace
    assert run_namespace(rd.path) == "" and run_namespace(tmp_path / "none") is None
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(RunDirError, match="is a link"):
        RunDir(link).claim("c", mode="colocated")
    assert not (tmp_path / "elsewhere").exists()


def test_the_decoupled_verdict_merges_every_actor(tmp_path: Path) -> None:
    from config import TrainConfig
    from rlstream.monitor import run_learning
    from runtime.progress import verdict

    cfg = TrainConfig(env_id="Pendulum-v1", run_dir=tmp_path, plot=True)
    curves = {"actor-0": ([100, 200, 300, 400], [-10.0, -9.0, -8.0, -7.0]),
              "actor-1": ([50, 100], [-20.0, 1.0])}  # half the steps: its episodes spread over the same run
    summaries = {"actor-0": {"steps": 400}, "actor-1": {"steps": 100}}
    for name, (steps, returns) in curves.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "curve.json").write_text(json.dumps({"steps": steps, "returns": returns}))
    out = run_learning(cfg, ["actor-0", "actor-1"], summaries)
    merged = json.loads((tmp_path / "curve.json").read_text())
    assert merged["steps"] == [125, 250, 250, 375, 500, 500]
    assert merged["returns"] == [-10.0, -9.0, -20.0, -8.0, -7.0, 1.0]
    assert out["steps"] == 500 and out["episodes"] == 6
    assert out["first_returns_mean"] == round(sum(merged["returns"]) / 6, 2) == out["return_mean20"]
    assert out["plot"] == str(tmp_path / "returns.png") and (tmp_path / "returns.png").stat().st_size > 0
    line = verdict({"mode": "decoupled", **out})
    assert f"-> {sum(merged['returns']) / 6:.1f} (last 20 episodes); plot: {tmp_path}/returns.png" in line


def test_a_replay_without_dpo_makes_no_run(two_runs) -> None:
    cwd, (first, _) = two_runs
    before = sorted(os.listdir(cwd / "runs"))
    r = rlstream(cwd, "replay", "--log-dir", f"runs/{first}/log", "--topic", "rl.samples.raw", "--segment", "16")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["summary"]["pairs_built"] > 0
    assert sorted(os.listdir(cwd / "runs")) == before


def test_a_directory_holding_only_role_logs_is_taken(tmp_path: Path) -> None:
    run = tmp_path / "r"
    run.mkdir()
    (run / "learner.1.log").write_text("started\n")  # a shell redirect made it before the role started
    assert RunDir(run).claim("r", mode="decoupled", join=True) == "r"
    assert RunDir(run).info().run_id == "r" and (run / "learner.1.log").read_text() == "started\n"
    legacy = tmp_path / "legacy"
    (legacy / "log").mkdir(parents=True)
    (legacy / "log" / "_topics.json").write_text("{}")
    with pytest.raises(RunDirError, match="holds an earlier run"):
        RunDir(legacy).claim("x", mode="colocated")
    assert RunDir(legacy).claim("x", mode="colocated", resume=True) == "x"


def test_roles_of_one_run_marking_its_directory_at_once_both_join(tmp_path: Path, monkeypatch) -> None:
    """The learner and an actor started together claim one new directory: whichever marks it
    first, the other joins (a fault run's actor was refused with "holds an earlier run" when the
    learner's marker landed between its look for one and its scan of the files)."""
    d = tmp_path / "run"
    looks = {"n": 0}
    real_info = RunDir.info

    def info_while_the_learner_marks(self):  # the actor's first look: no marker yet
        looks["n"] += 1
        if looks["n"] == 1:
            assert RunDir(d).claim("r1", mode="decoupled", join=True, namespace="ns") == "r1"  # the learner
            return None
        return real_info(self)

    monkeypatch.setattr(RunDir, "info", info_while_the_learner_marks)
    assert RunDir(d).claim("r1", mode="decoupled", join=True, namespace="ns") == "r1"  # the actor joins
    monkeypatch.undo()
    assert RunDir(d).info().run_id == "r1" and RunDir(d).namespace_file.read_text().strip() == "ns"
    # a run that is not this one's is still refused, however the marks interleave
    with pytest.raises(RunDirError, match="belongs to run 'r1'"):
        RunDir(d).claim("r2", mode="decoupled", join=True, namespace="ns")


def test_two_markers_at_once_leave_one_run(tmp_path: Path, monkeypatch) -> None:
    """Two runs marking one new directory at once: one owns it, the other is refused; neither
    marker overwrites the other."""
    d = tmp_path / "run"
    d.mkdir()
    real_mark = RunDir._mark
    seen = {"n": 0}

    def mark_after_a_rival(self, info):
        seen["n"] += 1
        if seen["n"] == 1:  # a rival run marks between this one's checks and its mark
            assert real_mark(self, RunInfo.from_dict({**info.as_dict(), "run_id": "rival"})) is True
        return real_mark(self, info)

    monkeypatch.setattr(RunDir, "_mark", mark_after_a_rival)
    with pytest.raises(RunDirError, match="belongs to run 'rival'"):
        RunDir(d).claim("mine", mode="colocated")
    assert json.loads((d / "run.json").read_text())["run_id"] == "rival"
