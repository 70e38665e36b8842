"""The captured update: one minibatch step -- forward, loss, backward, grad clip and Adam -- compiled
as a whole with ``torch.compile``, one graph per input signature (shapes, dtypes, which optional
inputs are present).

Shapes never recompile silently per step: each new signature compiles once (counted, its time
kept apart in ``compile_s``), up to ``max_shapes``; a signature past the cap (a ragged last
minibatch, a new batch size after the cap was reached) runs the same step eagerly and is counted
in ``eager_steps``. A compile that fails (no C++ compiler on the host, an op the compiler cannot
take) is warned of once, counted in ``compile_failures``, and that step and every later one run
eagerly: the run goes on with the same update. ``pays_to_capture`` is the "auto" rule of
``TrainConfig.learner.compile_update``.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from config.algos import algo_defaults

__all__ = ["CaptureStats", "CapturedStep", "signature", "pays_to_capture"]

#: The auto rule wants a run of this many times its break-even (the compile then costs at most half
#: of what it saves).
CAPTURE_MARGIN = 2


@dataclass
class CaptureStats:
    """What the captured update did: graphs compiled, their compile seconds, steps by path."""

    compiles: int = 0
    compile_s: float = 0.0
    captured_steps: int = 0
    eager_steps: int = 0
    """Steps run eagerly: their signature was new past ``max_shapes``, or the compiler failed."""
    compile_failures: int = 0
    """Compiles that raised; from the first, every step runs eagerly."""

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}


def signature(args: tuple[Any, ...]) -> tuple:
    """What a compiled graph is specialised on: each tensor's shape, dtype and device; None."""
    return tuple((tuple(a.shape), a.dtype, a.device) if isinstance(a, Tensor) else (type(a).__name__, a) for a in args)


class CapturedStep:
    """``body(*tensors)`` compiled per signature, at most ``max_shapes`` of them (see module doc)."""

    def __init__(self, body: Callable[..., Any], stats: CaptureStats, max_shapes: int = 8, mode: Optional[str] = None,
                 backend: str = "inductor"):
        self.body = body
        self.stats = stats
        self.max_shapes = int(max_shapes)
        self.compiled = torch.compile(body, dynamic=False, mode=mode, backend=backend)
        self.seen: set[tuple] = set()
        self.failed: str | None = None
        limit = max(64, 4 * self.max_shapes)  # every algorithm instance compiles its own graphs
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, limit)
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 8 * limit)

    def __call__(self, *args: Any) -> Any:
        sig = signature(args)
        if sig in self.seen:
            self.stats.captured_steps += 1
            return self.compiled(*args)
        if len(self.seen) >= self.max_shapes or self.failed is not None:
            self.stats.eager_steps += 1
            return self.body(*args)
        t0 = time.perf_counter()
        try:
            out = self.compiled(*args)
        except Exception as e:  # noqa: BLE001 - the compiler's failure, not the step's: go eager
            # a graph that failed to compile never ran, and the body zeroes the gradients first,
            # so running the whole step eagerly now is the same update
            self.failed = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
            self.stats.compile_failures += 1
            self.stats.eager_steps += 1
            warnings.warn(f"the captured update could not be compiled ({self.failed}); it runs eagerly "
                          "(--learner.compile-update False skips the attempt)", RuntimeWarning, stacklevel=2)
            return self.body(*args)
        if any(isinstance(a, Tensor) and a.is_cuda for a in args):
            torch.cuda.synchronize()
        self.stats.compile_s += time.perf_counter() - t0
        self.stats.compiles += 1
        self.stats.captured_steps += 1
        self.seen.add(sig)
        return out


def pays_to_capture(algo: str, device: str, optimizer_steps: int, ranks: int = 1) -> bool:
    """The "auto" rule: capture a run whose optimizer steps reach ``CAPTURE_MARGIN`` times its
    algorithm's break-even (``config.algos`` row, ``capture_break_even_steps``: set for the
    algorithms measured to gain, PPO and AGRO), on one rank (data-parallel ranks all-reduce from
    gradient hooks, which stay eager)."""
    del device  # the CPU's figures on CUDA too, until a GPU run measures them (bench/gpu_check.py)
    even = algo_defaults(algo).capture_break_even_steps
    return ranks == 1 and even is not None and optimizer_steps >= CAPTURE_MARGIN * even
