"""Importance weights of behaviour vs current policy: truncated V-trace rho / c and a behaviour cap.

With ``log_ratio = logp_current - logp_behaviour`` per transition (computed in log space):

* ``rho = min(rho_bar, exp(log_ratio))`` and ``c = min(c_bar, exp(log_ratio))`` (V-trace,
  Espeholt et al. 2018; defaults 1.0);
* AReaL-style behaviour-weight cap: a transition whose raw ratio exceeds ``behaviour_cap``
  is masked (rho = c = 0) and counted -- its behaviour policy is too far from the current one
  to be corrected by truncation;
* a non-finite log ratio (NaN/inf from either policy) is masked and counted as well.

The rule itself is ``agents.vtrace.importance_weights``: the learner's decoupled PPO, AGRO and
TBA apply the same function (and the same defaults) against the policy that anchors their
update, so the stream processor and the learner cannot disagree on what is dropped.

Weights are exactly 1 when the behaviour version is the current version (``ones``); the
current policy's log-probs come from an injected ``LogpFn``, built by an injected ``LogpFactory``
(the composition root passes ``streams.policies.PolicyLogpFn.factory(blob_store)``, the one
policy loader, inline or claim-checked). This module imports no policy layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from schemas.events import PolicyVersion, SampleBatch

__all__ = ["ImportanceResult", "ImportanceWeights", "LogpFactory", "LogpFn"]

#: ``logp_fn(obs [T, N, obs_dim], actions [T, N, act_dim]) -> logp [T, N]`` of the current policy.
LogpFn = Callable[[np.ndarray, np.ndarray], np.ndarray]


class LogpFactory(Protocol):
    def __call__(self, pv: PolicyVersion) -> LogpFn: ...


@dataclass(frozen=True, slots=True)
class ImportanceResult:
    rho: np.ndarray  # float32 [T, N]
    c: np.ndarray  # float32 [T, N]
    computed: bool  # False: on-policy, weights are exactly 1
    capped: int = 0  # transitions masked by the behaviour cap
    nonfinite: int = 0  # transitions masked because the log ratio was not finite
    mean_log_ratio: float = 0.0  # over finite transitions
    max_log_ratio: float = 0.0


class ImportanceWeights:
    """Truncated importance weights (see the module docstring).

    Args:
        rho_bar: truncation of rho (V-trace rho-bar); ``math.inf`` for none.
        c_bar: truncation of c (V-trace c-bar).
        behaviour_cap: mask transitions with ratio above this (None: no cap). Must be >= 1.
        max_log_ratio: log ratios are clamped to +-this before exponentiation (overflow guard).
    """

    def __init__(self, rho_bar: float = 1.0, c_bar: float = 1.0, behaviour_cap: float | None = None,
                 max_log_ratio: float = 20.0) -> None:
        if not (rho_bar > 0 and c_bar > 0):
            raise ValueError("rho_bar and c_bar must be > 0")
        if behaviour_cap is not None and not behaviour_cap >= 1.0:
            raise ValueError("behaviour_cap must be >= 1 (or None)")
        if not max_log_ratio > 0:
            raise ValueError("max_log_ratio must be > 0")
        self.rho_bar = float(rho_bar)
        self.c_bar = float(c_bar)
        self.behaviour_cap = None if behaviour_cap is None else float(behaviour_cap)
        self.max_log_ratio = float(max_log_ratio)

    @staticmethod
    def ones(shape: tuple[int, ...]) -> ImportanceResult:
        w = np.ones(shape, dtype=np.float32)
        return ImportanceResult(w, w, computed=False)

    def from_logps(self, behaviour_logp: np.ndarray, current_logp: np.ndarray) -> ImportanceResult:
        """Weights by ``agents.vtrace.importance_weights``, the cap rule the learner applies too."""
        import torch

        from agents.vtrace import importance_weights

        b = np.asarray(behaviour_logp, dtype=np.float64)
        p = np.asarray(current_logp, dtype=np.float64)
        if b.shape != p.shape:
            raise ValueError(f"current logp shape {p.shape} != behaviour logp shape {b.shape}")
        with np.errstate(invalid="ignore", over="ignore"):
            lr = p - b
        rho, c, capped, nonfinite = importance_weights(
            torch.from_numpy(lr), self.rho_bar, self.c_bar, self.behaviour_cap, self.max_log_ratio)
        finite = ~nonfinite.numpy()
        ok = np.clip(lr[finite], -self.max_log_ratio, self.max_log_ratio)
        mean_lr = float(ok.mean()) if ok.size else 0.0
        max_lr = float(ok.max()) if ok.size else 0.0
        rho32 = rho.numpy().astype(np.float32)
        c32 = rho32 if self.c_bar == self.rho_bar else c.numpy().astype(np.float32)
        return ImportanceResult(rho32, c32, True, int(capped.sum()), int(nonfinite.sum()), mean_lr, max_lr)

    def compute(self, batch: SampleBatch, logp_fn: LogpFn | None, current_version: int) -> ImportanceResult:
        """Weights for ``batch`` under the policy of ``current_version`` (``logp_fn``)."""
        if logp_fn is None or batch.policy_version >= current_version:
            return self.ones(batch.behaviour_logp.shape)
        return self.from_logps(batch.behaviour_logp, logp_fn(batch.obs, batch.actions))

