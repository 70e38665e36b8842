"""``rlstream train --mode decoupled`` supervises its children: SIGKILL the Faust worker mid-run
(a real signal to the real process) and the parent restarts it after a backoff; the run ends with
exit 0, the restart is in the progress lines and the summary, and no batch is trained twice.
The sample topics have 2 partitions (``--partitions 2``) and 2 actors write to them: each
actor's records sit on one partition, raw and prepared alike, in ``seq`` order."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from schemas.codec import Codec
from streams.bus.kafka import KafkaBus
from streams.topics import LEARNER_STEPS, Namespace

from .conftest import ENV_ID, FRAGMENT, Ledger, TopicCounter, check_acknowledged, check_trained_once, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
CODEC = Codec()
NS = Namespace("supervised")


def child_pid(marker: str) -> int | None:
    """The pid of the process whose command line holds ``marker`` (a path unique to this test)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker.encode() in cmd and b"faust" in cmd:
            return int(d.name)
    return None


def read_ledger(bootstrap: str) -> tuple[Ledger, dict[str, list[tuple[str, int, int]]]]:
    """The run's topics in its namespace, and per topic (actor_id, partition, seq) in log order."""
    ledger, placed = Ledger(), defaultdict(list)
    with KafkaBus(bootstrap, client_id="supervision-ledger", auto_create=False) as bus:
        for logical, into in (("rl.samples.raw", ledger.raw), ("rl.samples.prepared", ledger.prepared),
                              ("rl.learner.steps", ledger.steps), ("rl.policy.versions", ledger.versions),
                              ("rl.deadletter", ledger.dead)):
            for r in bus.read_all(NS.topic(logical)):
                ev = CODEC.decode(r.value)
                into.append(ev)
                if logical.startswith("rl.samples."):
                    b = getattr(ev, "sample", ev)
                    assert r.key == b.actor_id.encode(), "sample records are keyed by actor id"
                    placed[logical].append((b.actor_id, r.partition, b.seq))
    return ledger, placed


def start_decoupled(bootstrap: str, ns: Namespace, run_dir: Path, log: Path, *flags: str) -> subprocess.Popen:
    """``rlstream train --mode decoupled`` (PPO on ENV_ID, one env, FRAGMENT-step fragments, one
    epoch) in its own session, its output in ``log``; ``flags`` add to or override these."""
    env = {**os.environ, "KAFKA_BROKERS": bootstrap, "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1", "BROKER_SESSION_TIMEOUT": "6"}  # Faust's: a dead member leaves in 6 s
    env.pop("RLSTREAM_METRICS_PORT", None)
    cmd = [sys.executable, "-m", "rlstream.cli", "train", "--mode", "decoupled", "--bus", "kafka",
           "--bootstrap", bootstrap, "--namespace", ns.name, "--algo", "ppo", "--env", ENV_ID,
           "--num-envs", "1", "--fragment-steps", str(FRAGMENT), "--train-batch-size", str(2 * FRAGMENT),
           "--max-versions", "1000000", "--set", "update_epochs=1", "--set", "num_minibatches=1",
           "--run-dir", str(run_dir), "--log-every", "1", "--metrics-port", "-1", "--log-json", "--no-plot",
           "--tensorboard", "off", *flags]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def test_streams_sigkill_is_restarted_and_the_run_completes(private_kafka, tmp_path):
    run_dir = tmp_path / "run"
    parent = start_decoupled(private_kafka.bootstrap, NS, run_dir, tmp_path / "parent.log",
                             "--num-actors", "2", "--partitions", "2",
                             "--total-steps", str(10 * 2 * FRAGMENT))
    steps = TopicCounter(private_kafka.bootstrap, NS.topic(LEARNER_STEPS), CODEC.decode)
    marker = str(run_dir / "streams-data")

    def logs() -> str:
        return "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-3000:]}"
                         for p in [tmp_path / "parent.log", *sorted(run_dir.glob("*.log"))])
    try:
        wait_for(lambda: steps.poll() >= 2, 300, "2 updates before the kill", on_timeout=logs)
        first = child_pid(marker)
        assert first is not None
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: (child_pid(marker) or first) != first, 120, "a new Faust worker", on_timeout=logs)
        rc = parent.wait(timeout=600)
    finally:
        steps.close()
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
            parent.wait()
    text = (tmp_path / "parent.log").read_text()
    assert rc == 0, logs()
    summary = json.loads((run_dir / "summary.json").read_text())
    # the learner spent its budget, or trained all there was (an update may wait on a batch's
    # worth of samples that the actors' budgets do not fill)
    assert summary["restarts"] == {"streams": 1} and summary["ended"] in ("learner_done", "drained"), summary
    assert "role_restarting" in text
    assert any('"restarts": {"streams": 1}' in line for line in text.splitlines() if '"progress"' in line)

    ledger, placed = read_ledger(private_kafka.bootstrap)
    print("SUPERVISION ledger:", json.dumps(ledger.counts(), sort_keys=True), summary["processes"].get("learner"))
    counts = check_trained_once(ledger)  # every produced batch trained, none twice, versions monotonic
    # each actor's own account (its summary: the seqs the broker acknowledged) against the topic
    counts["actors"] = check_acknowledged(ledger, [summary["processes"][f"actor-{i}"] for i in range(2)])
    assert set(ledger.dead_reasons()) <= {"duplicate"}  # the restarted worker's copies, skipped
    for topic, rows in placed.items():
        by_actor = defaultdict(list)
        for actor, partition, seq in rows:
            by_actor[actor].append((partition, seq))
        assert set(by_actor) == {"actor-0", "actor-1"}, topic
        for actor, ps in by_actor.items():
            assert len({p for p, _ in ps}) == 1, f"{topic}: {actor} on several partitions"
            seqs = list(dict.fromkeys(s for _, s in ps))  # a restarted worker's copies repeat seqs
            assert seqs == sorted(seqs), f"{topic}: {actor} out of order {seqs}"
    print("SUPERVISION counts:", json.dumps(counts, sort_keys=True))
