"""One bad record on rl.policy.versions makes one dead letter, in both modes.

Every reader of rl.policy.versions reads every record (no consumer group): the learner, the
stream processors, each actor. The learner owns the topic's dead letters
(``streams.topics.DEAD_LETTER_OWNERS``); the others skip a bad record and count it in
``rlstream_skipped_total{topic,reason}``. N bad records injected into a running run give exactly
N dead letters (stage ``learner``), each other reader counts N, and training goes on.

Co-located: ``run_colocated`` over a memory bus, two actors, in a thread. Decoupled: the Faust
worker, ``rlstream learner`` and ``rlstream actor`` as processes on a private broker.
"""

from __future__ import annotations

import sys
import threading
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rlstream.colocated import run_colocated
from config import TrainConfig
from runtime.metrics import Metrics
from schemas.codec import Codec
from schemas.events import DeadLetter
from streams.bus.kafka import KafkaBus
from streams.bus.memory import MemoryBus
from streams.topics import DEADLETTER, LEARNER_STEPS, POLICY_VERSIONS, SAMPLES_RAW, all_topics

from tests.support import free_ports

from .conftest import FRAGMENT, Rig, Role, TopicCounter, wait_for
from .malformed import sample_batch

CODEC = Codec()
N_BAD = 6


def bad_records() -> list[bytes]:
    """Undecodable bytes and a well-formed event of the wrong type: every reader decodes every
    record, so every reader meets each of them."""
    junk = [f"not a policy {i}".encode() for i in range(N_BAD // 2)]
    wrong = [CODEC.encode(sample_batch("x", i)) for i in range(N_BAD - len(junk))]
    return junk + wrong


def skipped_total(exposition: str) -> float:
    """Sum of ``rlstream_skipped_total`` for rl.policy.versions in a Prometheus text exposition."""
    return sum(s.value for fam in text_string_to_metric_families(exposition) for s in fam.samples
               if s.name == "rlstream_skipped_total" and s.labels.get("topic") == POLICY_VERSIONS)


def policy_dead_letters(records) -> list[DeadLetter]:
    dead = [CODEC.decode(r.value) for r in records]
    return [d for d in dead if isinstance(d, DeadLetter) and d.topic == POLICY_VERSIONS]


def test_colocated_n_bad_policy_records_make_n_dead_letters(tmp_path):
    bus = MemoryBus()
    bus.create_topics(all_topics())
    metrics = Metrics(role="colocated", gpu=False)
    cfg = TrainConfig(env_id="Pendulum-v1", total_steps=10**9, num_actors=2, num_envs=1, fragment_steps=FRAGMENT,
                      train_batch_size=2 * FRAGMENT, seed=1, run_dir=tmp_path, log_every_s=1e9,
                      snapshot_every=0, metrics_port=-1,
                      algo_overrides={"update_epochs": 1, "num_minibatches": 1})
    stop, out, errors = threading.Event(), {}, []

    def run() -> None:
        try:
            out.update(run_colocated(cfg, stop=stop, metrics=metrics, bus=bus))
        except BaseException as e:  # noqa: BLE001 -- reported by the test
            errors.append(e)

    def steps() -> int:
        return sum(bus.end_offsets(LEARNER_STEPS).values())

    th = threading.Thread(target=run, daemon=True)
    th.start()
    try:
        wait_for(lambda: steps() >= 1 or errors, 120, "the first update")
        for value in bad_records():
            bus.produce(POLICY_VERSIONS, value, key=b"policy")
        after = steps()
        # the learner, the stream processors and both actors each meet every bad record
        wait_for(lambda: len(policy_dead_letters(bus.read_all(DEADLETTER))) >= N_BAD or errors, 120,
                 "the learner's dead letters")
        wait_for(lambda: skipped_total(generate_latest(metrics.registry).decode()) >= 3 * N_BAD or errors, 120,
                 "the other readers' skip counts")
        wait_for(lambda: steps() >= after + 2 or errors, 120, "two more updates")
    finally:
        stop.set()
        th.join(60)
    assert not errors and not th.is_alive()
    dead = policy_dead_letters(bus.read_all(DEADLETTER))
    assert len(dead) == N_BAD and {d.stage for d in dead} == {"learner"}
    assert skipped_total(generate_latest(metrics.registry).decode()) == 3 * N_BAD
    assert out["streams"]["emitted_batches"] > 0


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
        return r.read().decode()


def scraped_skips(port: int) -> float:
    try:
        return skipped_total(scrape(port))
    except OSError:  # the role's server is not up yet
        return -1.0


@pytest.mark.kafka
def test_decoupled_n_bad_policy_records_make_n_dead_letters(private_kafka, tmp_path):
    bootstrap = private_kafka.bootstrap
    faust_port, actor_port = free_ports(2)
    rig = Rig(bootstrap, tmp_path, snapshot_every=0, train_batch_size=2 * FRAGMENT)
    steps = TopicCounter(bootstrap, LEARNER_STEPS, CODEC.decode)
    bus = KafkaBus(bootstrap, client_id="bad-policy-records")
    try:
        rig.roles.append(Role("streams", [
            sys.executable, "-m", "faust", "-A", "streams", "--datadir", str(tmp_path / "faust"), "worker",
            "-l", "warn", "--web-port", str(faust_port)], tmp_path / "streams.log",
            {**rig.env, "RLSTREAM_POLICY_ID": "policy", "RLSTREAM_ALGO": "ppo",
             "RLSTREAM_METRICS_PORT": str(faust_port)}))
        learner = rig.learner()
        actor = rig._spawn("actor-0", rig._cmd("actor", "--index", "0", "--metrics-port", str(actor_port)))
        wait_for(lambda: steps.poll() >= 1, 180, "the first update", on_timeout=rig.logs)
        wait_for(lambda: scraped_skips(faust_port) >= 0 and scraped_skips(actor_port) >= 0, 60,
                 "the readers' metrics", on_timeout=rig.logs)
        for value in bad_records():
            bus.produce(POLICY_VERSIONS, value, key=b"policy")
        bus.flush()
        after = steps.poll()
        wait_for(lambda: len(policy_dead_letters(bus.read_all(DEADLETTER))) >= N_BAD, 120,
                 "the learner's dead letters", on_timeout=rig.logs)
        wait_for(lambda: scraped_skips(faust_port) >= N_BAD and scraped_skips(actor_port) >= N_BAD, 120,
                 "the Faust worker's and the actor's skip counts", on_timeout=rig.logs)
        wait_for(lambda: steps.poll() >= after + 2, 180, "two more updates", on_timeout=rig.logs)
        assert (scraped_skips(faust_port), scraped_skips(actor_port)) == (N_BAD, N_BAD)
        assert all(r.alive() for r in rig.roles), rig.logs()
        for role in (actor, learner, rig.roles[0]):
            role.stop()
            assert role.proc.returncode == 0, role.tail()
        dead = policy_dead_letters(bus.read_all(DEADLETTER))
        assert len(dead) == N_BAD and {d.stage for d in dead} == {"learner"}
        assert not [d for d in (CODEC.decode(r.value) for r in bus.read_all(DEADLETTER)) if d.topic == SAMPLES_RAW]
    finally:
        rig.close()
        steps.close()
        bus.close()

