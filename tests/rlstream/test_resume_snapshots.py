"""``rlstream train --resume`` through the real command when the run's snapshots are unusable
(issue 39, part 2): the newest corrupt one is skipped with a warning that names it; none intact is
one line on stderr, exit 2, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TINY = ["--env", "Pendulum-v1", "--total-steps", "1024", "--num-envs", "2", "--train-batch-size", "512",
        "--torch-threads", "1", "--metrics-port", "-1", "--no-plot", "--tensorboard", "off"]


def rlstream(cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLSTREAM_", "KAFKA_"))}
    return subprocess.run([sys.executable, "-m", "rlstream.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, start_new_session=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("work")
    r = rlstream(cwd, "train", *TINY)
    assert r.returncode == 0, r.stderr[-2000:]
    return cwd


def _snapshots(cwd: Path) -> list[Path]:
    return sorted((cwd / "runs" / "latest" / "snapshots").glob("v*.safetensors"))


def test_resume_with_every_snapshot_torn_is_one_line_exit_2(run) -> None:
    weights = [p for p in _snapshots(run) if not p.name.endswith(".state.safetensors")]
    assert weights, "the run left no snapshot"
    for p in weights:
        p.write_bytes(p.read_bytes()[:16])  # truncated
    r = rlstream(run, "train", *TINY[:2], "--resume", *TINY[2:], "--total-steps", "2048")
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in r.stderr
    assert lines[-1].startswith("rlstream train: error: no intact snapshot to resume from in "), lines[-1]
    assert lines[-1].endswith("remove them, or start without --resume")
