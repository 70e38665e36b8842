"""What the bench scripts share: one timed training run, a private broker, a quiet logger, a
policy of a given size, mean ± std and the curves over seeds, figures, result files and the
host record. Scripts import this module (``from bench.common import ...``, with the repository
root on ``sys.path``) and the project; never ``tests`` nor another script's private names
(``tests/test_bench_imports.py``)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


# --- runs -------------------------------------------------------------------------------------

def timed(run: Callable[..., dict], cfg: Any, **kwargs: Any) -> tuple[dict, float]:
    """``run(cfg, **kwargs)`` (``run_colocated``, ``run_decoupled``): its summary and wall seconds."""
    t0 = time.perf_counter()
    summary = run(cfg, **kwargs)
    return summary, time.perf_counter() - t0


class Quiet:
    """A logger that drops everything (the JSON document is the only output)."""

    def __getattr__(self, name):
        return lambda *a, **k: None


@contextlib.contextmanager
def private_broker() -> Iterator[str]:
    """A one-node Kafka of this bench's own, on free ports, in a throw-away directory: its bootstrap."""
    import socket

    from localkafka.broker import LocalKafka
    from localkafka.probe import port_is_free

    for _ in range(50):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port < 65535 and port_is_free(port + 1):
            break
    with tempfile.TemporaryDirectory() as d:
        kafka = LocalKafka(port=port, data_dir=d, quiet=True, heap=("-Xms128m", "-Xmx512m"))
        kafka.start(timeout=180)
        try:
            yield kafka.bootstrap
        finally:
            kafka.kill()


class DirectPolicy:
    """Feeds an actor one policy object without any event (the peer loop: the learner's live
    policy; bench/rollout.py: a fixed one)."""

    def __init__(self, policy) -> None:
        self.policy, self.version = policy, 0

    def poll(self, timeout: float = 0.0) -> bool:
        return False

    def close(self) -> None:
        pass


#: observation and action sizes of the weight benches' policies (``policy_of_size``)
POLICY_OBS, POLICY_ACT = 64, 8


def policy_of_size(params: int, seed: int = 0):
    """A 2-hidden-layer policy (``POLICY_OBS`` in, ``POLICY_ACT`` out) with about ``params``
    parameters, actor and critic: 2h² + (2·obs + act + 1)·h ≈ params, solved for the width h."""
    import torch

    from agents.networks import Policy

    b = 2 * POLICY_OBS + POLICY_ACT + 1
    h = int((-b + (b ** 2 + 8 * params) ** 0.5) / 4)
    torch.manual_seed(seed)
    return Policy(POLICY_OBS, POLICY_ACT, hidden=(max(h, 1), max(h, 1)))


# --- statistics and curves ------------------------------------------------------------------

def mean_std(xs: Sequence[float | None]) -> dict:
    """``{"mean", "std"}`` (1 decimal) over the values that are not None; ``{}`` without any."""
    xs = [x for x in xs if x is not None]
    return {"mean": round(float(np.mean(xs)), 1), "std": round(float(np.std(xs)), 1)} if xs else {}


def binned_mean(steps: np.ndarray, returns: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """The mean return of the episodes that ended in each bin ``(edges[i], edges[i + 1]]``; NaN
    where none did (average such curves over seeds with ``np.nanmean``)."""
    out = np.full(len(edges) - 1, np.nan)
    for i in range(len(edges) - 1):
        m = (steps > edges[i]) & (steps <= edges[i + 1])
        if m.any():
            out[i] = returns[m].mean()
    return out


def running_mean(xs: Sequence[float], window: int = 20) -> np.ndarray:
    """Running mean over the last ``window`` values (fewer at the start: the first is itself)."""
    c = np.cumsum(np.insert(np.asarray(xs, dtype=float), 0, 0.0))
    n = np.minimum(np.arange(1, len(xs) + 1), window)
    return (c[1:] - c[np.arange(1, len(xs) + 1) - n]) / n


# --- output ----------------------------------------------------------------------------------

def pyplot():
    """``matplotlib.pyplot`` on the file-only backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, **savefig: Any) -> None:
    """Lay ``fig`` out, write it to ``path`` and free it."""
    fig.tight_layout()
    fig.savefig(path, **savefig)
    pyplot().close(fig)


def stop_resource_tracker() -> None:
    """Stop multiprocessing's resource tracker, if this script started one (a spawn pool does),
    and wait for it: left to itself it ends a moment after the script, an orphan by then."""
    from multiprocessing import resource_tracker

    stop = getattr(resource_tracker._resource_tracker, "_stop", None)  # CPython 3.8+
    if stop is not None:
        stop()


def write_json(path: Path, doc: Any) -> None:
    """A result file: ``doc`` as indented JSON, one trailing newline."""
    path.write_text(json.dumps(doc, indent=2) + "\n")


def load_1m() -> float:
    """The machine's 1-minute load average (these figures move with it)."""
    return round(os.getloadavg()[0], 2)


def host_info(**extra: Any) -> dict:
    """The machine a bench ran on: CPUs, Python, torch, and ``extra`` (threads, load...)."""
    import torch

    return {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__, **extra}
