"""Process entry points besides ``rlstream.cli``: each reads the environment once
(``config.Environment``) and asks the composition root (``rlstream.wiring``) for its process.

- ``faust_app()``: the app of ``faust -A streams worker`` (``streams.app`` resolves to it, so
  importing ``streams.faust_app`` builds nothing);
- ``streams_worker()``: ``python -m streams.worker``, the in-process processor shell as a process
  on Kafka. Runs until SIGTERM/SIGINT, then prints one ``{"summary": ...}`` line.
"""

from __future__ import annotations

import json
import signal
import threading
from typing import Any

_APP: Any = None


def faust_app() -> Any:
    """The Faust app of this process, built on first use from the environment."""
    global _APP
    if _APP is None:
        from config import Environment
        from rlstream.wiring import build_faust_app
        from streams.settings import StreamsSettings

        _APP = build_faust_app(StreamsSettings.from_environment(Environment.read()))
    return _APP.app


def streams_worker() -> int:
    """``python -m streams.worker``: settings as the Faust worker's (``StreamsSettings``)."""
    from config import Environment
    from rlstream.wiring import build_streams_worker
    from streams.settings import StreamsSettings

    worker, bus = build_streams_worker(StreamsSettings.from_environment(Environment.read()))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        worker.run(stop)
    finally:
        bus.close()
    print(json.dumps({"summary": worker.core.summary()}, sort_keys=True, default=str), flush=True)
    return 0
