"""A learner's late writes are fenced (issue 39): its bus writes in transactions under a stable
identity (run namespace, group, policy, rank), so once a newer learner of that identity has
started, nothing the older one sends reaches a reader: neither a write it had in flight (a killed
process's socket buffer, delivered later) nor one it makes afterwards, which also fails it with
``WriterFencedError``. Readers (``KafkaBus`` consumers, the policy tail) read committed only.

A fenced ``rlstream learner --learner.on-fenced wait`` (the manifests') stays up without writing,
alive and not ready, until SIGTERM: a restart, which Kubernetes gives every exit, would fence
the newer learner in turn."""

from __future__ import annotations

import contextlib
import json
import re
import urllib.error
import urllib.request

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from config import BusConfig
from schemas.codec import Codec
from schemas.events import PolicyVersion
from learner.snapshots.url import open_store
from streams.bus import open_bus
from streams.bus.base import EXIT_FENCED, WriterFencedError
from streams.events import EventBus
from streams.policy.publish import publish_policy_version
from streams.policy.tail import newest_version
from streams.topics import LEARNER_STEPS, POLICY_VERSIONS, SAMPLES_PREPARED, Namespace
from testbed.wait import wait_for
from tests.support import free_ports
from tests.support.kafka import committed

from .conftest import Ledger, Rig, TopicCounter

NS = "fence"
WRITER = "learner.policy.rank0"  # what rlstream.processes.run_learner names rank 0 of the default group


def _version(v: int, learner: str) -> PolicyVersion:
    return PolicyVersion(policy_id="policy", version=v, created_at_ms=v, learner_id=learner, algo="ppo",
                         weights=b"w" * 16)


def _log_uncommitted(bootstrap: str, topic: str, codec: Codec) -> list[tuple[int, str]]:
    """(version, learner) of every record the log holds, committed or not (read_uncommitted)."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "fence-probe", "enable.auto.commit": False,
                  "isolation.level": "read_uncommitted", "enable.partition.eof": True})
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        c.assign([TopicPartition(topic, p, 0) for p in parts])
        out, eof = [], set()
        while len(eof) < len(parts):
            m = c.poll(5.0)
            assert m is not None, "no end of the log within 5 s"
            if m.error():
                eof.add(m.partition())
                continue
            pv = codec.decode(m.value())
            out.append((pv.version, pv.learner_id))
        return out
    finally:
        c.close()


@pytest.mark.timeout(180)
def test_a_newer_learner_fences_the_older_ones_writes(private_kafka):
    codec = Codec()
    cfg = BusConfig(kind="kafka", bootstrap=private_kafka.bootstrap, namespace=NS)
    topic = Namespace(NS).topic(POLICY_VERSIONS)
    zombie = EventBus(open_bus(cfg, writer=WRITER), codec)
    newer = reader = None
    try:
        for v in (0, 1):
            publish_policy_version(zombie, _version(v, "zombie"))  # committed: every reader sees them
        # version 2 reaches the broker but its transaction is never committed (the first learner
        # is cut off and killed before its commit; its socket delivers the record after all)
        zombie.bus.produce(POLICY_VERSIONS, codec.encode(_version(2, "zombie")), key=b"policy")
        wait_for(lambda: (2, "zombie") in _log_uncommitted(private_kafka.bootstrap, topic, codec), 30,
                 "the zombie's version 2 in the log", every=0.2)

        newer = EventBus(open_bus(cfg, writer=WRITER), codec)  # the restarted learner: same identity
        for v in (2, 3):
            publish_policy_version(newer, _version(v, "newer"))
        newer.bus.produce(LEARNER_STEPS, b"step of 3", key=b"newer")  # its other topic
        newer.flush()

        # a write of the zombie after the newer learner started: refused, and the zombie told why
        with pytest.raises(WriterFencedError, match="newer writer"):
            publish_policy_version(zombie, _version(4, "zombie"))

        reader = EventBus(open_bus(BusConfig(kind="kafka", bootstrap=private_kafka.bootstrap, namespace=NS)), codec)
        seen = [(pv.version, pv.learner_id) for pv in map(codec.decode, (r.value for r in
                                                                        reader.bus.read_all(POLICY_VERSIONS)))]
        assert seen == [(0, "zombie"), (1, "zombie"), (2, "newer"), (3, "newer")]
        newest = newest_version(reader)  # the tail reader: back from the end, past the commit markers
        assert (newest.version, newest.learner_id) == (3, "newer")
        assert [r.value for r in reader.bus.read_all(LEARNER_STEPS)] == [b"step of 3"]
        # the zombie's version 2 is in the log (aborted), its version 4 never got there
        uncommitted = _log_uncommitted(private_kafka.bootstrap, topic, codec)
        assert (2, "zombie") in uncommitted and (4, "zombie") not in uncommitted
    finally:
        zombie.bus.close()  # fenced: nothing to flush, and no error
        for e in (newer, reader):
            if e is not None:
                e.bus.close()


def _get(url: str) -> tuple[int, dict]:
    """(status, JSON body) of a GET, a 503 included."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _events(role, name: str) -> list[dict]:
    """The JSON log lines of ``role`` whose event is ``name``."""
    out = []
    for line in role.text().splitlines():
        if line.startswith("{") and f'"{name}"' in line:
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if rec.get("event") == name:
                    out.append(rec)
    return out


def _written(bootstrap: str) -> tuple[list, list, list]:
    """What the learner's writes left committed: (version, learner) of each PolicyVersion, the
    GradientSteps' versions, its dead letters."""
    ledger = Ledger.read(bootstrap)
    return ([(v.version, v.learner_id) for v in ledger.versions], [(s.from_version, s.to_version) for s in ledger.steps],
            [(d.topic, d.partition, d.offset, d.reason) for d in ledger.dead if d.stage == "learner"])


@pytest.mark.timeout(300)
def test_a_fenced_learner_told_to_wait_stays_up_not_ready_and_writes_nothing(private_kafka, tmp_path):
    """``rlstream learner --learner.on-fenced wait`` trains, is fenced (a producer of its
    transactional id registers, as a newer learner's first write does), and then: logs
    ``learner_fenced`` once, keeps running, answers /readyz 503 (check ``fenced``) and /healthz
    200, exports ``rlstream_learner_fenced 1``, adds nothing to the log (read committed), commits
    no offset and takes no snapshot, neither then nor on its way out; SIGTERM ends it with
    ``EXIT_FENCED``."""
    port = free_ports(1)[0]
    # no periodic snapshot in this short run: any snapshot in the store is one the fenced path wrote
    rig = Rig(private_kafka.bootstrap, tmp_path, snapshot_every=10**6)
    steps = TopicCounter(private_kafka.bootstrap, LEARNER_STEPS, Codec().decode)
    store = open_store(tmp_path / "snapshots", keep_last=None)
    url = f"http://127.0.0.1:{port}"
    newer = None
    try:
        rig.start_streams("worker")
        learner = rig.learner(False, "--learner.on-fenced", "wait", "--metrics-port", str(port),
                              "--learner.snapshot-interval-s", "0")
        actor = rig.actor(0)
        wait_for(lambda: steps.poll() >= 2, 150, "2 updates of the learner", on_timeout=rig.logs)
        assert store.latest() is None, "a snapshot before the fence: the test's schedule is wrong"
        tid = wait_for(lambda: re.search(r"kafka producer (\S+): transactional", learner.text()), 30,
                       "the learner's transactional id in its log", on_timeout=rig.logs).group(1)

        # the newer learner's first write: init_transactions of the same id bumps its epoch
        newer = Producer({"bootstrap.servers": private_kafka.bootstrap, "transactional.id": tid})
        newer.init_transactions(30)
        fenced_at = _written(private_kafka.bootstrap)  # from now on no write of the old epoch commits
        assert fenced_at[0], "nothing committed before the fence"

        # it notices at its next update's commit (the actor still feeds it)
        wait_for(lambda: _events(learner, "learner_fenced") or not learner.alive(), 120, "learner_fenced",
                 on_timeout=rig.logs)
        actor.terminate(60)
        offsets = committed(private_kafka.bootstrap, "learner", SAMPLES_PREPARED)  # its last update's, at most
        assert max(offsets.values()) > 0, offsets

        def waiting_a_while() -> dict | None:
            assert learner.alive(), f"the fenced learner exited {learner.proc.returncode}:\n{learner.tail()}"
            status, body = _get(url + "/readyz")
            assert status == 503, body
            fenced = body["checks"]["fenced"]
            return body if fenced["detail"]["fenced_for_s"] >= 3 else None

        ready = wait_for(waiting_a_while, 60, "3 s of the fenced learner waiting", every=0.5, on_timeout=rig.logs,
                         ignore=(OSError,))  # (a server going down: the next poll finds the process gone)
        assert ready["status"] == "fail" and ready["checks"]["fenced"]["ok"] is False
        assert ready["checks"]["fenced"]["detail"]["reason"] == "fenced"
        status, live = _get(url + "/healthz")
        assert status == 200 and live["status"] == "ok", live
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            exposition = r.read().decode()
        assert re.search(r'^rlstream_learner_fenced\{role="learner"\} 1\.0$', exposition, re.M), \
            [line for line in exposition.splitlines() if "fenced" in line]

        (line,) = _events(learner, "learner_fenced")
        assert line["exit_code"] == EXIT_FENCED and line["on_fenced"] == "wait" and "newer writer" in line["error"]
        assert learner.terminate(30) == EXIT_FENCED, learner.tail()
        assert _events(learner, "learner_fenced_stopped")
        assert _written(private_kafka.bootstrap) == fenced_at, "the fenced learner wrote after the fence"
        assert committed(private_kafka.bootstrap, "learner", SAMPLES_PREPARED) == offsets, \
            "the fenced learner committed offsets after it was fenced"
        assert store.latest() is None and store.versions() == [], \
            f"the fenced learner wrote snapshot(s) {store.versions()}: the store is the newer learner's"
    finally:
        newer = None  # (its client goes, before the broker does)
        steps.close()
        rig.close()
