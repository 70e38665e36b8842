"""Dynamic fragment length of an off-policy decoupled actor, 32..256 steps per env, driven by
the stream processors' backlog (``actor.flow.Backpressure``; reported as ``rlstream_fragment_length``).
Pure: no I/O, no clock. (It sizes what an actor sends per SampleBatch; the learner's minibatch is ``learner.minibatch``.)

Why it moves:

* **Grow when a backlog builds.** Every SampleBatch has a fixed cost (an event, a record, a
  reorder and staleness check, a commit). When batches queue up faster than the processors
  drain them, longer fragments amortise that cost over more samples.
* **Shrink when the queue is near empty.** With nothing waiting, a long fragment only delays
  the samples (and their policy version) reaching the learner: staleness goes up for no
  throughput gain. Short fragments keep the data fresh.
* **Respect a step-time budget (optional).** A step that takes longer than
  ``max_step_s`` delays every policy version. The controller does not grow if
  the next size is predicted to exceed the budget (the step time seen at that
  size, or linear extrapolation if never seen), and shrinks if the budget is
  exceeded.

How (multiplicative steps along a ladder of sizes, with hysteresis):

The load signal is the backlog measured in batches: ``ratio = backlog / size``
(smoothed with an EWMA). Grow one rung when ``ratio >= grow_at``, shrink one
rung when ``ratio <= shrink_at``; a decision must hold for ``patience``
consecutive updates, and after a change the controller waits ``cooldown``
updates for the signal to reflect it. The default ladder is powers of two
(32, 64, 128, 256): reaching 256 from 32 takes three changes, where additive
steps of 32 would take seven. The thresholds satisfy, for each rung pair
``a < b``, ``shrink_at * b / a < grow_at`` (checked), so for a steady backlog
a change can never immediately trigger the opposite change: after growing
``a -> b`` the ratio becomes ``ratio * a / b >= grow_at * a / b > shrink_at``,
and after shrinking ``b -> a`` it becomes ``ratio * b / a <= shrink_at * b / a
< grow_at``. No oscillation with a steady signal.

Usage in the actor's flow control::

    ctl = FragmentSizeController()
    while running:
        size = ctl.update(backlog=processor_backlog_batches, step_time_s=last_step_s)
        metrics.set_fragment_length(size)
        fragment = collect(size)
        ...
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["FragmentSizeController", "DEFAULT_SIZES"]

#: Default ladder: powers of two between 32 and 256.
DEFAULT_SIZES: tuple[int, ...] = (32, 64, 128, 256)


class FragmentSizeController:
    """Chooses the next batch size from backlog and step time.

    Args:
        sizes: allowed batch sizes, strictly increasing (default 32, 64, 128, 256).
        initial: starting size (default the smallest).
        grow_at: grow when the smoothed backlog is at least this many batches.
        shrink_at: shrink when the smoothed backlog is at most this many batches.
        patience: consecutive updates a decision must hold before acting.
        cooldown: updates to ignore after a change (let the signal catch up).
        smoothing: EWMA weight of the newest observation, in (0, 1].
        max_step_s: optional step-time budget in seconds (see module docstring).
    """

    def __init__(
        self,
        sizes: Sequence[int] = DEFAULT_SIZES,
        initial: int | None = None,
        grow_at: float = 4.0,
        shrink_at: float = 0.5,
        patience: int = 3,
        cooldown: int = 5,
        smoothing: float = 0.3,
        max_step_s: float | None = None,
    ) -> None:
        ladder = tuple(int(s) for s in sizes)
        if not ladder or any(s <= 0 for s in ladder):
            raise ValueError("sizes must be positive")
        if any(b <= a for a, b in zip(ladder, ladder[1:])):
            raise ValueError("sizes must be strictly increasing")
        if not 0 <= shrink_at < grow_at:
            raise ValueError("need 0 <= shrink_at < grow_at")
        for a, b in zip(ladder, ladder[1:]):
            if shrink_at * b / a >= grow_at:
                raise ValueError(
                    f"shrink_at * {b}/{a} must be < grow_at, or sizes {a}<->{b} would oscillate"
                )
        if patience < 1 or cooldown < 0:
            raise ValueError("patience must be >= 1 and cooldown >= 0")
        if not 0 < smoothing <= 1:
            raise ValueError("smoothing must be in (0, 1]")
        if max_step_s is not None and max_step_s <= 0:
            raise ValueError("max_step_s must be positive")
        start = ladder[0] if initial is None else int(initial)
        if start not in ladder:
            raise ValueError(f"initial size {start} is not one of {ladder}")

        self.sizes = ladder
        self.grow_at = grow_at
        self.shrink_at = shrink_at
        self.patience = patience
        self.cooldown = cooldown
        self.smoothing = smoothing
        self.max_step_s = max_step_s
        self._idx = ladder.index(start)
        self._backlog: float | None = None
        self._step_s: dict[int, float] = {}  # EWMA of step time seen at each size
        self._pending = 0  # +1 grow / -1 shrink / 0 none
        self._streak = 0
        self._cooldown_left = 0
        self.changes = 0

    @property
    def size(self) -> int:
        return self.sizes[self._idx]

    def update(self, backlog: float, step_time_s: float | None = None) -> int:
        """Feed one observation (samples waiting; duration of the last step) and get the size.

        ``step_time_s`` is attributed to the current size: pass the time of a
        step taken at ``self.size``.
        """
        backlog = float(backlog)
        if math.isnan(backlog) or backlog < 0:
            raise ValueError(f"backlog must be >= 0, got {backlog}")
        a = self.smoothing
        self._backlog = backlog if self._backlog is None else a * backlog + (1 - a) * self._backlog
        if step_time_s is not None:
            if step_time_s < 0 or math.isnan(step_time_s):
                raise ValueError(f"step_time_s must be >= 0, got {step_time_s}")
            prev = self._step_s.get(self.size)
            self._step_s[self.size] = step_time_s if prev is None else a * step_time_s + (1 - a) * prev

        if self._cooldown_left > 0:
            self._cooldown_left -= 1
            return self.size

        want = self._decide()
        if want != 0 and want == self._pending:
            self._streak += 1
        else:
            self._pending, self._streak = want, (1 if want else 0)
        if want != 0 and self._streak >= self.patience:
            self._idx += want
            self.changes += 1
            self._pending, self._streak = 0, 0
            self._cooldown_left = self.cooldown
        return self.size

    def _decide(self) -> int:
        assert self._backlog is not None
        size = self.size
        ratio = self._backlog / size
        over_budget = (
            self.max_step_s is not None
            and size in self._step_s
            and self._step_s[size] > self.max_step_s
        )
        if over_budget and self._idx > 0:
            return -1
        if ratio >= self.grow_at and self._idx < len(self.sizes) - 1 and self._next_fits():
            return +1
        if ratio <= self.shrink_at and self._idx > 0:
            return -1
        return 0

    def _next_fits(self) -> bool:
        """Would a step at the next size stay within ``max_step_s``?"""
        if self.max_step_s is None:
            return True
        nxt = self.sizes[self._idx + 1]
        if nxt in self._step_s:
            predicted = self._step_s[nxt]
        elif self.size in self._step_s:
            # Linear in batch size: an upper bound, since the fixed cost does not grow.
            predicted = self._step_s[self.size] * nxt / self.size
        else:
            return True
        return predicted <= self.max_step_s
