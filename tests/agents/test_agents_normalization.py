import pytest
import numpy as np
import torch

from agents.normalization import RewardScaler, RunningMeanStd


def test_running_mean_std_matches_numpy_after_several_updates():
    rng = np.random.default_rng(0)
    chunks = [rng.normal(3.0, 2.0, size=(n, 3)) * np.array([1.0, 10.0, 0.1]) for n in (1, 7, 50, 300, 2)]
    rms = RunningMeanStd(shape=(3,))
    for c in chunks:
        rms.update(torch.as_tensor(c, dtype=torch.float32))
    data = np.concatenate(chunks).astype(np.float32).astype(np.float64)
    np.testing.assert_allclose(rms.mean.numpy(), data.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rms.var.numpy(), data.var(0), rtol=1e-5, atol=1e-6)
    assert abs(float(rms.count) - (len(data) + 1e-4)) < 1e-9


def test_running_mean_std_is_order_independent_and_in_state_dict():
    x = torch.randn(100, 4, dtype=torch.float64)
    a, b = RunningMeanStd((4,)), RunningMeanStd((4,))
    a.update(x)
    for i in range(0, 100, 9):
        b.update(x[i : i + 9])
    torch.testing.assert_close(a.mean, b.mean)
    torch.testing.assert_close(a.var, b.var)
    sd = a.state_dict()
    assert set(sd) == {"mean", "var", "count"}
    c = RunningMeanStd((4,))
    c.load_state_dict(sd)
    torch.testing.assert_close(c.normalize(x.float()), a.normalize(x.float()))


def test_normalize_clips_and_keeps_dtype():
    rms = RunningMeanStd((2,))
    rms.update(torch.tensor([[0.0, 0.0], [2.0, 2.0]]))  # mean ~1, var ~1
    y = rms.normalize(torch.tensor([[1.0, 1000.0]]), clip=10.0)
    assert y.dtype == torch.float32
    assert abs(float(y[0, 0])) < 1e-3 and float(y[0, 1]) == 10.0


class _GymLikeNormalizeReward:
    """Step-by-step reference of the wrapper semantics, written independently in numpy."""

    def __init__(self, n, gamma, clip):
        self.ret = np.zeros(n)
        self.gamma, self.clip = gamma, clip
        self.mean, self.var, self.count = 0.0, 1.0, 1e-4

    def step(self, r, term):
        self.ret = self.ret * self.gamma * (1 - term) + r
        bm, bv, bc = self.ret.mean(), self.ret.var(), len(self.ret)
        delta, tot = bm - self.mean, self.count + bc
        self.mean = self.mean + delta * bc / tot
        self.var = (self.var * self.count + bv * bc + delta**2 * self.count * bc / tot) / tot
        self.count = tot
        return np.clip(r / np.sqrt(self.var + 1e-8), -self.clip, self.clip)


def test_reward_scaler_matches_sequential_reference_across_batches():
    rng = np.random.default_rng(1)
    T, N = 40, 3
    ref = _GymLikeNormalizeReward(N, 0.99, 10.0)
    scaler = RewardScaler(gamma=0.99, clip=10.0)
    for _ in range(3):
        r = rng.normal(1.0, 3.0, size=(T, N))
        term = rng.random((T, N)) < 0.1
        expected = np.stack([ref.step(r[t], term[t].astype(np.float64)) for t in range(T)])
        got = scaler(torch.as_tensor(r), torch.as_tensor(term))
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(float(scaler.rms.var), ref.var, rtol=1e-9)


def test_reward_scaler_continues_streams_by_id_and_round_trips():
    scaler = RewardScaler(gamma=0.5, clip=None)
    r = torch.ones(2, 2, dtype=torch.float64)
    term = torch.zeros(2, 2, dtype=torch.bool)
    scaler(r, term, torch.tensor([7, 9]))
    assert scaler._returns == {7: 1.5, 9: 1.5}
    clone = RewardScaler(gamma=0.5, clip=None)
    clone.load_state_dict(scaler.state_dict())
    # columns swapped: stream ids keep the continuity, not the column position
    scaler(torch.tensor([[1.0, 0.0]], dtype=torch.float64), term[:1], torch.tensor([9, 7]))
    assert scaler._returns == {9: 1.75, 7: 0.75}
    out_a = clone(torch.tensor([[1.0, 0.0]], dtype=torch.float64), term[:1], torch.tensor([9, 7]))
    assert clone._returns == scaler._returns
    assert torch.isfinite(out_a).all()


@pytest.mark.parametrize("T", [1, 2, 7, 2048])
def test_reward_scaler_returns_follow_the_masked_recursion(T):
    """G_t = r_t + gamma (1 - term_t) G_{t-1} on valid steps, held on padding, continued from the
    kept G of the previous batch."""
    rng = np.random.default_rng(T)
    N, gamma = 3, 0.97
    scaler = RewardScaler(gamma=gamma, clip=None)
    g = np.zeros(N)
    for _ in range(2):
        r = rng.normal(size=(T, N))
        term = rng.random((T, N)) < 0.05
        valid = rng.random((T, N)) < 0.8
        for t in range(T):
            g = np.where(valid[t], r[t] + gamma * (1 - term[t]) * g, g)
        scaler(torch.as_tensor(r), torch.as_tensor(term), mask=torch.as_tensor(valid))
        np.testing.assert_allclose([scaler._returns[i] for i in range(N)], g, rtol=1e-12, atol=1e-12)
