"""The run config file (``<run-dir>/config.json``): ``{"schema": N, "config": {...}}``, written
once by ``rlstream train --mode decoupled`` and read by every child; ``config.train`` maps it to
``TrainConfig``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

#: Version of the layout; readers refuse any other.
CONFIG_SCHEMA = 1
#: The config file in a run directory.
CONFIG_FILE = "config.json"


def write_run_config(config: dict[str, Any], path: str | Path) -> Path:
    """Write ``config`` under the current schema, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # two writers never share a temp file
    tmp.write_text(json.dumps({"schema": CONFIG_SCHEMA, "config": config}, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


def read_run_config(path: str | Path) -> dict[str, Any]:
    """The ``config`` mapping of a config file; ``ValueError`` naming the file if it is unusable."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"config file {path}: {e}") from None
    if not isinstance(doc, dict) or doc.get("schema") != CONFIG_SCHEMA or not isinstance(doc.get("config"), dict):
        raise ValueError(f"config file {path}: not a schema {CONFIG_SCHEMA} run config "
                         f"(schema {doc.get('schema') if isinstance(doc, dict) else None!r})")
    return doc["config"]
