"""Progress lines and the state file a supervisor reads: the file stays current even when lines
are logged rarely (the decoupled parent's drain check reads it every second)."""

from __future__ import annotations

import time

from runtime.progress import Progress, read_state


def test_the_state_file_is_written_every_state_interval_though_lines_are_rare(tmp_path, capsys):
    path = tmp_path / "learner.state.json"
    p = Progress(total_steps=100, log_every_s=1e9, state_path=path, state_every_s=0.0)
    p.maybe_log(force=True)
    capsys.readouterr()
    for n in (1, 2, 3):
        p.updates = n
        p.on_batch(10, [], 0)
        p.maybe_log()
        assert read_state(path)["updates"] == n and read_state(path)["steps"] == 10 * n
    assert capsys.readouterr().err == ""  # no progress line was logged


def test_lines_still_follow_log_every_s(tmp_path, capsys):
    p = Progress(total_steps=100, log_every_s=1e9, state_path=tmp_path / "s.json", state_every_s=1e9)
    p._last_log = p._last_state = time.perf_counter()
    p.updates = 7
    p.maybe_log()
    assert read_state(tmp_path / "s.json") is None and capsys.readouterr().err == ""
    p.maybe_log(force=True)
    assert read_state(tmp_path / "s.json")["updates"] == 7 and '"progress"' in capsys.readouterr().err
