"""Two learner ranks (gloo) on a real broker, started as ``rlstream learner --learners 2`` or as
torchrun-style rank processes: one consumer group splits the prepared topic's partitions, every
batch is trained exactly once, rank 0 alone publishes monotonic versions, and a SIGKILLed rank
stops the other (exit code 3, bounded time); a restart resumes the group from its snapshot."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

from learner.distributed import EXIT_PEER_LOST, free_port
from learner.snapshots.url import open_store
from rlstream import wiring
from config import BusConfig
from schemas.codec import Codec
from schemas.events import GradientStep, PolicyVersion
from streams.events import EventBus
from streams.topics import LEARNER_GROUP, LEARNER_STEPS, POLICY_VERSIONS, SAMPLES_PREPARED, Namespace
from tests.support import Role, wait_for
from tests.support.fragments import fragment
from tests.support.kafka import committed

pytestmark = pytest.mark.kafka
SIZE = 32  # transitions per fragment (16 steps x 2 envs)


class Run:
    """A namespace with a 2-partition prepared topic, and the learner command line on it."""

    def __init__(self, bootstrap: str, tmp: Path) -> None:
        self.bootstrap, self.tmp = bootstrap, tmp
        self.ns = f"ddp{uuid.uuid4().hex[:8]}"
        self.bus = wiring.build_bus(BusConfig(kind="kafka", bootstrap=bootstrap, namespace=self.ns, partitions=2))
        self.events = EventBus(self.bus, Codec())
        self.n = 0

    def produce(self, count: int, partition: int | None = None) -> None:
        """``count`` fragments, alternating partitions (as keyed by two actors), or all on ``partition``."""
        for _ in range(count):
            pb = fragment(self.n)
            self.bus.produce(SAMPLES_PREPARED, self.events.codec.encode(pb), key=pb.sample.actor_id.encode(),
                             headers=self.events.codec.headers_for(pb),
                             partition=self.n % 2 if partition is None else partition)
            self.n += 1
        self.bus.flush()

    def cmd(self, *extra: str) -> list[str]:
        return [sys.executable, "-m", "rlstream.cli", "learner", "--bus", "kafka", "--bootstrap", self.bootstrap,
                "--namespace", self.ns, "--env", "Pendulum-v1", "--algo", "ppo", "--learners", "2",
                "--train-batch-size", str(2 * SIZE), "--total-steps", "1000000", "--snapshot-every", "1",
                "--run-dir", str(self.tmp / "run"), "--metrics-port", "-1", "--tensorboard", "off", "--no-plot",
                "--torch-threads", "1", "--set", "num_minibatches=1", "--set", "update_epochs=1", *extra]

    def read(self, topic: str, kind: type) -> list:
        out = [self.events.codec.decode(r.value) for r in self.bus.read_all(topic)]
        return [e for e in out if isinstance(e, kind)]

    def steps(self) -> list[GradientStep]:
        return self.read(LEARNER_STEPS, GradientStep)

    def trained(self) -> list[str]:
        return [b for s in self.steps() for b in s.batch_ids]

    def close(self) -> None:
        self.bus.close()


@pytest.fixture
def run(kafka_bootstrap, tmp_path):
    r = Run(kafka_bootstrap, tmp_path)
    yield r
    r.close()


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}


def trained_all(run: Run, role: Role, n: int):
    """A wait predicate: every fragment b0..b<n-1> is in a GradientStep (fails if ``role`` died)."""
    def pred() -> bool:
        assert role.alive(), f"{role.name} exited {role.proc.returncode}:\n{role.tail()}"
        return set(run.trained()) >= {f"b{i}" for i in range(n)}
    return pred


def assert_monotonic(versions: list[PolicyVersion]) -> None:
    nums = [v.version for v in versions]
    assert nums == sorted(set(nums)), f"versions not strictly increasing: {nums}"
    assert {v.learner_id for v in versions} == {"learner-0"}  # one publisher


def train_until(run: Run, tmp_path: Path, n: int, what: str, *extra: str, log: str = "learner.log") -> None:
    """Start the 2-rank learner, wait until fragments b0..b<n-1> are trained, stop it cleanly."""
    lr = Role("learner", run.cmd(*extra), tmp_path / log, env())
    try:
        wait_for(trained_all(run, lr, n), 300, what, every=1.0, on_timeout=lr.tail)
        assert lr.terminate(60) == 0, lr.tail()
    finally:
        if lr.alive():
            lr.kill()


def test_two_ranks_train_every_batch_once_and_version_monotonically(run, tmp_path):
    run.produce(12)
    train_until(run, tmp_path, 12, "both ranks to train all 12 fragments")
    steps = run.steps()
    ids = [b for s in steps for b in s.batch_ids]
    assert len(ids) == len(set(ids)) == 12  # nothing trained twice, nothing missing
    for s in steps:  # each update is the union of the ranks' shares, at least the global batch
        assert s.num_samples == SIZE * len(s.batch_ids) >= 2 * SIZE, s
    assert [s.step for s in steps] == list(range(1, len(steps) + 1))
    versions = run.read(POLICY_VERSIONS, PolicyVersion)
    assert_monotonic(versions)
    assert len(versions) == 1 + len(steps)  # the start, then one per update
    assert [s.to_version for s in steps] == [v.version for v in versions[1:]]
    for name in ("learner", "learner-rank1"):  # each rank records its own config (never one shared file)
        assert (tmp_path / "run" / f"{name}.config.json").exists(), name
    text = (tmp_path / "learner.log").read_text()
    assert '"rank_summary"' in text and '"world_size": 2' in text
    ns = Namespace(run.ns)
    # the group's commits per partition reach what was trained: 6 fragments on each
    assert committed(run.bootstrap, ns.group(LEARNER_GROUP), ns.topic(SAMPLES_PREPARED)) == {0: 6, 1: 6}


def test_a_rank_whose_partition_stays_empty_does_not_stall_the_group(run, tmp_path):
    """One actor, so one partition: the rank owning the other holds nothing, and the group still
    trains every fragment once (the global batch is the busy rank's share)."""
    run.produce(6, partition=1)
    train_until(run, tmp_path, 6, "the group to train the busy partition's fragments")
    ids = run.trained()
    assert sorted(ids) == sorted(f"b{i}" for i in range(6)), ids
    assert_monotonic(run.read(POLICY_VERSIONS, PolicyVersion))
    ns = Namespace(run.ns)
    assert committed(run.bootstrap, ns.group(LEARNER_GROUP), ns.topic(SAMPLES_PREPARED)).get(1) == 6


def test_a_killed_rank_stops_the_other_and_a_restart_resumes_from_the_snapshot(run, tmp_path):
    port = str(free_port())
    ranks = [Role(f"rank{r}", run.cmd(), tmp_path / f"rank{r}.log",
                  {**env(), "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}) for r in range(2)]
    store = open_store(str(tmp_path / "run" / "snapshots"))
    try:
        for n in (1, 2):  # one fragment per rank at a time: one update each
            run.produce(2)
            wait_for(lambda: len(run.steps()) >= n and store.latest() is not None, 300,
                     f"update {n} and its snapshot", every=1.0, on_timeout=lambda: ranks[0].tail() + ranks[1].tail())
        ranks[1].kill()
        wait_for(lambda: not ranks[0].alive(), 120, "rank 0 to stop after its peer was killed",
                 every=0.5, on_timeout=ranks[0].tail)
        assert ranks[0].proc.returncode == EXIT_PEER_LOST, ranks[0].tail()
    finally:
        for r in ranks:
            if r.alive():
                r.kill()
    before = run.read(POLICY_VERSIONS, PolicyVersion)
    snap = store.latest()
    run.produce(12)
    train_until(run, tmp_path, 16, "the resumed group to train every fragment", "--resume", log="resumed.log")
    versions = run.read(POLICY_VERSIONS, PolicyVersion)
    assert_monotonic(versions)
    resumed = versions[len(before)]
    assert resumed.parent_version == snap  # the group restarted from its snapshot
    # exactly once along the final model's lineage: steps of abandoned versions do not count
    parent = {v.version: v.parent_version for v in versions}
    line, v = set(), versions[-1].version
    while v is not None:
        line.add(v)
        v = parent.get(v)
    ids = [b for s in run.steps() if s.to_version in line for b in s.batch_ids]
    assert sorted(ids) == sorted(f"b{i}" for i in range(16)), ids
