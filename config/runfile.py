"""The run config file (``<run-dir>/config.json``): ``{"schema": N, "config": {...}}``, written
once by ``rlstream train --mode decoupled`` and read by every child; ``config.train`` maps it to
``TrainConfig``."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

#: Version of the layout; readers refuse any other.
CONFIG_SCHEMA = 1
#: The config file in a run directory.
CONFIG_FILE = "config.json"


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temp file of this process and call and a rename, so a
    reader sees the old file or the new one, never half of one, and two writers never share a
    temp file. The one atomic write of a run's files (``runtime.rundir.write_json_atomic`` is
    its JSON form); it lives here, in the bottom layer, so the run config file can use it too."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_run_config(config: dict[str, Any], path: str | Path) -> Path:
    """Write ``config`` under the current schema, atomically."""
    return write_text_atomic(path, json.dumps({"schema": CONFIG_SCHEMA, "config": config}, indent=2,
                                              sort_keys=True) + "\n")


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
