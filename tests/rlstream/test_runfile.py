"""The run config file: concurrent writers (the learner ranks of one run) never trip over each
other's temporary file, and a reader sees one whole document."""

from __future__ import annotations

import multiprocessing as mp

from config.runfile import read_run_config, write_run_config


def _write_many(path: str, tag: int, n: int, errors) -> None:
    try:
        for i in range(n):
            write_run_config({"writer": tag, "i": i}, path)
    except Exception as e:  # reported to the parent, which fails the test
        errors.put(f"{type(e).__name__}: {e}")


def test_concurrent_writers_of_one_config_file_all_succeed(tmp_path):
    path = str(tmp_path / "learner.config.json")
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [ctx.Process(target=_write_many, args=(path, tag, 300, errors)) for tag in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert all(p.exitcode == 0 for p in procs)
    assert errors.empty(), errors.get()
    doc = read_run_config(path)
    assert doc["writer"] in range(3) and doc["i"] == 299
    assert [p.name for p in tmp_path.iterdir()] == ["learner.config.json"]  # no temp file left
