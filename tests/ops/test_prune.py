"""``rlstream prune``: run directories (logs, TensorBoard, event log) past their lifecycle, on real
files with real mtimes; dry run by default; ``runs/latest``'s target is never removed."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from config.bus import parse_duration_ms
from rlstream.cli import main
from runtime.prune import plan, prune

DAY = 86400.0


def make_run(runs: Path, name: str, age_days: float, *, young_file_days: float | None = None) -> Path:
    """A run directory like a decoupled run's: process logs, tb/, the event log; every entry
    ``age_days`` old (one file ``young_file_days`` old if given)."""
    run = runs / name
    for rel in ("learner.log", "actor-0.log", "tb/learner/events.out.tfevents.1", "log/rl.policy.versions/0.log",
                "summary.json"):
        f = run / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(f"{name} {rel}\n")
    t = time.time() - age_days * DAY
    for root, dirs, files in os.walk(run, topdown=False):
        for n in files + dirs:
            os.utime(os.path.join(root, n), (t, t))
    os.utime(run, (t, t))
    if young_file_days is not None:
        ty = time.time() - young_file_days * DAY
        os.utime(run / "learner.log", (ty, ty))
    return run


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    runs = tmp_path / "runs"
    runs.mkdir()
    make_run(runs, "old-a", 45)
    make_run(runs, "old-b", 31)
    make_run(runs, "fresh", 2)
    make_run(runs, "resumed", 60, young_file_days=1)  # old files, but written to yesterday
    make_run(runs, "old-latest", 90)
    (runs / "latest").symlink_to("old-latest")  # as resolve_run_dir makes it: relative
    old_log = runs / "bench.log"
    old_log.write_text("x\n")
    os.utime(old_log, (time.time() - 40 * DAY,) * 2)
    return runs


def names(entries) -> set[str]:
    return {e.path.name for e in entries}


def test_dry_run_lists_what_is_older_than_the_bound_and_deletes_nothing(runs: Path, capsys) -> None:
    before = sorted(p.relative_to(runs) for p in runs.rglob("*"))
    assert main(["prune", str(runs), "--older-than", "30d"]) == 0
    out = capsys.readouterr().out
    assert sorted(p.relative_to(runs) for p in runs.rglob("*")) == before
    assert "would remove 3 entries" in out and "--yes" in out
    for n in ("old-a", "old-b", "bench.log"):
        assert f"would remove {runs / n}" in out
    for n in ("fresh", "resumed", "old-latest"):
        assert str(runs / n) + " " not in out


def test_yes_removes_old_runs_and_logs_but_never_latest_or_its_target(runs: Path, capsys) -> None:
    assert main(["prune", str(runs), "--older-than", "30d", "--yes"]) == 0
    assert sorted(p.name for p in runs.iterdir()) == ["fresh", "latest", "old-latest", "resumed"]
    assert (runs / "latest").resolve() == (runs / "old-latest").resolve()
    assert (runs / "old-latest" / "learner.log").read_text() == "old-latest learner.log\n"
    assert (runs / "resumed" / "actor-0.log").exists()  # a run is as young as its newest write
    assert "removed 3 entries" in capsys.readouterr().out


def test_the_bound_is_a_parameter(runs: Path) -> None:
    assert names(plan(runs, 50 * DAY)) == set()  # 60-day "resumed" was written yesterday; latest kept
    assert names(plan(runs, 40.5 * DAY)) == {"old-a"}
    assert names(plan(runs, 1.5 * DAY)) == {"old-a", "old-b", "fresh", "bench.log"}
    assert names(prune(runs, 35 * DAY, yes=True)) == {"old-a", "bench.log"}
    assert (runs / "old-b").is_dir()


def test_latest_as_an_absolute_link_or_a_plain_directory_is_kept(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    target = make_run(runs, "r1", 90)
    (runs / "latest").symlink_to(target.absolute())
    assert names(prune(runs, DAY, yes=True)) == set()
    (runs / "latest").unlink()
    make_run(runs, "latest", 90)  # resumed in place: a real directory named latest
    assert names(prune(runs, DAY, yes=True)) == {"r1"}
    assert (runs / "latest").is_dir()


def test_bad_age_and_missing_dir_are_clear_errors(tmp_path: Path, capsys) -> None:
    assert main(["prune", str(tmp_path), "--older-than", "soon"]) == 2
    assert "cannot read 'soon'" in capsys.readouterr().err
    assert main(["prune", str(tmp_path / "nope")]) == 2
    assert "no directory" in capsys.readouterr().err
    assert parse_duration_ms("30d") == 30 * DAY * 1000 and parse_duration_ms("90m") == 90 * 60_000
    with pytest.raises(ValueError):
        parse_duration_ms("forever")
