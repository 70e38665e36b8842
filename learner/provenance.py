"""What a replay of the learner needs, recorded in its own events (``rlstream verify``/``fork``).

Every PolicyVersion a learner publishes carries ``state_sha256`` (digest of its whole state:
weights, optimiser, normalisers, the algorithm's RNG, step) and ``provenance`` (JSON: run id,
algorithm and full config, spaces, determinism settings, and ``fork_of`` for a fork). Every
GradientStep carries ``batch_digests``: the sha256 of each record it trained on. Pure: no I/O,
apart from hashing the ``agents`` package's own sources once (``algorithm_code``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _feed(h: Any, obj: Any) -> None:
    """Hash ``obj`` (nested dicts/lists of tensors, arrays and scalars) in a canonical order."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, np.ndarray):
        h.update(f"A{obj.dtype}{obj.shape}".encode())
        h.update(np.ascontiguousarray(obj).tobytes())
    elif isinstance(obj, dict):
        h.update(b"{")
        for k in sorted(obj, key=repr):
            h.update(repr(k).encode())
            _feed(h, obj[k])
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for x in obj:
            _feed(h, x)
        h.update(b"]")
    else:
        h.update(repr(obj).encode())


def digest(obj: Any) -> str:
    """sha256 hex of a state dict (or any nest of tensors and scalars), canonical and exact."""
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()


def record_digest(value: bytes) -> str:
    """sha256 hex of one encoded record (a GradientStep's ``batch_digests`` entry)."""
    return hashlib.sha256(bytes(value)).hexdigest()


@functools.lru_cache(maxsize=1)
def algorithm_code() -> str:
    """Digest of the ``agents`` package's sources (the update's maths): a replay under other
    algorithm code is not expected to be bit-exact, and ``verify`` names it as the cause."""
    import agents

    root = Path(agents.__file__).parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def determinism(device: str | torch.device) -> dict[str, Any]:
    """The settings a bit-exact replay must match (or report as the cause when it cannot)."""
    return {
        "algorithm_code": algorithm_code(),
        "torch": torch.__version__,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
    }


def provenance(algo: Any, run_id: str, fork_of: dict[str, Any] | None = None,
               train_batch_size: int | None = None) -> str:
    """The ``provenance`` JSON of a PolicyVersion published by a learner holding ``algo``."""
    doc = {
        "run_id": run_id,
        "train_batch_size": train_batch_size,
        "algo": getattr(algo, "name", type(algo).__name__.lower()),
        "config": dataclasses.asdict(algo.config),
        "obs_dim": int(algo.obs_dim),
        "act_dim": int(algo.act_dim),
        "determinism": determinism(getattr(algo, "device", "cpu")),
    }
    if fork_of:
        doc["fork_of"] = dict(fork_of)
    return json.dumps(doc, sort_keys=True)


def stamp(pv: Any, algo: Any, run_id: str, fork_of: dict[str, Any] | None = None,
          train_batch_size: int | None = None) -> Any:
    """``pv`` with the digest of ``algo``'s whole state and its provenance."""
    return dataclasses.replace(pv, state_sha256=digest(algo.state_dict()),
                               provenance=provenance(algo, run_id, fork_of, train_batch_size))


def parse_provenance(text: str) -> dict[str, Any]:
    """The ``provenance`` of a PolicyVersion as a dict ({} for a v1 record or bad JSON)."""
    if not text:
        return {}
    try:
        doc = json.loads(text)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}
