"""rlstream replay: rebuild preference pairs from a recorded rl.samples.raw, publish them once
(idempotent), dead-letter bad records, and train a DPO policy that prefers the winning actions.

Toy setting: obs ~ N(0, I_2), one action, reward = -(a - target(obs))^2 with
target = 0.5 obs0 - 0.3 obs1; the behaviour policy is a fresh Gaussian (mean ~ 0, std 1), so
segments with actions near the target win.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from agents.dpo import segment_log_prob
from agents.networks import Policy
from streams.policies import RedisBlobStore, make_policy_version, policy_from_arch, publish_policy_version
from logtools.replay import build_segments, pair_segments, run_replay
from schemas.events import DeadLetter, PreferencePair, SampleBatch, now_ms
from schemas.weights import decode_weights
from streams.topics import DEADLETTER, PREFERENCES, SAMPLES_RAW
from tests.ops.conftest import redis_server_url  # noqa: F401  (fixture)

OBS, ACT, T, N, EP, SEG = 2, 1, 16, 8, 8, 4
W = np.array([0.5, -0.3], np.float32)


def target(obs: np.ndarray) -> np.ndarray:
    return obs @ W


def sample_batch(policy: Policy, rng: np.random.Generator, gen: torch.Generator, seq: int, version: int = 0,
                 group_size: int = 0) -> SampleBatch:
    obs = rng.normal(size=(T, N, OBS)).astype(np.float32)
    if group_size:
        obs[0] = np.repeat(obs[0, ::group_size], group_size, axis=0)  # a group shares its start state
    a, logp, _ = policy.act(torch.from_numpy(obs), generator=gen)
    a = a.numpy()
    rewards = (-(a[..., 0] - target(obs)) ** 2).astype(np.float32)
    term = np.zeros((T, N), bool)
    term[EP - 1::EP] = True
    return SampleBatch(
        batch_id=f"{rng.integers(1 << 62):016x}", actor_id="actor-0", seq=seq, env_id="Toy-v0", policy_version=version,
        created_at_ms=now_ms(), obs=obs, actions=a, rewards=rewards, terminated=term,
        truncated=np.zeros((T, N), bool), behaviour_logp=logp.numpy(), last_obs=np.zeros((N, OBS), np.float32),
        final_obs_index=np.zeros(0, np.int64), final_obs=np.zeros((0, OBS), np.float32),
        group_ids=(np.arange(N) // group_size).astype(np.int64) if group_size else None)


@pytest.fixture
def behaviour(events, pv):
    policy = pv.make_policy(0, OBS, ACT, hidden=(16, 16))
    with torch.no_grad():
        policy.net.actor_mean[-1].weight.zero_()  # mean ~ 0: the data is exploratory
        policy.net.actor_mean[-1].bias.zero_()
    pv.publish(events, 0, policy)
    return policy


def record(events, policy, batches: int, seed: int = 0, version: int = 0) -> list[SampleBatch]:
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    out = [sample_batch(policy, rng, gen, s, version) for s in range(batches)]
    for b in out:
        events.publish(SAMPLES_RAW, b, key=b.actor_id)
    return out


def test_segments_respect_episode_ends_and_pairs_have_a_gap(behaviour):
    rng, gen = np.random.default_rng(1), torch.Generator().manual_seed(1)
    b = sample_batch(behaviour, rng, gen, 0)
    segs, unused = build_segments(b, 3)  # episodes of 8 -> 2 segments of 3 each, 2 steps unused
    assert len(segs) == N * 2 * 2 and unused == N * 2 * 2
    assert sorted({s.t0 for s in segs}) == [0, 3, 8, 11]
    s = segs[1]
    assert s.ret == pytest.approx(float(b.rewards[s.t0:s.t0 + 3, s.column].sum()), rel=1e-6)
    pairs, skipped = pair_segments(segs, margin_std=0.1)
    assert pairs and all(w.ret > l.ret for w, l in pairs)
    assert len({x.key for p in pairs for x in p}) == 2 * len(pairs)  # each segment used once
    assert len(pairs) + skipped["small_gap"] == len(segs) // 2
    # group mode: first-episode segments only compete inside their start-state group
    gb = sample_batch(behaviour, rng, gen, 1, group_size=4)
    gsegs, _ = build_segments(gb, SEG)
    gpairs, _ = pair_segments(gsegs)
    first = [(w, l) for w, l in gpairs if w.bucket[0] == "group"]
    assert first and all(w.bucket == l.bucket and w.t0 == l.t0 for w, l in first)
    assert all(w.column // 4 == l.column // 4 for w, l in first)


def test_replay_builds_publishes_once_and_dead_letters_bad_records(events, behaviour, tmp_path):
    batches = record(events, behaviour, 6)
    events.bus.produce(SAMPLES_RAW, b"\x00garbage", key=b"actor-9")
    bad = sample_batch(behaviour, np.random.default_rng(5), torch.Generator().manual_seed(5), 99)
    rewards = bad.rewards.copy()
    rewards[0, 0] = np.nan
    events.publish(SAMPLES_RAW, SampleBatch(**{**bad.__dict__, "rewards": rewards}), key="actor-0")
    events.publish(SAMPLES_RAW, batches[0], key="actor-0")  # an actor's retry: same batch_id

    first = run_replay(events, segment=SEG, train=False, out=tmp_path)
    assert first["records"] == 9 and first["batches"] == 6
    assert first["segments"] == 6 * N * (T // SEG)
    assert first["pairs_built"] > 0.7 * first["segments"] / 2
    assert first["pairs_published"] == first["pairs_built"] and first["pairs_existing"] == 0
    assert first["dead_lettered"] == 2
    assert first["skipped"]["duplicate_batch"] == 1
    assert first["skipped"]["bad_record_corrupt"] == 1 and first["skipped"]["bad_record_invalid"] == 1
    dls = [events.codec.decode(r.value) for r in events.bus.read_all(DEADLETTER)]
    assert all(isinstance(d, DeadLetter) and d.stage == "replay" for d in dls)
    assert sorted(d.reason for d in dls) == ["corrupt", "invalid"] and "non-finite" in dls[1].detail

    pairs = [events.codec.decode(r.value) for r in events.bus.read_all(PREFERENCES)]
    assert len(pairs) == first["pairs_built"] and all(isinstance(p, PreferencePair) for p in pairs)
    p = pairs[0]
    assert p.return_w > p.return_l and p.obs_w.shape == (SEG, OBS) and p.act_l.shape == (SEG, ACT)
    assert p.policy_version == 0 and p.env_id == "Toy-v0"
    assert set(p.source_batch_ids) <= {b.batch_id for b in batches}

    second = run_replay(events, segment=SEG, train=False, out=tmp_path)
    assert second["pairs_built"] == first["pairs_built"]
    assert second["pairs_published"] == 0 and second["pairs_existing"] == first["pairs_built"]
    assert second["dead_lettered"] == 0  # already dead-lettered by the first replay
    assert sum(events.bus.end_offsets(PREFERENCES).values()) == first["pairs_built"]
    assert sum(events.bus.end_offsets(DEADLETTER).values()) == 2


def test_dpo_on_replayed_pairs_prefers_the_winning_actions(events, behaviour, tmp_path):
    record(events, behaviour, 20)
    summary = run_replay(events, segment=SEG, train=True, beta=0.1, epochs=30, out=tmp_path / "dpo")
    dpo = summary["dpo"]
    assert dpo["reference"] == {"source": "rl.policy.versions", "version": 0}
    assert dpo["loss_last"] < dpo["loss_first"] < 0.7
    assert dpo["pairs_heldout"] >= 30
    before, after = dpo["heldout_before"], dpo["heldout_after"]
    assert before["reward_accuracy"] == 0.0  # policy == reference before training
    assert after["reward_accuracy"] > 0.8
    assert after["logp_margin_policy"] > after["logp_margin_reference"]
    assert after["prefers_winner_policy"] > after["prefers_winner_reference"]

    saved = json.loads((tmp_path / "dpo" / "summary.json").read_text())
    assert saved["pairs_built"] == summary["pairs_built"]
    state, arch = decode_weights((tmp_path / "dpo" / "policy.safetensors").read_bytes())
    trained = policy_from_arch(arch)
    trained.load_state_dict(state)

    # Fresh held-out data, never replayed: the trained policy prefers its winners too.
    rng, gen = np.random.default_rng(1234), torch.Generator().manual_seed(1234)
    fresh = [sample_batch(behaviour, rng, gen, s) for s in range(4)]
    pairs, _ = pair_segments([s for b in fresh for s in build_segments(b, SEG)[0]])

    def margin(policy) -> torch.Tensor:
        ow = torch.from_numpy(np.stack([w.obs for w, _ in pairs], 1))
        aw = torch.from_numpy(np.stack([w.act for w, _ in pairs], 1))
        ol = torch.from_numpy(np.stack([l.obs for _, l in pairs], 1))
        al = torch.from_numpy(np.stack([l.act for _, l in pairs], 1))
        with torch.no_grad():
            return segment_log_prob(policy, ow, aw, None) - segment_log_prob(policy, ol, al, None)

    gain = margin(trained) - margin(behaviour)
    assert float((gain > 0).float().mean()) > 0.8
    # Its mean action now points at the target (the behaviour's mean was 0 everywhere).
    obs = torch.randn(512, OBS, generator=gen)
    mean = trained.act(obs, deterministic=True)[0][:, 0]
    assert float(torch.corrcoef(torch.stack([mean, obs @ torch.from_numpy(W)]))[0, 1]) > 0.8


def test_without_the_behaviour_version_the_reference_is_fresh(events, pv, tmp_path):
    policy = pv.make_policy(0, OBS, ACT, hidden=(16, 16))  # generated the data, never published
    record(events, policy, 4, version=7)
    summary = run_replay(events, segment=SEG, train=True, epochs=2, out=tmp_path, hidden=(8,))
    ref = summary["dpo"]["reference"]
    assert ref["source"] == "fresh" and "version 7" in ref["why_not_version"]
    assert (tmp_path / "policy.safetensors").exists()


def test_train_without_pairs_is_a_clear_error(events, tmp_path):
    with pytest.raises(ValueError, match="0 preference pair"):
        run_replay(events, segment=SEG, train=True, out=tmp_path)


def test_a_claim_checked_reference_version_loads_from_the_blob_store(events, tmp_path, redis_server_url):  # noqa: F811
    """The behaviour version's weights went by claim check: with the store, replay takes it as
    the DPO reference; without one it falls back to a fresh policy and says why."""
    policy = Policy(OBS, ACT, hidden=(16, 16))
    store = RedisBlobStore(redis_server_url)
    publish_policy_version(events, make_policy_version(policy, policy_id="policy", version=5, parent_version=None,
                                                       learner_id="L", algo="ppo", blob_store=store,
                                                       claim_check_above=0))
    record(events, policy, 4, version=5)
    summary = run_replay(events, segment=SEG, train=True, epochs=2, out=tmp_path / "with", blob_store=store)
    assert summary["dpo"]["reference"] == {"source": "rl.policy.versions", "version": 5}
    without = run_replay(events, segment=SEG, train=True, epochs=2, out=tmp_path / "without")
    assert without["dpo"]["reference"]["source"] == "fresh"
    assert "no blob store" in without["dpo"]["reference"]["why_not_version"]
