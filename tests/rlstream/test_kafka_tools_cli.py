"""The Kafka-facing commands as a user types them (issue 37): no broker is one line and exit 2
within seconds; ``subscribe``, ``replay`` and ``PolicyFeed.from_environment`` find a namespaced
run from its run directory, or name the namespaces the broker has; ``rlstream lag`` agrees with
Kafka's own ``kafka-consumer-groups --describe``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from config import BusConfig, Environment
from streams.bus import open_bus
from streams.bus.kafka import BROKER_WAIT_S, KafkaBus, NoBrokerError
from streams.events import event_bus
from streams.topics import LEARNER_GROUP, SAMPLES_PREPARED, SAMPLES_RAW, STREAMS_GROUP, Namespace, all_topics
from tests.rlstream.conftest import make_policy, publish_version
from tests.support import free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
ERROR_PREFIX = "error: "


def rlstream(*args: str, cwd: Path, bootstrap: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RLSTREAM_NAMESPACE"}
    env.update(KAFKA_BROKERS=bootstrap, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "rlstream.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def one_line_error(p: subprocess.CompletedProcess, *needles: str) -> str:
    """The one stderr line that says what is wrong (exit 2, no traceback, no retry noise)."""
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    said = [line for line in p.stderr.splitlines() if ERROR_PREFIX in line]
    assert len(said) == 1, p.stderr[-3000:]
    assert all(n in said[0] for n in needles), said[0]
    return said[0]


@pytest.fixture
def namespace(kafka_bootstrap):
    """A run namespace of its own on the broker, its topics deleted afterwards."""
    ns = Namespace(f"t37-{uuid.uuid4().hex[:10]}")
    yield ns
    with KafkaBus(kafka_bootstrap, client_id="rlstream-test-cleanup") as admin:
        admin.delete_topics([t.name for t in ns.topics()])


def run_dir(where: Path, ns: Namespace, name: str = "run1", latest: bool = False) -> Path:
    """A decoupled run's directory as far as the tools read it: its ``namespace`` file."""
    run = where / "runs" / name
    run.mkdir(parents=True)
    (run / "namespace").write_text(ns.name + "\n")
    if latest:
        (where / "runs" / "latest").symlink_to(name)
    return run


def publish_versions(bootstrap: str, ns: Namespace, n: int) -> None:
    bus = open_bus(BusConfig(kind="kafka", bootstrap=bootstrap, namespace=ns.name))
    try:
        events = event_bus(bus)
        for v in range(n):
            publish_version(events, v, make_policy(v))
    finally:
        bus.close()


# -- no broker -----------------------------------------------------------------------------------

KAFKA_COMMANDS = {
    "subscribe": ["subscribe", "policies"],
    "replay": ["replay", "--train-dpo"],
    "serve": ["serve", "--port", "0", "--metrics-port", "-1"],
    "rollback": ["rollback", "--to", "0", "--snapshot-store", "SNAPS"],
    "lag": ["lag"],
    "learner": ["learner", "--metrics-port", "-1", "--env", "Pendulum-v1"],
    "actor": ["actor", "--metrics-port", "-1", "--env", "Pendulum-v1"],
    "train": ["train", "--mode", "decoupled", "--metrics-port", "-1", "--env", "Pendulum-v1"],
}


def test_no_broker_is_one_line_and_exit_2_from_every_kafka_command(tmp_path):
    from learner.snapshots.url import open_store

    open_store(tmp_path / "snaps", keep_last=None).save(0, make_policy(0).state_dict(), {"algo": "ppo"})
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    env = {k: v for k, v in os.environ.items() if k != "RLSTREAM_NAMESPACE"}
    env.update(KAFKA_BROKERS=address, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    names = list(KAFKA_COMMANDS)
    for wave in (names[:4], names[4:]):  # a few at a time: their imports share the test machine's cores
        procs: dict[str, subprocess.Popen] = {}
        try:
            for name in wave:
                argv = [str(tmp_path / "snaps") if a == "SNAPS" else a for a in KAFKA_COMMANDS[name]]
                cwd = tmp_path / name
                cwd.mkdir()
                procs[name] = subprocess.Popen([sys.executable, "-m", "rlstream.cli", *argv], cwd=cwd, env=env,
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for name, proc in procs.items():
                out, err = proc.communicate(timeout=120)
                p = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
                line = one_line_error(p, f"no Kafka broker at {address}; start one with rlstream broker start")
                assert line.startswith(f"rlstream {name}: error:"), line
                assert "retry" not in err.lower() and "Connection refused" not in err, err[-3000:]
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


@pytest.mark.parametrize("argv", [["subscribe", "policies"], ["lag"], ["replay", "--train-dpo"]])
def test_no_broker_is_said_within_seconds(argv, monkeypatch, tmp_path, capsys):
    """The command's own wait (the interpreter's start aside): it used to retry for 37 s."""
    from rlstream.cli import main

    address = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("KAFKA_BROKERS", address)
    monkeypatch.delenv("RLSTREAM_NAMESPACE", raising=False)
    monkeypatch.chdir(tmp_path)
    import logtools.replay  # noqa: F401  (imported beforehand: the timing is the command's, not torch's)
    t0 = time.monotonic()
    assert main(argv) == 2
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert err.strip() == f"rlstream {argv[0]}: error: no Kafka broker at {address}; start one with rlstream broker start"
    assert took < BROKER_WAIT_S + 3, took


def test_the_bus_says_no_broker_before_any_client_logs(caplog):
    bus = KafkaBus(f"127.0.0.1:{free_port()}", client_id="rlstream-test")
    t0 = time.monotonic()
    with pytest.raises(NoBrokerError, match=r"no Kafka broker at 127\.0\.0\.1:\d+; start one with rlstream broker"):
        bus.create_topics(all_topics())
    assert time.monotonic() - t0 < BROKER_WAIT_S + 3
    assert not [r for r in caplog.records if "librdkafka" in r.name or "kafka" in r.getMessage().lower()]
    bus.close()


# -- the Python API ------------------------------------------------------------------------------

def test_policy_feed_from_environment_finds_the_run_namespace(kafka_bootstrap, namespace, tmp_path):
    from logtools.subscribe import PolicyFeed

    publish_versions(kafka_bootstrap, namespace, 3)
    run = run_dir(tmp_path, namespace)
    env = Environment({"KAFKA_BROKERS": kafka_bootstrap})
    with PolicyFeed.from_environment(env, run_dir=run, from_version=1) as feed:
        got = [u.version for u in feed.updates(count=2, idle_timeout=60)]
    assert got == [1, 2]
    # RLSTREAM_NAMESPACE wins over the run directory, as on the command line
    other = Environment({"KAFKA_BROKERS": kafka_bootstrap, "RLSTREAM_NAMESPACE": namespace.name})
    with PolicyFeed.from_environment(other, run_dir=tmp_path / "nowhere", from_version=2) as feed:
        assert [u.version for u in feed.updates(count=1, idle_timeout=60)] == [2]


def test_policy_feed_from_environment_names_a_missing_broker(tmp_path):
    from logtools.subscribe import PolicyFeed

    address = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(NoBrokerError, match=f"no Kafka broker at {address}"):
        PolicyFeed.from_environment(Environment({"KAFKA_BROKERS": address}), run_dir=tmp_path, from_version=10)
    assert time.monotonic() - t0 < BROKER_WAIT_S + 3


# -- subscribe and replay against a namespaced run --------------------------------------------------

def test_subscribe_finds_the_namespace_from_the_run_directory(kafka_bootstrap, namespace, tmp_path):
    publish_versions(kafka_bootstrap, namespace, 3)
    run = run_dir(tmp_path, namespace, latest=True)

    def versions(p: subprocess.CompletedProcess) -> list[int]:
        assert p.returncode == 0, p.stderr[-3000:]
        return [json.loads(line)["version"] for line in p.stdout.splitlines()]

    as_documented = rlstream("subscribe", "policies", "--from-version", "0", "--count", "3", "--timeout", "20",
                             cwd=tmp_path, bootstrap=kafka_bootstrap)  # runs/latest is the run
    assert versions(as_documented) == [0, 1, 2]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    named = rlstream("subscribe", "policies", "--run-dir", str(run), "--from-version", "2", "--count", "1",
                     "--timeout", "20", cwd=elsewhere, bootstrap=kafka_bootstrap)
    assert versions(named) == [2]

    missing = f"none-{uuid.uuid4().hex[:8]}"
    wrong = rlstream("subscribe", "policies", "--namespace", missing, "--timeout", "20", cwd=elsewhere,
                     bootstrap=kafka_bootstrap)
    line = one_line_error(wrong, f"no topic {missing}.rl.policy.versions", "namespaces with rlstream topics there")
    assert namespace.name in line.split("there:", 1)[1]


def test_replay_reads_the_run_namespace_and_refuses_zero_pairs_in_one_line(kafka_bootstrap, namespace, tmp_path):
    from tests.rlstream.test_replay import sample_batch

    run = run_dir(tmp_path, namespace)
    before = rlstream("replay", "--train-dpo", "--run-dir", str(run), cwd=tmp_path, bootstrap=kafka_bootstrap)
    one_line_error(before, f"no topic {namespace.topic(SAMPLES_RAW)}")  # the run has not started: no topics yet
    publish_versions(kafka_bootstrap, namespace, 1)  # the run's topics exist, its samples topic is empty
    zero = rlstream("replay", "--train-dpo", "--run-dir", str(run), cwd=tmp_path, bootstrap=kafka_bootstrap)
    one_line_error(zero, "cannot train DPO on 0 preference pair(s)", f"namespace {namespace.name!r}")

    bus = open_bus(BusConfig(kind="kafka", bootstrap=kafka_bootstrap, namespace=namespace.name))
    try:
        events = event_bus(bus)
        rng, gen = np.random.default_rng(0), torch.Generator().manual_seed(0)
        policy = make_policy(0, 2, 1, hidden=(16, 16))
        for seq in range(3):
            b = sample_batch(policy, rng, gen, seq)
            events.publish(SAMPLES_RAW, b, key=b.actor_id)
        events.flush()
    finally:
        bus.close()
    replayed = rlstream("replay", "--run-dir", str(run), "--segment", "4", "--out", str(tmp_path / "dpo"),
                        cwd=tmp_path, bootstrap=kafka_bootstrap)
    assert replayed.returncode == 0, replayed.stderr[-3000:]
    summary = json.loads(replayed.stdout[replayed.stdout.index("{"): replayed.stdout.rindex("}") + 1])["summary"]
    assert summary["records"] == 3 and summary["batches"] == 3 and summary["pairs_built"] > 0, summary


def test_replay_of_a_namespace_the_broker_lacks_names_those_it_has(kafka_bootstrap, namespace, tmp_path):
    publish_versions(kafka_bootstrap, namespace, 1)
    missing = f"none-{uuid.uuid4().hex[:8]}"
    p = rlstream("replay", "--train-dpo", "--namespace", missing, cwd=tmp_path, bootstrap=kafka_bootstrap)
    line = one_line_error(p, f"no topic {missing}.rl.samples.raw", "namespaces with rlstream topics there")
    assert namespace.name in line


# -- rlstream lag ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tools():
    from tests.interop.jvm import kafka_tools_ready

    return kafka_tools_ready()


FAST_GROUP = {"heartbeat.interval.ms": 500, "session.timeout.ms": 6000}


def _rows(kafka_rows) -> set[tuple]:
    return {(r["TOPIC"], r["PARTITION"], r["CURRENT-OFFSET"], r["LOG-END-OFFSET"], r["LAG"], r["CONSUMER-ID"])
            for r in kafka_rows}


def _ours(group: dict) -> set[tuple]:
    return {(r["topic"], r["partition"], r["current_offset"], r["log_end_offset"], r["lag"], r["consumer_id"])
            for r in group["partitions"]}


def test_lag_agrees_with_kafka_consumer_groups_describe(kafka_bootstrap, namespace, tmp_path, tools):
    """The run's two groups: the stream processors' with a live member (a partition it was assigned
    but never committed shows no offset), and the learner's with none (an empty group)."""
    from streams.bus import in_namespace, kafka_bus

    raw = kafka_bus(BusConfig(kind="kafka", bootstrap=kafka_bootstrap))
    raw.consumer_config.update(FAST_GROUP)
    bus = in_namespace(raw, namespace.name)
    member = None
    try:
        bus.create_topics(all_topics(partitions=3))
        for p, n in ((0, 5), (1, 3), (2, 4)):
            for i in range(n):
                bus.produce(SAMPLES_RAW, f"r{i}".encode(), key=b"k", partition=p)
        for i in range(2):
            bus.produce(SAMPLES_PREPARED, f"p{i}".encode(), key=b"k", partition=0)
        bus.flush()
        with bus.consumer(LEARNER_GROUP, [SAMPLES_PREPARED]) as learner:
            got = wait_for(lambda: learner.poll(1.0), 60, "the learner group's records")
            learner.commit(offsets={(SAMPLES_PREPARED, 0): 1})
        assert got
        member = bus.consumer(STREAMS_GROUP, [SAMPLES_RAW])
        seen: list = []
        wait_for(lambda: seen.extend(member.poll(1.0)) or len(seen) >= 12, 60, "12 raw records")
        member.commit(offsets={(SAMPLES_RAW, 0): 5, (SAMPLES_RAW, 1): 1})
        run = run_dir(tmp_path, namespace)

        p = rlstream("lag", "--run-dir", str(run), "--json", cwd=tmp_path, bootstrap=kafka_bootstrap)
        assert p.returncode == 0, p.stderr[-3000:]
        report = {g["group"]: g for g in json.loads(p.stdout)["groups"]}
        streams, learner_group = namespace.group(STREAMS_GROUP), namespace.group(LEARNER_GROUP)
        assert list(report) == [streams, learner_group]
        for group in (streams, learner_group):
            theirs = tools.describe_group(kafka_bootstrap, group)
            print(theirs.text)
            assert _ours(report[group]) == _rows(theirs), (report[group], theirs.text)
        topic = namespace.topic(SAMPLES_RAW)
        by_partition = {r["partition"]: r for r in report[streams]["partitions"]}
        assert [(by_partition[i]["current_offset"], by_partition[i]["lag"]) for i in range(3)] == \
            [(5, 0), (1, 2), (None, None)]
        assert all(r["topic"] == topic and r["consumer_id"] for r in by_partition.values())
        assert report[streams]["lag"] == 2 and report[streams]["state"] == "stable"
        assert report[learner_group]["lag"] == 1 and report[learner_group]["members"] == 0

        table = rlstream("lag", "--namespace", namespace.name, "--group", "learner", cwd=tmp_path,
                         bootstrap=kafka_bootstrap)
        assert table.returncode == 0, table.stderr[-3000:]
        assert "CURRENT-OFFSET" in table.stdout and learner_group in table.stdout and streams not in table.stdout
        nope = rlstream("lag", "--namespace", namespace.name, "--group", "nope", cwd=tmp_path,
                        bootstrap=kafka_bootstrap)
        one_line_error(nope, "no consumer group 'nope'", streams)
    finally:
        if member is not None:
            member.close()
        bus.close()


def test_tools_read_the_namespace_file_decoupled_runs_write(tmp_path):
    from config.bus import NAMESPACE_FILE, run_namespace
    from runtime.rundir import RunDir

    assert NAMESPACE_FILE == RunDir(tmp_path).namespace_file.name
    (tmp_path / NAMESPACE_FILE).write_text("exp1\n")
    assert run_namespace(tmp_path) == "exp1" and run_namespace(tmp_path / "none") is None
    env = Environment({})
    assert BusConfig.from_environment(env, kind="kafka", run_dir=tmp_path).namespace == "exp1"
    assert BusConfig.from_environment(env, kind="kafka", run_dir=tmp_path, namespace="").namespace == ""
    assert BusConfig.from_environment(Environment({"RLSTREAM_NAMESPACE": "e2"}), run_dir=tmp_path).namespace == "e2"
