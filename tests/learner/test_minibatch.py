"""The learner's dynamic minibatch size (learner.minibatch): the controller's decisions, the
algorithms' use of the size it sets, and ``rlstream_batch_size`` reporting the learner's own."""

from __future__ import annotations

import re

import pytest
import torch

from agents.registry import make_algorithm
from config import TrainConfig
from learner.batching import StreamIds, to_trajectory_batch
from learner.minibatch import MinibatchController
from rlstream import wiring
from runtime.metrics import Metrics
from schemas.codec import Codec
from streams.bus.memory import MemoryBus
from streams.events import EventBus
from streams.topics import SAMPLES_PREPARED, all_topics
from tests.support.fragments import ACT, OBS, fragment

torch.set_num_threads(1)


def test_duty_cycle_without_gpu_grows_when_the_learner_is_the_bottleneck_and_shrinks_with_room():
    c = MinibatchController(initial=64, patience=2)
    assert c.update(0.6, 1.0) == 64  # duty 0.6 > 0.5: once is not enough
    assert c.update(0.6, 1.0) == 128
    assert c.update(0.6, 1.0) == 128 and c.update(0.6, 1.0) == 256
    assert c.update(0.9, 1.0) == 256 and c.update(0.9, 1.0) == 256  # bounded above
    assert c.update(0.3, 1.0) == 256 and c.update(0.3, 1.0) == 256  # in the band: stays
    assert c.update(0.1, 1.0) == 256 and c.update(0.1, 1.0) == 128  # duty 0.1 < 0.2: shrink
    assert c.update(0.6, 1.0) == 128 and c.update(0.1, 1.0) == 128  # a change of mind resets patience
    for _ in range(10):
        c.update(0.05, 1.0)
    assert c.size == 32 and c.changes == 5  # bounded below


def test_gpu_utilisation_decides_where_a_gpu_is_read():
    c = MinibatchController(initial=64, patience=1)
    assert c.update(0.01, 1.0, gpu_util=40.0) == 128  # idle device: bigger minibatches (duty says shrink)
    assert c.update(0.9, 1.0, gpu_util=70.0) == 128  # in the band (duty says grow)
    assert c.update(0.01, 1.0, gpu_util=95.0) == 64  # saturated: smaller


def test_thresholds_that_could_flap_are_refused():
    with pytest.raises(ValueError, match="flapping"):
        MinibatchController(duty_low=0.3, duty_high=0.5)
    with pytest.raises(ValueError):
        MinibatchController(initial=100)


@pytest.mark.parametrize("algo", ["ppo", "agro"])
def test_an_update_takes_minibatches_of_the_size_set(algo):
    frags = [fragment(i) for i in range(4)]  # 4 x 16 x 2 = 128 transitions
    a = make_algorithm(algo, OBS, ACT, {"num_minibatches": 2, "update_epochs": 1, "seed": 1}, "cpu")
    ref = make_algorithm(algo, OBS, ACT, {"num_minibatches": 4, "update_epochs": 1, "seed": 1}, "cpu")
    a.minibatch_size = 32
    m = a.update(to_trajectory_batch(frags, StreamIds()))
    ref.update(to_trajectory_batch(frags, StreamIds()))
    assert m["minibatch_size"] == 32
    for p, q in zip(a.policy.parameters(), ref.policy.parameters()):
        assert torch.equal(p, q)


def gauge(metrics: Metrics, name: str) -> float:
    m = re.search(rf'^{name}\{{role="learner"\}} (\S+)$', metrics.render().decode(), re.MULTILINE)
    return float(m.group(1))


def test_the_learner_follows_its_controller_and_the_gauge_reports_its_minibatch(tmp_path):
    bus = MemoryBus()
    bus.create_topics(all_topics())
    events = EventBus(bus, Codec())
    cfg = TrainConfig(algo="agro", env_id="Pendulum-v1", train_batch_size=128, dynamic_batch=True, run_dir=tmp_path,
                      snapshot_every=0, algo_overrides={"update_epochs": 1})
    metrics = Metrics(role="learner", gpu=False)
    algo = make_algorithm("agro", OBS, ACT, {"num_minibatches": 2, "update_epochs": 1}, "cpu")
    learner = wiring.build_learner(cfg, events, metrics, algo, gpu_util=lambda: 10.0)  # an idle GPU
    assert algo.minibatch_size == 64  # the rung nearest the static split (128 / 2)
    learner.start(resume=False)
    used = []
    for k in range(6):
        for i in range(4):
            events.publish(SAMPLES_PREPARED, fragment(10 * k + i), key="actor-0")
        m = learner.step(0)
        assert m is not None
        used.append(m["minibatch_size"])
        assert gauge(metrics, "rlstream_batch_size") == m["minibatch_size"]
    # the first update has no interval, then two low readings per rung; 256 is more than a batch
    # of 128 holds, so the last update takes it whole (and says so)
    assert used == [64, 64, 64, 128, 128, 128] and algo.minibatch_size == 256
    assert learner.summary()["minibatch_size"] == algo.minibatch_size
    learner.close()


class Recording:
    """A controller that notes what the learner feeds it and keeps its size."""

    size = 64
    changes = 0

    def __init__(self) -> None:
        self.calls: list[tuple[float, float, float | None]] = []

    def update(self, update_s: float, interval_s: float, gpu_util: float | None = None) -> int:
        self.calls.append((update_s, interval_s, gpu_util))
        return self.size


def test_without_a_gpu_the_learner_feeds_its_update_time_and_the_cycle_that_holds_it(tmp_path):
    from learner.learner import Learner, LearnerConfig

    bus = MemoryBus()
    bus.create_topics(all_topics())
    events = EventBus(bus, Codec())
    algo = make_algorithm("agro", OBS, ACT, {"num_minibatches": 2, "update_epochs": 1}, "cpu")
    ctl = Recording()
    learner = Learner(LearnerConfig(algo="agro", train_batch_size=64), algo, events, batch_control=ctl)
    learner.start(resume=False)
    for k in range(3):
        for i in range(2):
            events.publish(SAMPLES_PREPARED, fragment(10 * k + i), key="actor-0")
        assert learner.step(0) is not None
    assert len(ctl.calls) == 2  # none after the first update: no interval yet
    for update_s, interval_s, util in ctl.calls:
        assert 0 < update_s < interval_s and util is None  # the update lies within its cycle
    learner.close()
