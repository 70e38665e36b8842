"""The recorded co-located run the time-travel tests share (``recorded.record_run``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .recorded import UPDATES, record_run


@pytest.fixture(scope="session")
def colocated_run(tmp_path_factory) -> tuple[Path, dict]:
    """(run directory, summary) of the recorded run; tests copy it before changing anything."""
    run_dir = tmp_path_factory.mktemp("timetravel") / "parent"
    summary = record_run(run_dir, "parent")
    assert summary["updates"] == UPDATES
    return run_dir, summary
