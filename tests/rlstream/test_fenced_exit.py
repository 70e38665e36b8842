"""A learner fenced by a newer one of its run and rank (``WriterFencedError``) ends with one
``learner_fenced`` line and its own exit status, which the supervisor does not restart
(``tests/rlstream/test_supervisor.py``); with ``--learner.on-fenced wait`` it first waits for
SIGTERM (the real process: ``tests/faults/test_fenced_learner.py``, with the fencing itself)."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from config import TrainConfig, read_config, write_config
from learner.distributed import EXIT_PEER_LOST, launch_ranks
from rlstream import cli, processes
from rlstream.cli import build_parser
from streams.bus.base import EXIT_FENCED, WriterFencedError


def test_a_fenced_learner_exits_with_its_own_status(tmp_path, monkeypatch, capsys):
    def fenced(*a, **k):
        raise WriterFencedError("a newer writer with transactional id 'x' has started")

    monkeypatch.setattr(processes, "run_learner", fenced)
    rc = cli.main(["learner", "--run-dir", str(tmp_path / "run"), "--metrics-port", "-1", "--log-json"])
    assert rc == EXIT_FENCED
    out = capsys.readouterr()
    assert "learner_fenced" in out.out + out.err


def test_on_fenced_is_a_learner_flag_exit_by_default_and_read_from_old_config_files(tmp_path):
    parse = build_parser().parse_args
    assert parse(["learner"]).train.learner.on_fenced == "exit"
    assert parse(["learner", "--learner.on-fenced", "wait"]).train.learner.on_fenced == "wait"
    with pytest.raises(SystemExit) as refused:
        parse(["learner", "--learner.on-fenced", "sleep"])
    assert refused.value.code == 2
    cfg = replace(TrainConfig(), learner=replace(TrainConfig().learner, on_fenced="wait"))
    path = write_config(cfg, tmp_path / "config.json")
    assert read_config(path).learner.on_fenced == "wait"
    d = json.loads(path.read_text())
    del d["config"]["learner"]["on_fenced"]  # a file written before the flag: its learner exited when fenced
    path.write_text(json.dumps(d))
    assert read_config(path).learner.on_fenced == "exit"
    with pytest.raises(ValueError, match="--learner.on-fenced"):
        replace(cfg, learner=replace(cfg.learner, on_fenced="sleep"))

def test_ranks_of_which_one_was_fenced_end_with_the_fenced_status(tmp_path):
    """``launch_ranks``: rank 1 loses its peer and exits ``EXIT_PEER_LOST`` first; rank 0, the
    fenced one (told to wait), exits ``EXIT_FENCED`` at the launcher's SIGTERM. The group's
    status is ``EXIT_FENCED``, so the launcher (``rlstream learner``) waits in its place rather
    than exit into a restart."""
    ready = tmp_path / "rank0-waits"
    script = (
        "import os, signal, sys, time\n"
        f"ready = {str(ready)!r}\n"
        "if os.environ['RANK'] == '0':\n"
        "    signal.signal(signal.SIGTERM, lambda *a: sys.exit(4))\n"
        "    open(ready, 'w').close()\n"
        "    while True: time.sleep(0.05)\n"
        "deadline = time.monotonic() + 60\n"
        "while not os.path.exists(ready) and time.monotonic() < deadline: time.sleep(0.05)\n"
        f"sys.exit({EXIT_PEER_LOST})\n"
    )
    code = launch_ranks(["-c", script], 2, dict(os.environ), grace_s=60)
    assert code == EXIT_FENCED
