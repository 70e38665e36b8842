"""``rlstream broker status`` and ``stop`` find the broker a ``start`` on their port made, its
``--data-dir`` included, and ``status``'s fields agree with each other (issue 37)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from localkafka.broker import LocalKafka
from localkafka.fetch import is_fetched
from localkafka.paths import cache_root, default_version
from tests.support import free_port, free_port_pair

ROOT = Path(__file__).resolve().parents[1]


def broker_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RLSTREAM_KAFKA_JAVA_OPTS": "-Xms128m -Xmx512m"}
    return subprocess.run([sys.executable, "-m", "rlstream.cli", "broker", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.kafka
def test_status_and_stop_by_port_find_a_broker_started_with_its_own_data_dir(tmp_path):
    if not is_fetched(default_version()) and not shutil.which("mvn"):
        pytest.skip("no Kafka jars and no mvn to fetch them")
    port = free_port_pair()
    data = tmp_path / "my-kafka"
    record = cache_root() / "brokers" / f"{port}.json"
    try:
        started = broker_cli("start", "--port", str(port), "--data-dir", str(data))
        assert started.returncode == 0, started.stderr[-3000:]
        status = json.loads(broker_cli("status", "--port", str(port)).stdout)
        assert status["data_dir"] == str(data.resolve()), status
        assert status["running"] is True and status["ready"] is True and status["answering"] is True, status
        assert "note" not in status
        stopped = broker_cli("stop", "--port", str(port))
        assert stopped.returncode == 0 and f"stopped broker on 127.0.0.1:{port}" in stopped.stderr, stopped.stderr
        after = json.loads(broker_cli("status", "--port", str(port)).stdout)
        assert (after["running"], after["ready"], after["answering"]) == (False, False, False), after
    finally:
        LocalKafka(port=port, data_dir=data).kill()
        record.unlink(missing_ok=True)


def test_status_of_a_port_another_broker_holds_says_which_data_dir_to_pass(kafka_bootstrap, tmp_path, capsys):
    """Nothing runs from this data dir, yet a Kafka answers on the port: not ``ready``, and a note."""
    from localkafka.cli import main

    port = int(kafka_bootstrap.rsplit(":", 1)[1])
    assert main(["status", "--port", str(port), "--data-dir", str(tmp_path)]) == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["running"], status["ready"], status["answering"]) == (False, False, True), status
    assert "--data-dir it was started with" in status["note"] and str(tmp_path.resolve()) in status["note"]


def test_help_names_both_default_data_dirs():
    out = broker_cli("status", "--help").stdout
    assert "data-<port>" in out and "cluster-<port>" in out and "status and stop" in out


def test_a_record_whose_data_dir_is_gone_is_ignored(tmp_path):
    from localkafka.cli import recall, remember

    port = free_port()
    record = cache_root() / "brokers" / f"{port}.json"
    try:
        remember(port, tmp_path / "d", "3.9.1", 1)
        assert recall(port) is None  # never made
        (tmp_path / "d").mkdir()
        assert recall(port)["data_dir"] == str(tmp_path / "d")
    finally:
        record.unlink(missing_ok=True)
