"""Dynamic minibatch size of the learner, 32..256 transitions, by accelerator load (the
deployment guide's "dynamic batch size"; reported as ``rlstream_batch_size{role=learner}``).
Pure: no I/O, no clock; the learner's shell measures and feeds it.

The signal:

* **With a GPU**, its utilisation (percent, NVML): below ``util_low`` the device waits on the
  host, so grow the minibatch (more work per kernel, fewer launches); above ``util_high`` it
  is saturated, so shrink it (more, cheaper steps; the update does not fall behind the data).
* **Without one**, the learner's duty cycle, ``update_s / interval_s`` (seconds of the last
  update over the seconds from the end of the update before it to its own end): above ``duty_high`` the learner
  is the bottleneck, so grow (fewer optimiser steps per update, cheaper); below ``duty_low`` it
  has room, so shrink (more steps per batch of data).

How: one rung at a time along ``sizes`` (powers of two), a decision must hold for ``patience``
updates, and the thresholds keep a steady load from flapping: with per-step costs dominating,
doubling the size about halves the update time, so ``duty_high / 2 > duty_low`` is checked.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["MinibatchController", "MINIBATCH_SIZES"]

MINIBATCH_SIZES: tuple[int, ...] = (32, 64, 128, 256)


class MinibatchController:
    """Chooses the next update's minibatch size (see the module docstring)."""

    def __init__(self, sizes: Sequence[int] = MINIBATCH_SIZES, initial: int | None = None,
                 duty_low: float = 0.2, duty_high: float = 0.5, util_low: float = 60.0,
                 util_high: float = 80.0, patience: int = 2) -> None:
        self.sizes = tuple(int(s) for s in sizes)
        if not self.sizes or any(a >= b for a, b in zip(self.sizes, self.sizes[1:])) or self.sizes[0] < 1:
            raise ValueError(f"sizes must be strictly increasing and >= 1, got {sizes}")
        if not 0 < duty_low < duty_high / 2:
            raise ValueError(f"need 0 < duty_low < duty_high / 2 (no flapping), got {duty_low}, {duty_high}")
        if not 0 <= util_low < util_high <= 100:
            raise ValueError(f"need 0 <= util_low < util_high <= 100, got {util_low}, {util_high}")
        self.duty_low, self.duty_high = float(duty_low), float(duty_high)
        self.util_low, self.util_high = float(util_low), float(util_high)
        self.patience = max(1, int(patience))
        start = initial if initial is not None else self.sizes[len(self.sizes) // 2 - 1]
        if start not in self.sizes:
            raise ValueError(f"initial {start} is not one of {self.sizes}")
        self.index = self.sizes.index(start)
        self._want = 0  # +1 grow / -1 shrink, held for ``_held`` updates
        self._held = 0
        self.changes = 0

    @property
    def size(self) -> int:
        return self.sizes[self.index]

    def direction(self, update_s: float, interval_s: float, gpu_util: float | None) -> int:
        """+1 grow, -1 shrink, 0 stay, for one update's measurements."""
        if gpu_util is not None:
            return 1 if gpu_util < self.util_low else -1 if gpu_util > self.util_high else 0
        if interval_s <= 0:
            return 0
        duty = update_s / interval_s
        return 1 if duty > self.duty_high else -1 if duty < self.duty_low else 0

    def update(self, update_s: float, interval_s: float, gpu_util: float | None = None) -> int:
        """The size for the next update, after one update that took ``update_s`` of
        ``interval_s`` (the previous update's end to its own end), at ``gpu_util`` percent
        (None: no GPU)."""
        want = self.direction(update_s, interval_s, gpu_util)
        if want == 0 or want != self._want:
            self._want, self._held = want, (1 if want else 0)
        else:
            self._held += 1
        if want and self._held >= self.patience:
            new = min(max(self.index + want, 0), len(self.sizes) - 1)
            if new != self.index:
                self.index = new
                self.changes += 1
            self._want, self._held = 0, 0
        return self.size
