"""Co-located ``--overlap`` (``TrainConfig.overlap``): the actors collect fragment k+1 with version v
while the learner trains fragment k into v+1, so fragment k+1 is trained at v+1 with the
behaviour log-probs of v, corrected (PPO as decoupled PPO); off, nothing changes (lag 0).

Read back from the run's own event log and from the batches the algorithm was handed; no timing.
"""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch

from agents.ppo.learning import PPO
from agents.vtrace import importance_weights
from config import BusConfig, TrainConfig
from logtools.timetravel.record import load
from rlstream.colocated import run_colocated
from schemas.events import SampleBatch
from streams.policies import load_policy

BATCH, UPDATES = 64, 4


def run(tmp_path, monkeypatch, overlap: bool, **extra) -> tuple[dict, list[dict], object]:
    """A short co-located PPO run (4 updates of 64 steps on Pendulum); what each ``PPO.update``
    was handed (its behaviour log-probs, and the log-probs of the learner's own policy then)."""
    handed: list[dict] = []
    update = PPO.update

    def spy(self, batch):
        with torch.no_grad():
            own = self.policy.log_prob(batch.obs, batch.actions)
        handed.append({"obs": batch.obs.clone(), "actions": batch.actions.clone(),
                       "behaviour_logp": batch.behaviour_logp.clone(), "own_logp": own})
        return update(self, batch)

    monkeypatch.setattr(PPO, "update", spy)
    torch.set_num_threads(1)
    cfg = TrainConfig(env_id="Pendulum-v1", total_steps=UPDATES * BATCH, train_batch_size=BATCH, seed=4,
                      run_dir=tmp_path, log_every_s=1e9, plot=False, snapshot_every=0, overlap=overlap,
                      algo_overrides={"update_epochs": 2, "num_minibatches": 2, "learning_rate": 3e-3}, bus=BusConfig(log_dir=str(tmp_path / "log")),
                      **extra)
    summary = run_colocated(cfg)
    assert not mp.active_children()  # --overlap's rollout processes end with the run
    return summary, handed, load(tmp_path)


def logp_under(recorded, version: int, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """Log-probs of ``actions`` under version ``version`` as published on the run's topic."""
    policy = load_policy(recorded.versions[version][1])
    with torch.no_grad():
        return policy.log_prob(obs, actions)


def trained(recorded, codec_step) -> list[SampleBatch]:
    return [recorded.codec.decode(recorded.raw[b].value, SampleBatch) for b in codec_step.batch_ids]


def test_with_overlap_fragment_k_plus_1_is_trained_at_v_plus_1_with_the_behaviour_logp_of_v(tmp_path, monkeypatch):
    summary, handed, rec = run(tmp_path, monkeypatch, overlap=True)
    steps = [s for _, s in rec.steps]
    assert summary["updates"] == len(steps) == len(handed) == UPDATES
    for i, (step, got) in enumerate(zip(steps, handed)):
        (sample,) = trained(rec, step)
        at = step.from_version  # the learner's model when it trained this fragment
        assert at == i
        # the first fragment was collected before any update; every later one a version behind
        assert sample.policy_version == (0 if i == 0 else at - 1), (i, sample.policy_version, at)
        obs, act = got["obs"], got["actions"]
        collected = logp_under(rec, sample.policy_version, obs, act)
        current = logp_under(rec, at, obs, act)
        # what the update was handed: the behaviour log-probs of the version that collected ...
        torch.testing.assert_close(got["behaviour_logp"], collected, atol=1e-4, rtol=1e-4)
        assert np.array_equal(got["behaviour_logp"].numpy(), sample.behaviour_logp)
        # ... while the learner's own policy was the next version
        torch.testing.assert_close(got["own_logp"], current, atol=1e-5, rtol=1e-5)
        if i:
            assert float((collected - current).abs().max()) > 1e-3  # the two versions do differ here
        # and the update weighed each sample by the truncated pi_{v+1} / mu_v (decoupled PPO)
        rho = importance_weights(current - got["behaviour_logp"])[0]
        assert step.losses["behaviour_weight_mean"] == pytest.approx(float(rho.mean()), abs=1e-5)
        if i:
            assert step.losses["behaviour_weight_mean"] < 0.99, step.losses["behaviour_weight_mean"]
    # the lag is reported as it was: 0 for the first fragment, 1 for every later one
    assert summary["policy_lag"] == {"mean": (UPDATES - 1) / UPDATES, "max": 1, "fragments": UPDATES}
    lag = summary["streams"]["lag_versions"]
    assert (lag["count"], lag["max"], lag["mean"]) == (UPDATES, 1, (UPDATES - 1) / UPDATES)
    assert summary["overlap"]["rounds"] == UPDATES  # plus the last update, taken alone
    assert summary["events"]["rl.learner.steps"] == UPDATES and summary["events"]["rl.deadletter"] == 0


def test_without_overlap_each_fragment_is_trained_by_the_version_that_collected_it(tmp_path, monkeypatch):
    summary, handed, rec = run(tmp_path, monkeypatch, overlap=False)
    steps = [s for _, s in rec.steps]
    assert summary["updates"] == len(steps) == UPDATES
    for step, got in zip(steps, handed):
        (sample,) = trained(rec, step)
        assert sample.policy_version == step.from_version  # lag 0
        torch.testing.assert_close(got["behaviour_logp"], got["own_logp"], atol=1e-4, rtol=1e-4)
        assert "behaviour_weight_mean" not in step.losses  # strict PPO: no decoupled correction
    assert summary["policy_lag"] == {"mean": 0.0, "max": 0, "fragments": UPDATES}
    assert summary["streams"]["lag_versions"]["max"] == 0 and summary["overlap"] is None


def test_overlap_is_deterministic(tmp_path, monkeypatch):
    """The rounds fix every event's order, not the threads' timing: two runs, the same weights."""
    runs = [run(tmp_path / str(i), monkeypatch, overlap=True)[2] for i in range(2)]
    a, b = (r.versions[UPDATES][1] for r in runs)
    assert a.weights == b.weights and a.weights


@pytest.mark.parametrize("algo", ["grpo", "dapo"])
def test_overlap_is_refused_for_algorithms_without_a_correction(algo):
    with pytest.raises(ValueError, match=f"--actor.overlap is not allowed for {algo}.*no correction.*allowed: ppo, agro, tba"):
        TrainConfig(algo=algo, overlap=True)


def test_overlap_sets_the_correction_and_refuses_an_override_against_it():
    assert TrainConfig(overlap=True).algo_overrides["decoupled"] is True
    assert "decoupled" not in TrainConfig().algo_overrides  # strict PPO unless overlapped
    assert TrainConfig(algo="agro", overlap=True).algo_overrides == TrainConfig(algo="agro").algo_overrides
    with pytest.raises(ValueError, match="--set decoupled=false contradicts it"):
        TrainConfig(overlap=True, algo_overrides={"decoupled": False})


def test_overlap_is_refused_in_decoupled_mode(tmp_path):
    from rlstream.cli import build_parser, train_config
    from rlstream.decoupled import run_decoupled

    with pytest.raises(ValueError, match="co-located mode only"):
        run_decoupled(TrainConfig(mode="decoupled", overlap=True, run_dir=tmp_path / "run"))
    assert not any(tmp_path.iterdir())  # refused before anything was written or started
    with pytest.raises(SystemExit, match="co-located mode only"):  # (TrainConfig checks its mode when made)
        build_parser().parse_args(["train", "--mode", "decoupled", "--actor.overlap", "--run-dir", str(tmp_path / "r")])
    a = build_parser().parse_args(["train", "--overlap", "--set", "decoupled=false", "--run-dir", str(tmp_path / "r")])
    with pytest.raises(SystemExit, match="contradicts"):
        train_config(a)


@pytest.mark.parametrize("asked, used", [(None, 1), (2, 2)])
def test_a_colocated_run_uses_one_torch_thread_unless_asked(tmp_path, asked, used):
    """torch's own default (a thread per core) spin-waits beside any other busy process
    (``config.train``'s ``torch_threads``: 60 against 2,142 samples/s measured)."""
    torch.set_num_threads(3)
    seen: list[int] = []
    update = PPO.update

    def spy(self, batch):
        seen.append(torch.get_num_threads())
        return update(self, batch)

    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(PPO, "update", spy)
            run_colocated(TrainConfig(env_id="Pendulum-v1", total_steps=BATCH, train_batch_size=BATCH, run_dir=tmp_path,
                                      log_every_s=1e9, plot=False, snapshot_every=0, torch_threads=asked,
                                      bus=BusConfig(log_dir=str(tmp_path / "log"))))
    finally:
        torch.set_num_threads(1)
    assert seen == [used]


def test_a_role_that_fails_to_build_leaves_no_rollout_child(tmp_path, monkeypatch):
    """The second actor's build fails: the first one's rollout child is ended, not left to the
    interpreter's exit."""
    from rlstream import wiring

    real = wiring.build_actor
    built: list = []

    def second_fails(cfg, events, metrics, index, **kw):
        if index == 1:
            assert mp.active_children()  # the first actor's child is running now
            raise RuntimeError("no second actor")
        built.append(real(cfg, events, metrics, index, **kw))
        return built[-1]

    monkeypatch.setattr(wiring, "build_actor", second_fails)
    cfg = TrainConfig(env_id="Pendulum-v1", total_steps=BATCH, train_batch_size=BATCH, run_dir=tmp_path,
                      log_every_s=1e9, plot=False, snapshot_every=0, overlap=True, num_actors=2,
                      bus=BusConfig(log_dir=str(tmp_path / "log")))
    with pytest.raises(RuntimeError, match="no second actor"):
        run_colocated(cfg)
    assert len(built) == 1
    assert not mp.active_children()
