"""What a new user does on day one, through the real CLI in subprocesses: train on their own
environment (``module:EnvId``, discrete actions, a wrapper), read the one-line verdict and the
plot, open TensorBoard's event files (read back with TensorBoard's own EventAccumulator), and
evaluate recorded versions from the event log and from the snapshots, with a video."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from config.bus import run_namespace
from rlstream.cli import build_parser, train_config
from streams.topics import SAMPLES_RAW, STREAMS_GROUP, Namespace
from tests.support.kafka import GroupGenerations, end_offsets, handed_again_at_most

ROOT = Path(__file__).resolve().parents[2]
USER_ENVS = ROOT / "tests" / "envs"


def cli_env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(USER_ENVS), os.environ.get("PYTHONPATH", "")])
    env.pop("RLSTREAM_METRICS_PORT", None)
    return env


def rlstream(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlstream.cli", *args], cwd=str(ROOT), env=cli_env(),
                          capture_output=True, text=True, timeout=timeout)


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of one TensorBoard run, read with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def check_tensorboard(tb_run: Path, actors: list[str]) -> None:
    for role in actors:
        s = scalars(tb_run / role)
        assert s["charts/episodic_return"] and s["charts/episodic_length"] and s["charts/SPS"], sorted(s)
        assert all(v > 0 for _, v in s["charts/SPS"])
        assert not any(t.startswith("losses/") for t in s)
    s = scalars(tb_run / "learner")
    for tag in ("losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/approx_kl",
                "losses/clipfrac", "losses/explained_variance", "charts/learning_rate", "charts/SPS"):
        assert len(s[tag]) >= 2, (tag, sorted(s))
    assert not any(t.startswith("charts/episodic") for t in s)


def test_plot_is_on_by_default_and_no_plot_disables_it(tmp_path):
    parse = build_parser().parse_args
    assert train_config(parse(["train", "--run-dir", str(tmp_path / "a")])).plot is True
    cfg = train_config(parse(["train", "--no-plot", "--run-dir", str(tmp_path / "b"), "--tensorboard", "off"]))
    assert cfg.plot is False and cfg.tensorboard is None
    assert train_config(parse(["train", "--run-dir", str(tmp_path / "c")])).tensorboard == str(tmp_path / "c" / "tb")
    assert train_config(parse(["train", "--tensorboard", "/x/tb", "--run-dir", str(tmp_path)])).tensorboard == "/x/tb"
    with pytest.raises(SystemExit, match="unknown wrapper"):
        train_config(parse(["train", "--wrappers", "normalize_obs,bogus"]))


def test_train_own_env_verdict_plot_tensorboard_then_eval(tmp_path):
    run = tmp_path / "run"
    p = rlstream("train", "--env", "user_envs:Corridor-v0", "--wrappers", "normalize_obs", "--total-steps", "2048",
                 "--num-envs", "4", "--train-batch-size", "512", "--snapshot-every", "1", "--run-dir", str(run),
                 "--run-id", "dayone", "--metrics-port", "-1", "--log-every", "60")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    last = p.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"verdict: return (-?[\d.]+) \(first episodes\) -> (-?[\d.]+) \(last 20 episodes\); plot: (.+)",
                     last)
    assert m, last
    summary = json.loads((run / "summary.json").read_text())
    assert float(m.group(1)) == pytest.approx(summary["first_returns_mean"], abs=0.051)
    assert float(m.group(2)) == pytest.approx(summary["return_mean20"], abs=0.051)
    assert Path(m.group(3)) == run / "returns.png" and (run / "returns.png").stat().st_size > 1000
    assert summary["env"] == "user_envs:Corridor-v0" and summary["wrappers"] == ["normalize_obs"]
    assert summary["updates"] == 4 and summary["events"]["rl.deadletter"] == 0
    check_tensorboard(run / "tb" / "dayone", ["actor"])

    # eval from the event log: a version in the middle, with a video of its first episode
    e = rlstream("eval", str(run), "--version", "2", "--episodes", "3", "--deterministic",
                 "--video", str(tmp_path / "video"))
    assert e.returncode == 0, e.stdout[-2000:] + e.stderr[-2000:]
    result = json.loads(e.stdout.splitlines()[0])
    assert (result["version"], result["source"], result["episodes"]) == (2, "log", 3)
    assert len(result["returns"]) == 3 and result["std"] == pytest.approx(0.0)  # deterministic, same start
    assert result["mean"] == pytest.approx(sum(result["returns"]) / 3, abs=1e-3)
    assert Path(result["video"]).parent == tmp_path / "video" and Path(result["video"]).stat().st_size > 0
    assert e.stdout.strip().splitlines()[-1].startswith("user_envs:Corridor-v0 version 2 (log): return ")

    # without the log, the newest snapshot serves
    shutil.rmtree(run / "log")
    e = rlstream("eval", str(run), "--episodes", "2")
    assert e.returncode == 0, e.stderr[-2000:]
    result = json.loads(e.stdout.splitlines()[0])
    assert (result["version"], result["source"]) == (4, "snapshots")
    e = rlstream("eval", str(run), "--version", "99")
    assert e.returncode == 2 and "version 99 is neither in its event log" in e.stderr


def test_eval_records_mujoco_video_offscreen_from_a_snapshot(tmp_path):
    """A MuJoCo env rendered offscreen on the CPU (OSMesa: libosmesa6, installed by .ci/run)."""
    import torch

    from agents.networks import Policy
    from learner.snapshots.url import open_store
    from streams.policies import arch_of

    torch.manual_seed(0)
    policy = Policy(4, 1, hidden=(8,))
    run = tmp_path / "run"
    open_store(str(run / "snapshots")).save(3, policy.state_dict(), {"arch": arch_of(policy),
                                                                     "env_id": "InvertedPendulum-v5"})
    env = {**cli_env(), "MUJOCO_GL": "osmesa"}
    e = subprocess.run([sys.executable, "-m", "rlstream.cli", "eval", str(run), "--episodes", "2",
                        "--video", str(tmp_path / "video")], cwd=str(ROOT), env=env, capture_output=True,
                       text=True, timeout=600)
    assert e.returncode == 0, e.stderr[-3000:]
    result = json.loads(e.stdout.splitlines()[0])
    assert (result["version"], result["source"], result["env"]) == (3, "snapshots", "InvertedPendulum-v5")
    import imageio.v2 as imageio

    frames = imageio.mimread(result["video"])
    assert len(frames) >= 2 and frames[0].shape[-1] in (3, 4) and max(f.std() for f in frames) > 0


@pytest.mark.kafka
def test_decoupled_own_env_wrappers_tensorboard_per_role(rl_topics, tmp_path):
    """Every child process (learner, actor) imports the user's env module itself; each role
    writes its own TensorBoard run; the verdict is the run's, over its actors' returns, with one plot."""
    run = tmp_path / "run"
    generations = GroupGenerations(rl_topics, STREAMS_GROUP)  # from now on; scoped below, once the run names it
    p = rlstream("train", "--mode", "decoupled", "--env", "user_envs:Corridor-v0", "--wrappers", "clip_reward",
                 "--total-steps", "1024", "--num-envs", "4", "--train-batch-size", "512", "--bootstrap", rl_topics,
                 "--run-dir", str(run), "--run-id", "dec", "--metrics-port", "-1", "--log-every", "60",
                 "--policy-id", f"dayone-{uuid.uuid4().hex[:8]}")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["exit_codes"] == {"learner": 0, "streams": 0, "actor-0": 0}, summary
    assert summary["processes"]["learner"]["updates"] == 2
    # nothing dropped; a record handed again is only a duplicate, and handed again only by a
    # reassignment the broker recorded or a seek back of the worker's, once per raw record each
    streams = summary["processes"]["streams"]
    assert set(streams["drops"]) <= {"duplicate"}, streams
    ns = Namespace(run_namespace(run) or "")
    generations.group = ns.group(STREAMS_GROUP)
    raw_records = sum(end_offsets(rl_topics, ns.topic(SAMPLES_RAW)).values())
    moves = (generations.reassignments(), streams.get("consumer_rewinds", 0))
    duplicates = streams["drops"].get("duplicate", 0)
    assert duplicates <= handed_again_at_most(*moves, raw_records), (duplicates, moves, raw_records)
    last = p.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"verdict: return -?[\d.]+ \(first episodes\) -> -?[\d.]+ \(last 20 episodes\); "
                        rf"plot: {re.escape(str(run))}/returns\.png", last), last
    actor = summary["processes"]["actor-0"]
    assert summary["steps"] == actor["steps"] and summary["episodes"] == len(
        json.loads((run / "actor-0" / "curve.json").read_text())["returns"])
    assert (summary["first_returns_mean"], summary["return_mean20"]) == (actor["first_returns_mean"],
                                                                         actor["return_mean20"])  # one actor
    check_tensorboard(run / "tb" / "dec", ["actor-0"])
    from runtime.rundir import _matches_run_file

    assert set(os.listdir(run)) == {  # every file a decoupled run writes, each a run file (runtime.rundir)
        "run.json", "namespace", "config.json", "summary.json", "curve.json", "returns.png", "timeline.json",
        "prometheus.targets.json", "tb", "snapshots", "streams-data", "actor-0",
        *(f"{role}.{kind}" for role in ("learner", "actor-0", "streams") for kind in ("log", "summary.json",
                                                                                       "state.json", "config.json"))}
    assert all(_matches_run_file(n) for n in os.listdir(run))
