"""PreparedBatch events -> TrajectoryBatch: ragged group-mode fragments, group ids across actors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agents.base import rollout_mask
from learner.batching import StreamIds, to_trajectory_batch
from schemas.events import PreparedBatch, SampleBatch, new_id, now_ms

OBS, ACT = 3, 1


def fragment(T: int, N: int, actor: str = "actor-0", group_ids=None, ends: dict | None = None,
             rng=np.random.default_rng(0)) -> PreparedBatch:
    term = np.zeros((T, N), bool)
    for n, t in (ends or {}).items():
        term[t, n] = True
    sb = SampleBatch(
        batch_id=new_id(), actor_id=actor, seq=0, env_id="Pendulum-v1", policy_version=0, created_at_ms=now_ms(),
        obs=rng.normal(size=(T, N, OBS)).astype(np.float32), actions=rng.normal(size=(T, N, ACT)).astype(np.float32),
        rewards=np.ones((T, N), np.float32), terminated=term, truncated=np.zeros((T, N), bool),
        behaviour_logp=np.full((T, N), -1.0, np.float32), last_obs=rng.normal(size=(N, OBS)).astype(np.float32),
        final_obs_index=np.zeros(0, np.int64), final_obs=np.zeros((0, OBS), np.float32),
        group_ids=None if group_ids is None else np.asarray(group_ids, np.int64),
    )
    ones = np.ones((T, N), np.float32)
    return PreparedBatch(sb, 0, 0, 0, ones, ones, now_ms())


def test_equal_length_fragments_have_no_mask():
    tb = to_trajectory_batch([fragment(5, 2), fragment(5, 3)], StreamIds())
    assert tb.mask is None and tuple(tb.obs.shape) == (5, 5, OBS)


def test_ragged_group_fragments_are_padded_masked_and_cut_as_truncations():
    short = fragment(3, 2, group_ids=[0, 0], ends={0: 1})  # column 1 never ended: cut at step 2
    long = fragment(6, 2, group_ids=[0, 0], ends={0: 5, 1: 5})
    tb = to_trajectory_batch([short, long], StreamIds())
    assert tuple(tb.obs.shape) == (6, 4, OBS)
    assert tb.mask[:, :2].sum(0).tolist() == [3, 3] and bool(tb.mask[:, 2:].all())
    assert float(tb.rewards[3:, :2].abs().sum()) == 0.0
    # an episode cut by the fragment's end is truncated at its last real step (column 0's second
    # episode too), bootstrapping from the fragment's last_obs; the long fragment is untouched
    assert tb.truncated[:, 1].tolist() == [False, False, True, False, False, False]
    assert tb.truncated[2, 0] and not bool(tb.truncated[:, 2:].any())
    np.testing.assert_array_equal(tb.next_obs_final[2, 1].numpy(), short.sample.last_obs[1])
    # group algorithms see each rollout up to its end, never the padding
    m = rollout_mask(tb.terminated, tb.truncated, tb.mask)
    assert m.sum(0).tolist() == [2, 3, 6, 6]


def test_group_ids_are_renumbered_so_actors_never_share_a_group():
    a = fragment(4, 4, "actor-0", group_ids=[7, 7, 8, 8])
    b = fragment(4, 4, "actor-1", group_ids=[7, 7, 8, 8])  # same ids from another actor's counter
    tb = to_trajectory_batch([a, b], StreamIds())
    assert tb.group_id.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert to_trajectory_batch([a, fragment(4, 4)], StreamIds()).group_id is None


def test_group_algorithms_train_on_ragged_batches_and_ignore_the_padding():
    import dataclasses

    from agents.registry import make_algorithm

    frags = [fragment(3, 4, group_ids=[0, 0, 0, 0], ends={0: 0, 1: 1, 2: 2, 3: 2}),
             fragment(8, 4, group_ids=[1, 1, 1, 1], ends={0: 7, 1: 3, 2: 5, 3: 7})]
    tb = to_trajectory_batch(frags, StreamIds())
    garbage = dataclasses.replace(tb, obs=tb.obs.clone(), actions=tb.actions.clone())
    garbage.obs[3:, :4] = 50.0  # whatever fills the padding must not reach the loss or the normaliser
    garbage.actions[3:, :4] = -7.0
    for algo in ("grpo", "dapo"):
        a, b = make_algorithm(algo, OBS, ACT), make_algorithm(algo, OBS, ACT)
        m = a.update(tb)
        b.update(garbage)
        assert np.isfinite(m["loss_total"]) and m["columns_used"] == 8
        for (name, x), y in zip(a.policy.state_dict().items(), b.policy.state_dict().values()):
            torch.testing.assert_close(x, y, msg=f"{algo}: {name} depends on the padding")


def step_fragment(T: int, N: int, seed: int, terminate: dict | None = None, truncate: dict | None = None,
                  actor: str = "actor-0") -> PreparedBatch:
    """A step-mode fragment (no group ids) with episodes terminated/truncated at {column: step}."""
    rng = np.random.default_rng(seed)
    term, trunc = np.zeros((T, N), bool), np.zeros((T, N), bool)
    for n, t in (terminate or {}).items():
        term[t, n] = True
    for n, t in (truncate or {}).items():
        trunc[t, n] = True
    t_idx, n_idx = np.nonzero(trunc)
    sb = SampleBatch(
        batch_id=new_id(), actor_id=actor, seq=seed, env_id="Pendulum-v1", policy_version=0, created_at_ms=now_ms(),
        obs=rng.normal(size=(T, N, OBS)).astype(np.float32), actions=rng.normal(size=(T, N, ACT)).astype(np.float32),
        rewards=rng.normal(size=(T, N)).astype(np.float32), terminated=term, truncated=trunc,
        behaviour_logp=np.full((T, N), -1.0, np.float32), last_obs=rng.normal(size=(N, OBS)).astype(np.float32),
        final_obs_index=(t_idx * N + n_idx).astype(np.int64),
        final_obs=rng.normal(size=(len(t_idx), OBS)).astype(np.float32),
    )
    ones = np.ones((T, N), np.float32)
    return PreparedBatch(sb, 0, 0, 0, ones, ones, now_ms())


MIXED = [  # lengths 16..64, episodes that end by termination, by truncation, and that run past the end
    dict(T=16, N=2, seed=1, terminate={0: 5}),
    dict(T=64, N=3, seed=2, truncate={1: 40}, terminate={2: 63}),
    dict(T=33, N=1, seed=3, truncate={0: 32}),
    dict(T=48, N=2, seed=4, terminate={1: 10}, truncate={0: 20}),
]


@pytest.mark.parametrize("bootstrap_on_truncation", [True, False])
def test_mixed_length_fragments_keep_their_own_returns_and_advantages(bootstrap_on_truncation):
    from agents.networks import Policy
    from agents.ppo.learning import bootstrap_values
    from agents.ppo.losses import compute_gae

    torch.manual_seed(0)
    policy = Policy(OBS, ACT)

    def gae(tb):
        values, last, final = bootstrap_values(policy, tb, bootstrap_on_truncation)
        return compute_gae(tb.rewards, values, tb.terminated, tb.truncated, last, final, 0.99, 0.95)

    frags = [step_fragment(**f) for f in MIXED]
    tb = to_trajectory_batch(frags, StreamIds())
    T = max(f["T"] for f in MIXED)
    assert tuple(tb.obs.shape) == (T, sum(f["N"] for f in MIXED), OBS)
    adv, ret = gae(tb)
    col = 0
    for f, frag in zip(MIXED, frags):
        alone_adv, alone_ret = gae(to_trajectory_batch([frag], StreamIds()))
        cols, rows = slice(col, col + f["N"]), slice(T - f["T"], T)
        assert bool(tb.mask[rows, cols].all()) and not bool(tb.mask[: T - f["T"], cols].any())
        torch.testing.assert_close(adv[rows, cols], alone_adv, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ret[rows, cols], alone_ret, rtol=1e-5, atol=1e-5)
        col += f["N"]


@pytest.mark.parametrize("algo", ["ppo", "agro", "tba"])
def test_step_algorithms_train_on_mixed_lengths_and_ignore_the_padding(algo):
    import dataclasses

    from agents.registry import make_algorithm

    frags = [step_fragment(**f) for f in MIXED]
    tb = to_trajectory_batch(frags, StreamIds())
    pad = ~tb.mask
    garbage = dataclasses.replace(tb, obs=tb.obs.clone(), actions=tb.actions.clone(), rewards=tb.rewards.clone(),
                                  terminated=tb.terminated | pad)
    garbage.obs[pad] = 50.0  # whatever fills the padding must not reach returns, losses or normalisers
    garbage.actions[pad] = -7.0
    garbage.rewards[pad] = 100.0
    quick = {"update_epochs": 1, "num_minibatches": 2}
    a, b = make_algorithm(algo, OBS, ACT, quick), make_algorithm(algo, OBS, ACT, quick)
    m = a.update(tb)
    b.update(garbage)
    assert np.isfinite(m["loss_total"])
    assert m.get("num_samples", tb.mask.sum()) == int(tb.mask.sum()) == sum(f["T"] * f["N"] for f in MIXED)
    for (name, x), y in zip(a.state_dict()["policy"].items(), b.state_dict()["policy"].values()):
        torch.testing.assert_close(x, y, msg=f"{algo}: {name} depends on the padding")


def test_reward_scaler_skips_padded_steps():
    from agents.normalization import RewardScaler

    rng = np.random.default_rng(0)
    r = torch.as_tensor(rng.normal(size=(20, 3)), dtype=torch.float32)
    term = torch.zeros(20, 3, dtype=torch.bool)
    term[7, 1] = True
    padded_r, padded_t = torch.zeros(32, 3), torch.zeros(32, 3, dtype=torch.bool)
    padded_r[12:], padded_t[12:] = r, term
    padded_r[:12] = 9.0
    mask = torch.zeros(32, 3, dtype=torch.bool)
    mask[12:] = True
    a, b = RewardScaler(), RewardScaler()
    torch.testing.assert_close(b(padded_r, padded_t, mask=mask)[12:], a(r, term))
    sa, sb = a.state_dict(), b.state_dict()
    torch.testing.assert_close(sa["stream_returns"], sb["stream_returns"])
    for k in sa["rms"]:
        torch.testing.assert_close(sa["rms"][k], sb["rms"][k])
