"""A decoupled run on a local 3-broker KRaft cluster loses brokers and carries on (issue 24, part 1).

The cluster is started the way a user starts one, ``rlstream broker start --nodes 3`` (on free
ports, its own data dir; ``localkafka.cluster.LocalCluster`` drives it afterwards), once for the
module. Every run has its own namespace, with its topics at replication factor 3 and
``min.insync.replicas`` 2 (``RLSTREAM_REPLICATION_FACTOR`` / ``RLSTREAM_MIN_INSYNC_REPLICAS`` in every
role's environment: the one setting), and producers at ``acks=all`` with idempotence. The roles
are the processes production runs (``conftest.Rig``: ``rlstream learner``, ``rlstream actor``,
``faust -A streams worker``). Faults, each in the middle of a run:

* the leader of the samples topic's partition is SIGKILLed, and started again later; so, each in
  its own run, the leader of the policy-versions partition, the leader of the learner-steps
  partition, and the learner group's coordinator (``describe_consumer_groups``);
* the active controller (the KRaft quorum's leader, as ``kafka-metadata-quorum`` reports it) is
  SIGKILLed, and started again later;
* two nodes of three are SIGKILLed at once (below ``min.insync.replicas`` and, every node being a
  voter, below the controller quorum): the actor backs off in its flush, nothing is
  acknowledged meanwhile, and once one node is back the run goes on (docs/explanation/guarantees.md).
  With the quorum kept (a dedicated controller) the same loss is NOT_ENOUGH_REPLICAS from the
  surviving leader: ``test_below_min_insync.py``, on this module's helpers;
* every broker in turn is stopped (controlled shutdown), started again and waited for until
  every partition is back in sync: a rolling restart.

Each run is judged from its topics and the actor's own account by a ledger: what the broker
acknowledged to the actor (its summary's ``acknowledged_seqs``) is exactly what the samples topic
holds, each trained once (``conftest.check_acknowledged``); produced = trained + dropped with a reason +
dead-lettered + left untrained at the learner group's committed offset; nothing trained twice;
versions strictly increasing; every role exits 0 when told to stop; and the learner published
updates while the fault lasted (the run did not stop for it). Each ledger is printed
(``CLUSTER <fault> ledger: {...}``). Every node and role is ended, pass or fail (the fixtures,
then the reaper)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import time
import uuid
from collections import Counter

import pytest

from config import BusConfig, Environment
from config.bus import Replication
from schemas.codec import Codec
from streams.topics import LEARNER_GROUP, LEARNER_STEPS, POLICY_VERSIONS, SAMPLES_PREPARED, SAMPLES_RAW, Namespace
from tests.support.kafka import committed
from testbed.ports import free_port
from tests.support.reaper import ENV as REAPER_MARK, mark_as

from .conftest import FRAGMENT, Ledger, Rig, TopicCounter, check_acknowledged, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
CODEC = Codec()
NODES = 3
REPLICATION = {"RLSTREAM_REPLICATION_FACTOR": "3", "RLSTREAM_MIN_INSYNC_REPLICAS": "2"}
STARTUP_S = 240  # roles import torch and Faust; a broker's JVM starts: generous on 2 busy cores


def contiguous_free_ports(n: int) -> int:
    """A port p with p .. p+n-1 free on 127.0.0.1 (the CLI puts node i on p+2i and p+2i+1)."""
    from localkafka.probe import port_is_free

    for _ in range(200):
        base = free_port()
        if base + n < 65535 and all(port_is_free(base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no {n} contiguous free ports on 127.0.0.1")


def _unavailable(msg: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A 3-node cluster started with ``rlstream broker start --nodes 3``; SIGKILLed at the end."""
    with cli_cluster(tmp_path_factory) as c:
        yield c


@contextlib.contextmanager
def cli_cluster(tmp_path_factory, controllers: int = 0):
    """``rlstream broker start --nodes 3`` (with ``--controllers K``: 3 brokers beside K
    controller-only nodes) on free ports, as a ``LocalCluster``; every node SIGKILLed at the end."""
    from localkafka.paths import BrokerError
    from localkafka.cluster import LocalCluster

    data = tmp_path_factory.mktemp("cluster")
    port = contiguous_free_ports(2 * NODES + controllers)
    env = {**os.environ, "RLSTREAM_KAFKA_JAVA_OPTS": "-Xms128m -Xmx512m"}
    cmd = [sys.executable, "-m", "rlstream.cli", "broker", "start", "--nodes", str(NODES), "--port", str(port),
           "--data-dir", str(data), "--timeout", str(STARTUP_S), *(["--controllers", str(controllers)] if controllers else [])]
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=STARTUP_S + 60)
    started = time.monotonic() - t0
    try:
        c = LocalCluster.open(data, quiet=True)
    except BrokerError as e:
        _unavailable(f"no local Kafka cluster: {e}; {res.stderr[-2000:]}")
    c.mark = os.environ.get(REAPER_MARK)  # the module's processes' mark (set up under the session's)
    try:
        if res.returncode != 0:
            _unavailable(f"rlstream broker start --nodes {NODES} --controllers {controllers} exited "
                         f"{res.returncode}: {res.stderr[-2000:]}")
        assert res.stdout.strip() == c.bootstrap, res.stdout
        print(f"CLUSTER started with the CLI in {started:.1f}s: {c.bootstrap}")
        yield c
    finally:
        c.close()


def start_node(cluster, node: int) -> None:
    """Start a stopped node again as a process of the module's cluster, not of the test that
    restarts it (the reaper ends a test's processes with the test; the cluster outlives it)."""
    with mark_as(cluster.mark):
        cluster.start_node(node, timeout=STARTUP_S)


@pytest.fixture
def healthy(cluster):
    """The cluster with every node running and every partition in sync, before and after the test."""
    def heal() -> None:
        for i in cluster.nodes:
            if not cluster.node(i).is_running():
                start_node(cluster, i)
        cluster.wait_in_sync(STARTUP_S)

    heal()
    yield cluster
    heal()


@pytest.fixture
def run(healthy, tmp_path):
    """A Rig on the cluster in a namespace of its own, the replication setting in every role's
    environment, and the run's topics created at that replication."""
    from streams.bus import open_bus

    ns = Namespace(f"cluster-{uuid.uuid4().hex[:6]}")
    rig = Rig(healthy.bootstrap, tmp_path)
    rig.env.update(REPLICATION, RLSTREAM_NAMESPACE=ns.name)
    bus = open_bus(BusConfig.from_environment(Environment(rig.env), kind="kafka"))
    bus.close()
    healthy.wait_in_sync(60, [ns.topic(t) for t in (SAMPLES_RAW, SAMPLES_PREPARED)])
    try:
        yield rig, ns
    finally:
        rig.close()


# --- the ledger -------------------------------------------------------------------------------------

def account(bootstrap: str, ns: Namespace, streams_summaries: list[dict], actor_summaries: list[dict]) -> dict:
    """The run's ledger from its topics and the actors' own accounts, after asserting what must
    hold (module docstring)."""
    ledger = Ledger.read(bootstrap, ns)
    actors = check_acknowledged(ledger, actor_summaries)  # acknowledged = in the topic = trained once
    size = {b.batch_id: b.num_steps for b in ledger.raw}
    produced = [b.batch_id for b in ledger.raw]
    assert len(produced) == len(set(produced)), "an actor published a batch id twice"
    trained = ledger.trained_ids
    assert ledger.duplicates_trained() == {}, f"trained twice: {ledger.duplicates_trained()}"
    assert set(trained) <= set(produced), "trained on batches that are not in rl.samples.raw"
    versions = [v.version for v in ledger.versions]
    assert versions == sorted(set(versions)), f"versions not strictly increasing: {versions}"
    reasons = ledger.dead_reasons()
    # "duplicate": a second copy of a batch already prepared (an input redelivered after a fault),
    # skipped by batch id; any other reason is a produced batch dead-lettered
    dead_lettered = {r: n for r, n in reasons.items() if r != "duplicate"}
    dropped = Counter()
    for summary in streams_summaries:
        dropped.update(summary.get("dropped_samples", {}))
    dropped.pop("duplicate", None)
    commits = committed(bootstrap, ns.group(LEARNER_GROUP), ns.topic(SAMPLES_PREPARED))
    untrained = set(produced) - set(trained)
    left = {b for b in untrained if b in ledger.placed
            and ledger.placed[b][1] >= max(commits.get(ledger.placed[b][0], 0), 0)}
    behind = {b for b in untrained if b in ledger.placed} - left
    assert behind == set(), f"prepared, committed by the learner group, yet never trained: {sorted(behind)}"
    never_prepared = untrained - set(ledger.placed)
    dropped_batches = sum(dropped.values()) // FRAGMENT
    out = {"produced": len(produced), "actor_acknowledged": sum(a["acknowledged"] for a in actors.values()),
           "actors": actors, "trained": len(trained), "dropped": dict(dropped),
           "dead_lettered": dead_lettered, "left_untrained": len(left),
           "duplicate_copies_skipped": reasons.get("duplicate", 0), "updates": len(ledger.steps),
           "versions": len(versions), "samples_trained": sum(size[b] for b in trained)}
    # produced = trained + dropped + dead-lettered + left untrained (in batches)
    assert len(never_prepared) == dropped_batches + sum(dead_lettered.values()), out
    assert len(produced) == len(trained) + dropped_batches + sum(dead_lettered.values()) + len(left), out
    return out


def check_replicated(cluster, ns: Namespace) -> None:
    """The run's sample topics: 3 copies of every partition, all in sync."""
    for topic, parts in cluster.describe([ns.topic(SAMPLES_RAW), ns.topic(SAMPLES_PREPARED)]).items():
        for p in parts:
            assert p["replicas"] == cluster.broker_ids == p["isr"], (topic, p)


def decoupled_run_through(cluster, rig: Rig, ns: Namespace, name: str, fault, actor_args: tuple[str, ...] = ()) -> dict:
    """Learner, Faust worker and one actor (with ``actor_args``) on the cluster; ``fault(steps,
    updates, actor)`` once 3 updates are out (it returns what it did, with ``updates_during_fault``
    counted by itself), then 2 more updates, a graceful stop of every role (each must exit 0) and
    the ledger (with the actor's summary's ``backoff`` and ``produce_errors``)."""
    started = time.monotonic()
    steps = TopicCounter(rig.bootstrap, ns.topic(LEARNER_STEPS), CODEC.decode)
    raw = TopicCounter(rig.bootstrap, ns.topic(SAMPLES_RAW), CODEC.decode)
    try:
        streams = rig.start_faust()
        learner = rig.learner()
        actor = rig.actor(0, *actor_args)
        roles = lambda: [learner, actor, streams.current]  # noqa: E731

        def alive() -> None:  # fails at once, with the logs, if a role died of the fault
            dead = [r.name for r in roles() if not r.alive()]
            assert not dead, f"{dead} exited:\n{rig.logs()}"

        def updates(n: int):
            def enough() -> bool:
                alive()
                return steps.poll() >= n
            return enough

        wait_for(updates(3), STARTUP_S, "3 updates before the fault", every=0.2, on_timeout=rig.logs)
        t0 = time.monotonic()
        did = fault(steps, updates, actor)
        did["fault_s"] = round(time.monotonic() - t0, 1)
        after = steps.poll()
        wait_for(updates(after + 2), 180, "2 updates after the fault", every=0.2, on_timeout=rig.logs)
        alive()

        actor_summary = actor.stop(60)
        wait_for(lambda: _all_trained(raw, steps), 180, "every produced batch trained", on_timeout=rig.logs)
        learner_summary = learner.stop(60)
        streams_summary = streams.stop()
        codes = {r.name: r.proc.returncode for r in roles()}
        assert codes == {r.name: 0 for r in roles()}, f"exit codes {codes}:\n{rig.logs()}"
        assert "Traceback" not in streams.current.text(), streams.current.tail(80)
    finally:
        steps.close()
        raw.close()
    check_replicated(cluster, ns)
    ledger = account(rig.bootstrap, ns, streams.summaries, [actor_summary])
    ledger.update(did, actor_backoff=actor_summary.get("backoff"), actor_produce_errors=actor_summary.get("produce_errors"),
                  learner_duplicates_skipped=learner_summary.get("duplicates_skipped"),
                  exit_codes=codes, run_s=round(time.monotonic() - started, 1))
    print(f"CLUSTER {name} ledger:", json.dumps(ledger, sort_keys=True))
    assert ledger["updates_during_fault"] >= 1, "the run stopped training during the fault"
    return ledger


def _all_trained(raw: TopicCounter, steps: TopicCounter) -> bool:
    raw.poll()
    steps.poll()
    trained = {i for s in steps.items for i in s.batch_ids}
    return bool(raw.items) and all(b.batch_id in trained for b in raw.items)


# --- the tests --------------------------------------------------------------------------------------

def sigkill_and_restart(cluster, rig, steps, updates, node: int, what: str, successor) -> dict:
    """SIGKILL ``node`` (``what`` it is) mid-run, wait for ``successor()`` (the node that took
    over) and for training to go on without it, then restart it and wait until every partition
    is in sync again; the fault's row of the ledger."""
    before = steps.poll()
    killed = time.monotonic()
    cluster.kill(node)
    new = successor()
    wait_for(updates(before + 2), 180, f"training while node {node} is down", every=0.2, on_timeout=rig.logs)
    two_updates_s = round(time.monotonic() - killed, 1)
    down = steps.poll() - before
    start_node(cluster, node)
    cluster.wait_in_sync(STARTUP_S)
    return {"fault": f"SIGKILL of node {node}, {what}; {new} took over",
            "updates_while_down": down, "updates_during_fault": steps.poll() - before,
            "kill_to_two_updates_s": two_updates_s}


def test_the_cli_cluster_holds_replication_3_and_refuses_more(healthy, tmp_path):
    """``rlstream broker status`` finds the cluster by itself; topics made from the setting have 3
    copies and ``min.insync.replicas`` 2; a factor of 4 is refused before any topic is asked for."""
    from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

    from streams.bus import ReplicationError, open_bus

    res = subprocess.run([sys.executable, "-m", "rlstream.cli", "broker", "status", "--data-dir",
                          str(healthy.data_dir), "--port", str(healthy.ports[0][0])],
                         capture_output=True, text=True, timeout=120)
    status = json.loads(res.stdout)
    assert status["nodes"] == NODES and status["bootstrap"] == healthy.bootstrap
    assert [(m["node_id"], m["running"], m["ready"]) for m in status["members"]] == \
        [(i, True, True) for i in range(1, NODES + 1)]
    assert healthy.brokers() == [1, 2, 3] and healthy.controller() in (1, 2, 3)

    ns = Namespace(f"repl-{uuid.uuid4().hex[:6]}")
    cfg = BusConfig.from_environment(Environment({**REPLICATION, "KAFKA_BROKERS": healthy.bootstrap}),
                                     kind="kafka", namespace=ns.name)
    assert cfg.replication == Replication(3, 2)
    open_bus(cfg).close()
    made = [t.name for t in ns.topics()]
    described = healthy.describe(made)
    assert {len(p["replicas"]) for parts in described.values() for p in parts} == {3}
    admin = AdminClient({"bootstrap.servers": healthy.bootstrap})
    for res_, fut in admin.describe_configs([ConfigResource(ResourceType.TOPIC, t) for t in made]).items():
        assert fut.result(timeout=30)["min.insync.replicas"].value == "2", res_.name
    # the cluster's own internal topics follow its size too (a group's first lookup makes this one)
    committed(healthy.bootstrap, ns.group(LEARNER_GROUP), made[0])
    offsets = wait_for(lambda: healthy.describe(["__consumer_offsets"], timeout=5)["__consumer_offsets"], 60,
                       "the consumer offsets topic", ignore=(Exception,))
    assert all(len(p["replicas"]) == 3 for p in offsets)

    too_many = Namespace(f"repl-{uuid.uuid4().hex[:6]}")
    with pytest.raises(ReplicationError, match=r"RLSTREAM_REPLICATION_FACTOR=4 asks for 4 copies .* has 3 brokers alive"):
        open_bus(BusConfig(kind="kafka", bootstrap=healthy.bootstrap, namespace=too_many.name,
                           replication=Replication(4, 2)))
    assert not any(t.startswith(too_many.name) for t in admin.list_topics(timeout=30).topics)


def test_sigkill_of_the_samples_partition_leader_mid_run(healthy, run):
    rig, ns = run
    topic = ns.topic(SAMPLES_RAW)

    def kill_the_leader(steps, updates, actor) -> dict:
        def new_leader() -> int:
            wait_for(lambda: healthy.leader(topic, 0) not in (leader, -1), 60, "a new leader of " + topic)
            return healthy.leader(topic, 0)

        leader = healthy.leader(topic, 0)
        return sigkill_and_restart(healthy, rig, steps, updates, leader, f"leader of {topic}[0]", new_leader)

    decoupled_run_through(healthy, rig, ns, "leader-sigkill", kill_the_leader)


def test_sigkill_of_the_active_controller_mid_run(healthy, run):
    rig, ns = run

    def kill_the_controller(steps, updates, actor) -> dict:
        controller = healthy.controller()
        return sigkill_and_restart(
            healthy, rig, steps, updates, controller, "the active controller",
            lambda: wait_for(lambda: (c := healthy.controller()) != controller and c > 0 and c, 120,
                             "a new active controller", every=0.5, ignore=(Exception,)))

    decoupled_run_through(healthy, rig, ns, "controller-sigkill", kill_the_controller)


def test_rolling_restart_of_every_broker_mid_run(healthy, run):
    rig, ns = run

    def roll(steps, updates, actor) -> dict:
        before = steps.poll()
        per_node = {}
        for node in sorted(healthy.nodes):
            at = steps.poll()
            t0 = time.monotonic()
            healthy.stop(node)  # controlled shutdown: leadership moves away first
            wait_for(updates(at + 1), 180, f"training while node {node} is stopped", every=0.2, on_timeout=rig.logs)
            start_node(healthy, node)
            healthy.wait_in_sync(STARTUP_S)  # before the next one goes down
            per_node[node] = {"updates": steps.poll() - at, "s": round(time.monotonic() - t0, 1)}
        return {"fault": "rolling restart: each node stopped, started, in sync, in turn",
                "per_node": per_node, "updates_during_fault": steps.poll() - before}

    decoupled_run_through(healthy, rig, ns, "rolling-restart", roll)



def coordinator(cluster, group: str) -> int:
    """The node id of ``group``'s coordinator, as the admin API's describe_consumer_groups says."""
    from confluent_kafka.admin import AdminClient

    # (librdkafka's lines about the dead node go to logging, as the roles' do, not to stderr)
    admin = AdminClient({"bootstrap.servers": cluster.bootstrap, "logger": logging.getLogger("faults.admin")})
    return admin.describe_consumer_groups([group], request_timeout=5)[group].result(timeout=10).coordinator.id


def test_sigkill_of_the_learner_groups_coordinator_mid_run(healthy, run):
    rig, ns = run
    group = ns.group(LEARNER_GROUP)

    def kill_the_coordinator(steps, updates, actor) -> dict:
        node = coordinator(healthy, group)
        return sigkill_and_restart(
            healthy, rig, steps, updates, node, f"coordinator of the learner group {group}",
            lambda: wait_for(lambda: (c := coordinator(healthy, group)) not in (node, -1) and c, 120,
                             f"a new coordinator of {group}", every=0.5, ignore=(Exception,)))

    decoupled_run_through(healthy, rig, ns, "coordinator-sigkill", kill_the_coordinator)


@pytest.mark.parametrize("name", [POLICY_VERSIONS, LEARNER_STEPS], ids=["policy-versions", "learner-steps"])
def test_sigkill_of_the_learners_output_partition_leader_mid_run(healthy, run, name, request):
    """The leader of the partition the learner publishes its versions (or its steps) to."""
    rig, ns = run
    topic = ns.topic(name)

    def kill_the_leader(steps, updates, actor) -> dict:
        def new_leader() -> int:
            wait_for(lambda: healthy.leader(topic, 0) not in (leader, -1), 60, "a new leader of " + topic,
                     ignore=(Exception,))
            return healthy.leader(topic, 0)

        leader = healthy.leader(topic, 0)
        return sigkill_and_restart(healthy, rig, steps, updates, leader, f"leader of {topic}[0]", new_leader)

    decoupled_run_through(healthy, rig, ns, f"{request.node.callspec.id}-leader-sigkill", kill_the_leader)


#: What an actor logs when its flush finds records undelivered (``KafkaBus.flush``): it waits on.
BACKOFF_LINE = "not delivered within"


def test_two_of_three_nodes_down_below_min_insync_mid_run(healthy, run):
    """Below ``min.insync.replicas`` (2) and below the KRaft quorum (every node is a voter here):
    two of the three nodes are SIGKILLed, the leader of the samples partition kept. Its ISR cannot
    shrink without a controller, so ``acks=all`` produces wait for replicas that are gone and
    time out; nothing more is acknowledged (the controller-quorum loss; with the quorum kept the
    broker answers NOT_ENOUGH_REPLICAS instead: ``test_below_min_insync.py``). The actor must back off (its flush waits, saying so
    in its log) and live; once one node is back (quorum and two in-sync copies again) training
    goes on, then the third returns, and the ledger is whole."""
    rig, ns = run
    topic = ns.topic(SAMPLES_RAW)
    raw = TopicCounter(rig.bootstrap, topic, CODEC.decode)

    def below_quorum(steps, updates, actor) -> dict:
        keep = healthy.leader(topic, 0)
        first, second = [n for n in sorted(healthy.nodes) if n != keep]
        before, size = steps.poll(), actor.log.stat().st_size
        raw.poll()
        killed = time.monotonic()
        healthy.kill(first)
        healthy.kill(second)

        def backing_off() -> bool:  # the actor waits on its undelivered batch, and says so
            assert actor.alive(), rig.logs()
            with actor.log.open("rb") as f:
                f.seek(size)
                return BACKOFF_LINE.encode() in f.read()

        wait_for(backing_off, 120, "the actor to log that it waits on undelivered batches", every=0.5,
                 on_timeout=rig.logs)
        backoff_s = round(time.monotonic() - killed, 1)
        raw_before = len(raw.items)
        raw.poll()
        down = {"updates": steps.poll() - before, "raw_records": len(raw.items) - raw_before}
        start_node(healthy, first)  # two nodes of three: a quorum, and 2 in-sync copies possible
        wait_for(updates(before + 2), 240, "training with two nodes of three", every=0.2, on_timeout=rig.logs)
        recovered_s = round(time.monotonic() - killed, 1)
        start_node(healthy, second)
        healthy.wait_in_sync(STARTUP_S)
        with actor.log.open("rb") as f:
            f.seek(size)
            said = f.read().decode(errors="replace")
        return {"fault": f"SIGKILL of nodes {first} and {second} (2 of 3: below min.insync.replicas and "
                         f"the KRaft quorum), node {keep} (leader of {topic}[0]) kept; node {first} "
                         f"restarted once the actor backed off, then node {second}",
                "kill_to_actor_backoff_s": backoff_s, "while_two_down": down,
                "kill_to_two_updates_s": recovered_s, "updates_during_fault": steps.poll() - before,
                "actor_backoff_lines": said.count(BACKOFF_LINE) + said.count("still not delivered"),
                "actor_log_errors": {k: said.count(k) for k in ("NOT_ENOUGH_REPLICAS", "REQUEST_TIMED_OUT",
                                                                 "Traceback") if k in said}}

    try:
        ledger = decoupled_run_through(healthy, rig, ns, "below-quorum", below_quorum)
    finally:
        raw.close()
    assert ledger["while_two_down"]["raw_records"] == 0, "a batch was acknowledged below min.insync.replicas"
    assert "Traceback" not in ledger["actor_log_errors"]
