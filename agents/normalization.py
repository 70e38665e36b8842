"""Running statistics used to normalise observations and rewards.

Two pieces:

* ``RunningMeanStd`` -- an ``nn.Module`` whose statistics live in float64
  buffers, so they travel inside ``state_dict()`` together with the policy
  weights. Updates use the parallel (Chan et al.) variance combination, which
  is exact: feeding the data in one call or in many calls gives the same
  mean/var (up to rounding). The prior is ``count=epsilon`` pseudo-samples with
  mean 0 and var 1, the same convention as gymnasium's wrappers.
* ``RewardScaler`` -- learner-side reward scaling by the running standard
  deviation of the gamma-discounted return (the semantics of gymnasium's
  ``NormalizeReward`` wrapper that CleanRL uses), applied to whole time-major
  batches at once.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from agents.scan import discounted_scan

__all__ = ["RunningMeanStd", "RewardScaler"]


class RunningMeanStd(nn.Module):
    """Running mean and (population) variance over the leading axes of the input.

    Args:
        shape: shape of one sample (e.g. ``(obs_dim,)``; ``()`` for scalars).
        epsilon: initial pseudo-count (the prior weight of mean 0 / var 1) and
            the constant added to the variance before the square root.
    """

    mean: Tensor
    var: Tensor
    count: Tensor

    def __init__(self, shape: tuple[int, ...] = (), epsilon: float = 1e-4, var_epsilon: float = 1e-8):
        super().__init__()
        self.shape = tuple(shape)
        self.var_epsilon = float(var_epsilon)
        self.register_buffer("mean", torch.zeros(self.shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(self.shape, dtype=torch.float64))
        self.register_buffer("count", torch.tensor(float(epsilon), dtype=torch.float64))

    @torch.no_grad()
    def update(self, x: Tensor) -> None:
        """Fold a batch of samples ``x[..., *shape]`` into the statistics."""
        x = torch.as_tensor(x, device=self.mean.device).to(torch.float64)
        x = x.reshape(-1, *self.shape)
        if x.shape[0] == 0:
            return
        batch_mean = x.mean(dim=0)
        batch_var = x.var(dim=0, unbiased=False)
        self.update_from_moments(batch_mean, batch_var, x.shape[0])

    @torch.no_grad()
    def update_from_moments(self, batch_mean: Tensor, batch_var: Tensor, batch_count: int | float) -> None:
        """Parallel-variance combination of the current statistics with a batch's moments."""
        batch_mean = batch_mean.to(self.mean)
        batch_var = batch_var.to(self.var)
        total = self.count + batch_count
        delta = batch_mean - self.mean
        new_mean = self.mean + delta * (batch_count / total)
        m2 = self.var * self.count + batch_var * batch_count + delta.pow(2) * (self.count * batch_count / total)
        self.mean.copy_(new_mean)
        self.var.copy_(m2 / total)
        self.count.copy_(total)

    def std(self) -> Tensor:
        """``sqrt(var + var_epsilon)`` in float64."""
        return torch.sqrt(self.var + self.var_epsilon)

    def normalize(self, x: Tensor, clip: Optional[float] = 10.0) -> Tensor:
        """``clamp((x - mean) / sqrt(var + eps), -clip, clip)`` in ``x``'s dtype.

        Does not update the statistics (actors call this; only the learner updates).
        """
        mean = self.mean.to(x.dtype)
        std = self.std().to(x.dtype)
        y = (x - mean) / std
        if clip is not None:
            y = y.clamp(-clip, clip)
        return y

    def forward(self, x: Tensor) -> Tensor:  # pragma: no cover - thin alias
        return self.normalize(x)

    def extra_repr(self) -> str:
        return f"shape={self.shape}"


class RewardScaler:
    """Scale rewards by the running std of the discounted return, then clip.

    Per reward stream (one environment instance) it keeps the running discounted
    return ``G <- G * gamma * (1 - terminated) + r`` (reset on termination only,
    not on truncation -- as gymnasium's ``NormalizeReward`` does), folds every
    ``G`` into a scalar ``RunningMeanStd`` and divides each reward by
    ``sqrt(var + eps)`` *as it was right after that step's update*. The
    per-step semantics are reproduced exactly but vectorised over the whole
    ``[T, N]`` batch with prefix sums and the return recursion by a log-depth
    scan (``agents.scan``), so there is no Python loop over the steps.

    Rewards are *not* centred (only divided), matching the wrapper.

    Streams: the ``stream_ids`` passed with a batch (``[N]`` int64, stable
    identifiers of the env instances behind each column) select which running
    return each column continues. Without ids, column ``i`` is stream ``i``.
    """

    def __init__(self, gamma: float = 0.99, clip: Optional[float] = 10.0, epsilon: float = 1e-8):
        self.gamma = float(gamma)
        self.clip = clip
        self.rms = RunningMeanStd(shape=(), epsilon=1e-4, var_epsilon=epsilon)
        self._returns: dict[int, float] = {}

    @torch.no_grad()
    def __call__(self, rewards: Tensor, terminated: Tensor, stream_ids: Optional[Tensor] = None,
                 mask: Optional[Tensor] = None) -> Tensor:
        """Return scaled (and clipped) rewards ``[T, N]``; updates the statistics. Steps where
        ``mask`` is False (padding) leave the running returns and the statistics as they were."""
        T, N = rewards.shape
        if stream_ids is None:
            ids = list(range(N))
        else:
            ids = [int(i) for i in stream_ids.reshape(-1).tolist()]
            if len(ids) != N:
                raise ValueError(f"stream_ids has {len(ids)} entries, batch has {N} columns")
        r64 = rewards.to(torch.float64)
        not_term = 1.0 - terminated.to(torch.float64)
        g = torch.tensor([self._returns.get(i, 0.0) for i in ids], dtype=torch.float64, device=rewards.device)
        valid = torch.ones_like(r64) if mask is None else mask.to(torch.float64)
        # G_t = r_t + gamma * (1 - term_t) * G_{t-1} where valid, G_{t-1} where not: a forward
        # linear recurrence from the kept G, solved by the backward scan on the reversed batch
        # (the kept G enters as a step before the first, with nothing before it)
        a = torch.cat([g.unsqueeze(0), r64 * valid])
        b = torch.cat([torch.zeros_like(g).unsqueeze(0), torch.where(valid > 0, self.gamma * not_term, 1.0)])
        returns = discounted_scan(a.flip(0), b.flip(0)).flip(0)[1:]
        for i, v in zip(ids, returns[-1].tolist() if T else g.tolist()):
            self._returns[i] = v

        # Prefix statistics: the variance right after step t's update, for every t.
        c0 = self.rms.count.to(rewards.device)
        m0 = self.rms.mean.to(rewards.device)
        v0 = self.rms.var.to(rewards.device)
        y = (returns - m0) * valid
        s1 = torch.cumsum(y.sum(dim=1), dim=0)
        s2 = torch.cumsum(y.pow(2).sum(dim=1), dim=0)
        counts = c0 + torch.cumsum(valid.sum(dim=1), dim=0)
        shift = s1 / counts
        var_t = ((c0 * v0 + s2) / counts - shift.pow(2)).clamp_min(0.0)
        scaled = r64 / torch.sqrt(var_t + self.rms.var_epsilon).unsqueeze(1)
        # Commit the pooled statistics (identical to T sequential updates).
        self.rms.mean.copy_(m0 + shift[-1])
        self.rms.var.copy_(var_t[-1])
        self.rms.count.copy_(counts[-1])
        if self.clip is not None:
            scaled = scaled.clamp(-self.clip, self.clip)
        return scaled.to(rewards.dtype)

    def state_dict(self) -> dict:
        ids = sorted(self._returns)
        return {
            "rms": {k: v.clone() for k, v in self.rms.state_dict().items()},
            "stream_ids": torch.tensor(ids, dtype=torch.int64),
            "stream_returns": torch.tensor([self._returns[i] for i in ids], dtype=torch.float64),
        }

    def load_state_dict(self, d: dict) -> None:
        self.rms.load_state_dict(d["rms"])
        self._returns = {int(i): float(v) for i, v in zip(d["stream_ids"].tolist(), d["stream_returns"].tolist())}
