"""Fault-injection fixtures: a private Kafka broker per test, and the training roles around it.

``private_kafka`` starts an ``localkafka.broker.LocalKafka`` of this test's own (never the shared
broker on 9092: these tests SIGKILL theirs) on free ports, with

* a PLAINTEXT listener (``bootstrap``) the roles use, and a SASL_PLAINTEXT/PLAIN listener
  (``sasl_bootstrap``) whose users are ``SASL_USERS``;
* ``group.min.session.timeout.ms`` lowered, so a test can give consumers short sessions.

A fresh broker per test costs ~5 s and isolates the tests completely: the roles use the real
topic and group names (``streams.topics``), so nothing is shared between tests.

``Rig`` runs the roles the way production does, each as a process of the real entry point
(``rlstream learner``, ``rlstream actor``, and either processor shell: ``faust -A streams
worker`` or the in-process one, ``python -m rlstream.entry worker``), so a fault is a real
signal to a real process (SIGKILL; SIGSTOP to hold one still at a chosen moment) or a stopped
broker; nothing inside a role is patched. ``Ledger`` reads the topics afterwards and does the
accounting.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from streams.topics import (
    DEADLETTER,
    LEARNER_STEPS,
    LEGACY,
    POLICY_VERSIONS,
    SAMPLES_PREPARED,
    SAMPLES_RAW,
    Namespace,
)
from tests.support import Role, free_ports, http_json, wait_for
from tests.support.kafka import committed

__all__ = ["Role", "wait_for"]

ENV_ID = "Pendulum-v1"  # obs 3, act 1: the cheapest continuous-control env gymnasium has
FRAGMENT = 32  # steps per SampleBatch (one env)
STREAMS_GROUP = "rlstream-streams"  # the Faust app id: the group the learner's breaker watches
# Consumers of the private broker (its group.min.session.timeout.ms is lowered): a rebalance in ~2 s.
FAST_CONSUMER = {"heartbeat.interval.ms": 300, "session.timeout.ms": 2000}
SASL_USERS = {"svc": "svc-secret", "admin": "admin-secret"}


@dataclass
class PrivateKafka:
    kafka: object  # localkafka.broker.LocalKafka
    bootstrap: str
    sasl_bootstrap: str
    users: dict[str, str]


def _jaas(users: dict[str, str]) -> str:
    # The broker's own login (username/password) is unused by a PLAINTEXT inter-broker listener,
    # but PlainLoginModule wants one; user_<name>="<password>" are the accounts clients may use.
    accounts = " ".join(f'user_{u}="{p}"' for u, p in users.items())
    return ('org.apache.kafka.common.security.plain.PlainLoginModule required '
            f'username="admin" password="{users["admin"]}" {accounts};')


@pytest.fixture
def private_kafka(tmp_path_factory):
    """A broker of this test's own (see the module docstring); skipped where none can start
    (no java / jars), failed instead when ``CI=true``."""
    from localkafka.broker import LocalKafka
    from localkafka.paths import BrokerError

    port, controller, sasl = free_ports(3)
    host = "127.0.0.1"
    extra = {
        "listeners": f"PLAINTEXT://{host}:{port},CONTROLLER://{host}:{controller},SASL_PLAINTEXT://{host}:{sasl}",
        "advertised.listeners": f"PLAINTEXT://{host}:{port},SASL_PLAINTEXT://{host}:{sasl}",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT",
        "sasl.enabled.mechanisms": "PLAIN",
        "listener.name.sasl_plaintext.plain.sasl.jaas.config": _jaas(SASL_USERS),
        "group.min.session.timeout.ms": 1000,
    }
    data = tmp_path_factory.mktemp("private-kafka")
    kafka = LocalKafka(port=port, controller_port=controller, data_dir=data, extra_properties=extra,
                       quiet=True, heap=("-Xms128m", "-Xmx512m"))
    try:
        kafka.start(timeout=180)
    except (BrokerError, OSError) as e:
        with contextlib.suppress(Exception):
            kafka.kill()
        msg = f"no private Kafka broker for the fault tests: {str(e).splitlines()[0]}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    try:
        yield PrivateKafka(kafka, kafka.bootstrap, f"{host}:{sasl}", dict(SASL_USERS))
    finally:
        kafka.kill()  # the data dir is thrown away: no need for a graceful stop


# --- roles -------------------------------------------------------------------------------------

#: The processor shells the rig can run, by name: the command after ``python``.
SHELL_CMDS = {"faust": ["-m", "faust", "-A", "streams", "--datadir", "{datadir}", "worker", "-l", "info",
                        "--web-port", "{port}"],
              "worker": ["-m", "rlstream.entry", "worker"]}


class StreamsProcesses:
    """The stream processors as processes of one shell (``SHELL_CMDS``), one at a time.
    ``crash`` SIGKILLs the running worker, which may have published prepared batches whose raw
    offsets it had not committed yet, and starts a replacement (a supervisor's restart): the
    replacement prepares those records again, unless the per-actor state it inherits (the Faust
    shell's table) marks them as duplicates. ``stats`` (``/healthz``) needs the Faust shell."""

    def __init__(self, rig: Rig, shell: str = "faust") -> None:
        if shell not in SHELL_CMDS:
            raise ValueError(f"shell {shell!r}: one of {sorted(SHELL_CMDS)}")
        self.rig = rig
        self.shell = shell
        self.workers: list[Role] = []
        self.crashes = 0
        self.port = 0
        self.summaries: list[dict] = []
        self._start()

    def _start(self) -> None:
        self.port = free_ports(1)[0]
        n = len(self.workers) + 1
        env = {**self.rig.env, "RLSTREAM_METRICS_PORT": str(self.port), "RLSTREAM_ALGO": "ppo",
               # a window no batch of these short runs can leave: every produced batch must be trained
               "RLSTREAM_STALENESS_K": "1000000", "RLSTREAM_STALENESS_MS": "none",
               # Faust's own setting: a SIGKILLed worker leaves the group in seconds, not 60 s
               "BROKER_SESSION_TIMEOUT": "6"}
        fill = {"datadir": str(self.rig.run_dir / f"streams-data-{n}"), "port": str(self.port)}
        cmd = self.rig.place(f"streams-{n}") + [sys.executable, *(a.format(**fill) for a in SHELL_CMDS[self.shell])]
        self.workers.append(Role(f"streams-{n}", cmd, self.rig.run_dir / f"streams.{n}.log", self.rig.env | env))
        self.rig.roles.append(self.workers[-1])

    @property
    def current(self) -> Role:
        return self.workers[-1]

    @property
    def alive(self) -> bool:
        return self.current.alive()

    @property
    def errors(self) -> list[str]:
        """What went wrong in the running worker: it exited, or it logged a traceback."""
        text = self.current.text()
        out = [] if self.alive else [f"{self.current.name} exited {self.current.proc.returncode}"]
        return out + ([self.current.tail(60)] if "Traceback" in text else [])

    def stats(self) -> dict:
        """The running worker's processor stats (``/healthz``)."""
        return http_json(f"http://127.0.0.1:{self.port}/healthz")["stats"]

    def crash(self) -> None:
        """SIGKILL the worker and start a fresh one."""
        self.current.kill()
        self.crashes += 1
        self._start()

    def crash_between_publish_and_commit(self, prepared: TopicCounter) -> None:
        """Freeze the worker (SIGSTOP) at a moment when it has published more prepared batches
        than its group has committed raw records (read with a plain client), so at least one
        output's input is uncommitted; SIGKILL it there and start a replacement."""
        def frozen_with_uncommitted_output() -> bool:
            self.current.pause()
            done = sum(max(o, 0) for o in committed(self.rig.bootstrap, STREAMS_GROUP, SAMPLES_RAW).values())
            prepared.poll()
            if len({p.sample.batch_id for p in prepared.items}) > done:
                return True
            self.current.resume()
            return False

        wait_for(frozen_with_uncommitted_output, 120, "a prepared batch whose raw record is uncommitted",
                 every=0.2, on_timeout=self.rig.logs)
        self.crash()

    def stop(self) -> dict:
        """SIGTERM the running worker; its summary (the processors' stats)."""
        if not self.alive:
            return {}
        summary = self.current.stop(60)
        self.summaries.append(summary)
        return summary


class Rig:
    """Learner, actor and stream processor processes on the broker ``bootstrap``.

    ``place(name)``: the command prefix that runs role ``name`` (``learner``, ``actor-<i>``,
    ``streams-<n>``) where it should run, e.g. ``ip netns exec NS`` for a simulated host
    (``tests/hosts``); by default none, so every role runs here. ``total_steps`` is the learner's
    budget and, split over ``num_actors``, the actors'; ``args`` go to every role."""

    def __init__(self, bootstrap: str, run_dir: Path, *, snapshot_every: int = 3,
                 train_batch_size: int = FRAGMENT, place: Callable[[str], list[str]] | None = None,
                 total_steps: int = 10**9, num_actors: int = 1, args: tuple[str, ...] = ()) -> None:
        self.bootstrap = bootstrap
        self.run_dir = run_dir
        self.snapshot_every = snapshot_every
        self.train_batch_size = train_batch_size
        self.place = place or (lambda name: [])
        self.total_steps = total_steps
        self.num_actors = num_actors
        self.args = tuple(args)
        self.env = {**os.environ, "KAFKA_BROKERS": bootstrap, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                    "PYTHONUNBUFFERED": "1"}
        self.env.pop("RLSTREAM_METRICS_PORT", None)
        self.roles: list[Role] = []
        self.streams: StreamsProcesses | None = None
        self._n = Counter()

    def _cmd(self, role: str, *extra: str) -> list[str]:
        return [sys.executable, "-m", "rlstream.cli", role, "--bus", "kafka", "--bootstrap", self.bootstrap,
                "--algo", "ppo", "--env", ENV_ID, "--total-steps", str(self.total_steps),
                "--num-actors", str(self.num_actors),
                "--train-batch-size", str(self.train_batch_size), "--fragment-steps", str(FRAGMENT),
                "--num-envs", "1", "--snapshot-every", str(self.snapshot_every),
                "--run-dir", str(self.run_dir), "--metrics-port", "-1", "--log-json", "--log-every", "1",
                "--set", "update_epochs=1", "--set", "num_minibatches=1", *self.args, *extra]

    def _spawn(self, name: str, cmd: list[str]) -> Role:
        self._n[name] += 1
        role = Role(name, self.place(name) + cmd, self.run_dir / f"{name}.{self._n[name]}.log", self.env)
        self.roles.append(role)
        return role

    def learner(self, resume: bool = False, *extra: str) -> Role:
        return self._spawn("learner", self._cmd("learner", *(["--resume"] if resume else []), *extra))

    def actor(self, index: int = 0, *extra: str) -> Role:
        return self._spawn(f"actor-{index}", self._cmd("actor", "--index", str(index), *extra))

    def start_streams(self, shell: str = "faust") -> StreamsProcesses:
        """The stream processors of ``shell`` (``SHELL_CMDS``), as a process."""
        self.streams = StreamsProcesses(self, shell)
        return self.streams

    def start_faust(self) -> StreamsProcesses:
        """The Faust worker production runs, as a process."""
        return self.start_streams("faust")

    def close(self) -> None:
        for r in self.roles:
            if r.alive():
                r.kill()

    def logs(self) -> str:
        return "\n".join(f"--- {r.log.name} ---\n{r.tail()}" for r in self.roles)


@pytest.fixture
def rig(private_kafka, tmp_path):
    r = Rig(private_kafka.bootstrap, tmp_path)
    yield r
    r.close()


# --- reading the outcome -------------------------------------------------------------------------

@dataclass
class Ledger:
    """What the topics say happened (read with a fresh bus)."""

    raw: list = field(default_factory=list)  # SampleBatch, in log order
    prepared: list = field(default_factory=list)  # PreparedBatch
    steps: list = field(default_factory=list)  # GradientStep
    versions: list = field(default_factory=list)  # PolicyVersion, in log order
    dead: list = field(default_factory=list)  # DeadLetter

    placed: dict = field(default_factory=dict)  # batch_id -> (partition, offset) of its first PreparedBatch

    @classmethod
    def read(cls, bootstrap: str, namespace: Namespace = LEGACY) -> Ledger:
        """The run's topics (in ``namespace``), read from the start."""
        from schemas.codec import Codec
        from streams.bus.kafka import KafkaBus

        codec = Codec()
        out = cls()
        with KafkaBus(bootstrap, client_id="faults-ledger", auto_create=False) as bus:
            for topic, into in ((SAMPLES_RAW, out.raw), (SAMPLES_PREPARED, out.prepared),
                                (LEARNER_STEPS, out.steps), (POLICY_VERSIONS, out.versions),
                                (DEADLETTER, out.dead)):
                for r in bus.read_all(namespace.topic(topic)):
                    event = codec.decode(r.value)
                    into.append(event)
                    if topic == SAMPLES_PREPARED:
                        out.placed.setdefault(event.sample.batch_id, (r.partition, r.offset))
        return out

    @property
    def produced_ids(self) -> list[str]:
        return [b.batch_id for b in self.raw]

    @property
    def trained_ids(self) -> list[str]:
        return [bid for s in self.steps for bid in s.batch_ids]

    def duplicates_trained(self) -> dict[str, int]:
        return {b: n for b, n in Counter(self.trained_ids).items() if n > 1}

    def dead_reasons(self) -> Counter:
        return Counter(d.reason for d in self.dead)

    def counts(self) -> dict:
        trained = set(self.trained_ids)
        produced = set(self.produced_ids)
        return {"produced": len(self.raw), "produced_unique": len(produced), "prepared": len(self.prepared),
                "prepared_unique": len({p.sample.batch_id for p in self.prepared}),
                "gradient_steps": len(self.steps), "trained": len(self.trained_ids),
                "trained_unique": len(trained), "duplicates_trained": len(self.duplicates_trained()),
                "duplicates_skipped": self.dead_reasons().get("duplicate", 0),
                "lost": len(produced - trained), "versions": len(self.versions),
                "dead_letters": dict(self.dead_reasons())}


def check_trained_once(ledger: Ledger) -> dict:
    """The run's accounting, after asserting: every committed SampleBatch was trained, none
    twice, nothing trained that was not produced, versions strictly increasing in the log."""
    counts = ledger.counts()
    produced, trained = set(ledger.produced_ids), set(ledger.trained_ids)
    assert len(produced) == len(ledger.raw), "an actor published a batch_id twice"
    assert ledger.duplicates_trained() == {}, f"trained twice: {ledger.duplicates_trained()}"
    assert produced - trained == set(), f"{len(produced - trained)} committed batches never trained"
    assert trained - produced == set(), "trained on batches that are not in rl.samples.raw"
    versions = [v.version for v in ledger.versions]
    assert versions == sorted(set(versions)), f"versions not strictly increasing: {versions}"
    return counts


def check_acknowledged(ledger: Ledger, actor_summaries: list[dict], trained_once: bool | None = True,
                       since_ms: int = 0) -> dict:
    """The actors' side of the ledger, after asserting it: each actor (that exited by itself,
    with its summary) heard the bus acknowledge every batch it published, seqs 0.. without a gap,
    none failed or unsettled (``actor.actor.Acknowledgements``); the samples topic holds exactly
    those, once each; and every one of them was trained exactly once (``trained_once`` False: at
    least once, where the test itself causes retraining; None: not checked here, where the test
    accounts for batches left untrained itself). "Produced" so means what the actors were
    acknowledged, not only what reached the topic. ``since_ms``: only batches created since then
    (a broker that also holds an earlier run's batches under the same actor ids)."""
    raw = Counter((b.actor_id, b.seq) for b in ledger.raw if b.created_at_ms >= since_ms)
    assert all(n == 1 for n in raw.values()), f"a (actor, seq) twice in the topic: {[k for k, n in raw.items() if n > 1]}"
    trained = Counter(ledger.trained_ids)
    seq_of = {b.batch_id: (b.actor_id, b.seq) for b in ledger.raw if b.created_at_ms >= since_ms}
    trained_seqs = Counter(seq_of[b] for b in trained if b in seq_of)
    out: dict = {}
    for s in actor_summaries:
        who = s.get("actor_id")
        assert "acknowledged_seqs" in s, f"actor {who} reported no acknowledgements: {sorted(s)}"
        acked = {q for first, last in s["acknowledged_seqs"] for q in range(first, last + 1)}
        assert len(acked) == s["acknowledged"], s
        in_topic = {q for (a, q) in raw if a == who}
        row = {"published": s["seq"], "acknowledged": len(acked), "unacknowledged": s["unacknowledged"],
               "delivery_failed": len(s["delivery_failed"]), "in_topic": len(in_topic),
               "trained": sum(n for (a, _), n in trained_seqs.items() if a == who),
               "acknowledged_not_in_topic": sorted(acked - in_topic),
               "in_topic_not_acknowledged": sorted(in_topic - acked),
               "acknowledged_not_trained": sorted(q for q in acked if trained_seqs[(who, q)] < 1
                                                  or (trained_once and trained_seqs[(who, q)] > 1))}
        out[who] = row
        assert s["unacknowledged"] == 0 and s["delivery_failed"] == {}, (who, row, s["delivery_failed"])
        assert acked == set(range(s["seq"])), f"{who}: acknowledged seqs with a gap: {s['acknowledged_seqs']}"
        assert row["acknowledged_not_in_topic"] == [] and row["in_topic_not_acknowledged"] == [], (who, row)
        if trained_once is None:
            row.pop("acknowledged_not_trained")
        else:
            assert row["acknowledged_not_trained"] == [], (who, row)
    return out


def all_trained(raw: TopicCounter, steps: TopicCounter) -> bool:
    """Has every SampleBatch seen so far appeared in some GradientStep?"""
    raw.poll()
    steps.poll()
    trained = {i for s in steps.items for i in s.batch_ids}
    return all(b.batch_id in trained for b in raw.items)


class TopicCounter:
    """Counts records of a topic as they arrive (cheap progress checks while roles run)."""

    def __init__(self, bootstrap: str, topic: str, decode=None) -> None:
        from streams.bus.kafka import KafkaBus

        self.bus = KafkaBus(bootstrap, client_id="faults-progress")
        self.consumer = self.bus.consumer(None, [topic], start="earliest")
        self.decode = decode
        self.items: list = []

    def poll(self) -> int:
        with contextlib.suppress(Exception):  # the broker may be down right now
            for r in self.consumer.poll(0.2, max_records=1000):
                self.items.append(self.decode(r.value) if self.decode else r)
        return len(self.items)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.consumer.close()
            self.bus.close(timeout=5)
