"""A learner fenced by a newer one of its run and rank (``WriterFencedError``) ends with one
``learner_fenced`` line and its own exit status, which the supervisor does not restart
(``tests/rlstream/test_supervisor.py``); the fencing itself: ``tests/faults/test_fenced_learner.py``."""

from __future__ import annotations

from rlstream import cli, processes
from streams.bus.base import EXIT_FENCED, WriterFencedError


def test_a_fenced_learner_exits_with_its_own_status(tmp_path, monkeypatch, capsys):
    def fenced(*a, **k):
        raise WriterFencedError("a newer writer with transactional id 'x' has started")

    monkeypatch.setattr(processes, "run_learner", fenced)
    rc = cli.main(["learner", "--run-dir", str(tmp_path / "run"), "--metrics-port", "-1", "--log-json"])
    assert rc == EXIT_FENCED
    out = capsys.readouterr()
    assert "learner_fenced" in out.out + out.err
