"""``rlstream prune``'s lifecycle at its edges, beside tests/ops/test_prune.py: an entry exactly
as old as the bound is kept ("older than"), the command's default bound is the guide's 30 days,
and the library's ``prune`` only lists unless told ``yes``."""

from __future__ import annotations

import os
from pathlib import Path

from rlstream.cli import main
from runtime.prune import DEFAULT_OLDER_THAN, plan, prune
from tests.ops.test_prune import DAY, make_run, names


def test_an_entry_exactly_as_old_as_the_bound_is_kept(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    t = 1_700_000_000  # whole seconds: the file system keeps them exactly
    for name, when in (("edge", t), ("older", t - 1)):
        run = make_run(runs, name, 0)
        for p in [run, *run.rglob("*")]:
            os.utime(p, (when, when))
    assert names(plan(runs, 30 * DAY, now=t + 30 * DAY)) == {"older"}


def test_the_default_bound_is_30_days(tmp_path: Path, capsys) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    make_run(runs, "ten-days", 10)
    make_run(runs, "month-and-a-day", 31)
    assert DEFAULT_OLDER_THAN == "30d"
    assert main(["prune", str(runs), "--yes"]) == 0
    assert sorted(p.name for p in runs.iterdir()) == ["ten-days"]
    assert "removed 1 entries older than 30d" in capsys.readouterr().out


def test_the_library_lists_unless_told_yes(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    make_run(runs, "old", 40)
    assert names(prune(runs, 30 * DAY)) == {"old"}
    assert (runs / "old" / "learner.log").exists()
