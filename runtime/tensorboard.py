"""TensorBoard event files under CleanRL's chart names, one TensorBoard run per role.

Actors write ``charts/episodic_return``, ``charts/episodic_length`` and ``charts/SPS`` against
environment steps; the learner writes ``losses/*`` (``losses/policy_loss``, ``losses/value_loss``,
``losses/entropy``, ``losses/approx_kl``, ``losses/clipfrac``, ``losses/explained_variance``, and
every other update metric under its own name), ``charts/learning_rate`` and ``charts/SPS``
(samples trained per second). Prometheus stays the operational view; this is the learning one.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Mapping

#: Update-metric names of the algorithms -> CleanRL's chart names.
CLEANRL_NAMES = {
    "loss_policy": "losses/policy_loss",
    "loss_value": "losses/value_loss",
    "loss_entropy": "losses/entropy",
    "entropy": "losses/entropy",
    "approx_kl": "losses/approx_kl",
    "old_approx_kl": "losses/old_approx_kl",
    "clipfrac": "losses/clipfrac",
    "explained_variance": "losses/explained_variance",
    "learning_rate": "charts/learning_rate",
}


def chart_name(metric: str) -> str:
    """CleanRL's chart name of an update metric (``losses/<metric>`` when it has none)."""
    return CLEANRL_NAMES.get(metric, f"losses/{metric}")


class TensorBoardRun:
    """The TensorBoard run ``<log_dir>/<run_id>/<role>``; every method is a no-op when
    ``log_dir`` is None (``--tensorboard off``)."""

    def __init__(self, log_dir: str | Path | None, run_id: str, role: str) -> None:
        self.path = Path(log_dir) / run_id / role if log_dir else None
        self._writer = None
        if self.path is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.path), flush_secs=10)
        self._sps_t = time.perf_counter()
        self._sps_step = 0

    def episodes(self, step: int, returns: list[float], lengths: list[int]) -> None:
        if self._writer is None:
            return
        for r, n in zip(returns, lengths):
            self._writer.add_scalar("charts/episodic_return", float(r), step)
            self._writer.add_scalar("charts/episodic_length", int(n), step)

    def sps(self, step: int) -> None:
        """``charts/SPS``: steps per second since the previous call."""
        now = time.perf_counter()
        if self._writer is not None and now > self._sps_t and step > self._sps_step:
            self._writer.add_scalar("charts/SPS", (step - self._sps_step) / (now - self._sps_t), step)
        self._sps_t, self._sps_step = now, step

    def losses(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._writer is None:
            return
        for k, v in metrics.items():
            if isinstance(v, (int, float)):
                self._writer.add_scalar(chart_name(k), float(v), step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
