"""``rlstream prune``: run directories (logs, TensorBoard, event log) past their lifecycle, on real
files with real mtimes; dry run by default; ``runs/latest``'s target is never removed; only run
directories (their ``run.json``) are ever touched: never a home directory's, a repository's or a
folder's other files, never what a link points to."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from config.bus import parse_duration_ms
from rlstream.cli import main
from runtime.prune import NoRuns, plan, prune
from runtime.rundir import RunDir

DAY = 86400.0


def make_run(runs: Path, name: str, age_days: float, *, young_file_days: float | None = None,
             marker: bool = True) -> Path:
    """A run directory like a decoupled run's: its marker, process logs, tb/, the event log; every
    entry ``age_days`` old (one file ``young_file_days`` old if given). ``marker=False``: a run
    from before markers (recognised by holding only a run's files)."""
    run = runs / name
    if marker:
        RunDir(run).claim(name, mode="decoupled")
    else:
        (run / "log").mkdir(parents=True)
        (run / "log" / "_topics.json").write_text("{}")  # a co-located run's event log
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
    make_run(runs, "legacy", 48, marker=False)
    (runs / "latest").symlink_to("old-latest")  # as RunDir.point_latest makes it: relative
    old_log = runs / "bench.log"  # not a run: never pruned, however old
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
    for n in ("old-a", "old-b", "legacy"):
        assert f"would remove {runs / n}" in out
    for n in ("fresh", "resumed", "old-latest", "bench.log"):
        assert str(runs / n) + " " not in out


def test_yes_removes_old_runs_and_logs_but_never_latest_or_its_target(runs: Path, capsys) -> None:
    assert main(["prune", str(runs), "--older-than", "30d", "--yes"]) == 0
    assert sorted(p.name for p in runs.iterdir()) == ["bench.log", "fresh", "latest", "old-latest", "resumed"]
    assert (runs / "latest").resolve() == (runs / "old-latest").resolve()
    assert (runs / "old-latest" / "learner.log").read_text() == "old-latest learner.log\n"
    assert (runs / "resumed" / "actor-0.log").exists()  # a run is as young as its newest write
    assert "removed 3 entries" in capsys.readouterr().out


def test_the_bound_is_a_parameter(runs: Path) -> None:
    assert names(plan(runs, 50 * DAY)) == set()  # 60-day "resumed" was written yesterday; latest kept
    assert names(plan(runs, 47.5 * DAY)) == {"legacy"}
    assert names(plan(runs, 1.5 * DAY)) == {"old-a", "old-b", "fresh", "legacy"}
    assert names(prune(runs, 46.5 * DAY, yes=True)) == {"legacy"}
    assert (runs / "old-a").is_dir() and not (runs / "legacy").exists()


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
    make_run(tmp_path, "r", 1)
    assert main(["prune", str(tmp_path), "--older-than", "soon"]) == 2
    assert "cannot read 'soon'" in capsys.readouterr().err
    assert main(["prune", str(tmp_path / "nope")]) == 2
    assert "no directory" in capsys.readouterr().err
    assert parse_duration_ms("30d") == 30 * DAY * 1000 and parse_duration_ms("90m") == 90 * 60_000
    with pytest.raises(ValueError):
        parse_duration_ms("forever")


def tree(root: Path) -> list[tuple[str, bool]]:
    """Every path under ``root`` (links not followed), with whether it is a link."""
    return sorted((str(p.relative_to(root)), p.is_symlink()) for p in root.rglob("*"))


def aged_tree(root: Path, files: dict[str, str], age_days: float) -> Path:
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    t = time.time() - age_days * DAY
    for p in [root, *root.rglob("*")]:
        os.utime(p, (t, t), follow_symlinks=False)
    return root


@pytest.mark.parametrize("what", ["home", "repository", "docs"])
def test_a_folder_that_is_not_a_runs_folder_is_refused_and_left_whole(tmp_path: Path, what: str, capsys) -> None:
    files = {
        "home": {".bashrc": "x", "notes.txt": "mine", "Documents/cv.pdf": "pdf", ".ssh/id_ed25519": "key",
                 "projects/app/summary.json": "{}"},
        "repository": {"README.md": "# r", "pyproject.toml": "", "tests/test_x.py": "", ".git/HEAD": "ref",
                       ".venv/bin/python": "", "docs/summary.json": "{}"},
        "docs": {f"page{i}.md": "text" for i in range(12)},
    }[what]
    root = aged_tree(tmp_path / what, files, 400)
    before = tree(root)
    for argv in (["prune", str(root)], ["prune", str(root), "--older-than", "1m", "--yes"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "holds no rlstream runs" in err
    assert tree(root) == before
    with pytest.raises(NoRuns):
        plan(root, 60.0)


def test_one_run_beside_other_files_only_the_run_goes(tmp_path: Path, capsys) -> None:
    root = aged_tree(tmp_path / "work", {"README.md": "keep", "data/big.csv": "1,2", "notes.log": "keep",
                                         "summary.json": "{}"}, 400)
    make_run(root, "abc123", 400)
    (root / "plain-dir").mkdir()
    (root / "plain-dir" / "config.json").write_text("{}")  # run-like names alone do not make a run
    os.utime(root / "plain-dir", (0, 0))
    others = [p for p in tree(root) if not p[0].startswith("abc123")]
    assert main(["prune", str(root), "--older-than", "1d", "--yes"]) == 0
    assert tree(root) == others
    assert "removed 1 entries" in capsys.readouterr().out


def test_a_run_directory_given_as_the_runs_folder_is_refused(tmp_path: Path, capsys) -> None:
    run = make_run(tmp_path / "runs", "r1", 90)
    assert main(["prune", str(run), "--older-than", "1d", "--yes"]) == 2
    assert "is a run directory itself" in capsys.readouterr().err
    assert (run / "learner.log").exists() and (run / "log" / "rl.policy.versions" / "0.log").exists()


def test_links_are_never_followed_out(tmp_path: Path) -> None:
    outside = aged_tree(tmp_path / "outside", {"precious.txt": "keep", "summary.json": "{}"}, 400)
    RunDir(outside / "a-run-elsewhere").claim("elsewhere", mode="colocated")
    aged_tree(outside, {}, 400)
    runs = tmp_path / "runs"
    make_run(runs, "old", 90)
    run_in = make_run(runs, "old-with-link", 90)
    (run_in / "tb-link").symlink_to(outside, target_is_directory=True)  # a link inside a run
    (runs / "linked-run").symlink_to(outside / "a-run-elsewhere", target_is_directory=True)  # a link as an entry
    (runs / "linked-home").symlink_to(outside, target_is_directory=True)
    for p in runs.rglob("*"):
        os.utime(p, (0, 0), follow_symlinks=False)
    before_outside = tree(outside)
    assert names(prune(runs, DAY, yes=True)) == {"old", "old-with-link"}
    assert tree(outside) == before_outside
    assert (outside / "precious.txt").read_text() == "keep"
    assert (runs / "linked-run").is_symlink() and (runs / "linked-home").is_symlink()
