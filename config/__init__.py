"""The bottom layer: every setting of rlstream, typed, and the one reader of the environment.

``config.env.Environment`` reads ``os.environ`` once at an entry point; ``TrainConfig``,
``BusConfig``, ``PrepareConfig`` and the per-algorithm table (``config.algos``) are the typed
settings passed down from there. Imports nothing of rlstream's. The names below load on first
use, so ``config.env`` (standard library only) is importable before the package's dependencies
are installed (``localkafka`` runs so in CI).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Environment": "config.env", "RankEnv": "config.env",
    "AlgoDefaults": "config.algos", "ALGO_DEFAULTS": "config.algos", "TRAINABLE": "config.algos",
    "algo_defaults": "config.algos",
    "BusConfig": "config.bus", "Retention": "config.bus", "Replication": "config.bus", "parse_retention": "config.bus",
    "PrepareConfig": "config.prepare",
    "ObjectStoreConfig": "config.storage",
    "TrainConfig": "config.train", "read_config": "config.train", "write_config": "config.train",
    "ENTRY_POINT_FIELDS": "config.train",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'config' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
