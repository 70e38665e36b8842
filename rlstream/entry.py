"""Process entry points besides ``rlstream.cli``: each reads the environment once
(``config.Environment``) and asks the composition root (``rlstream.wiring``) for its process.

- ``faust_app()``: the app of ``faust -A streams worker`` (``streams.app`` resolves to it, so
  importing ``streams.faust_app`` builds nothing);
- ``streams_worker()``: ``python -m rlstream.entry worker``, the in-process processor shell as a
  process on Kafka. Runs until SIGTERM/SIGINT, then prints one ``{"summary": ...}`` line.

The entry points live here, not in ``__main__`` blocks of the lower layers, so no module below
the composition root imports it (docs/architecture.md).
"""

from __future__ import annotations

import json
import signal
import sys
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
    """``python -m rlstream.entry worker``: settings as the Faust worker's (``StreamsSettings``)."""
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


#: ``python -m rlstream.entry NAME``: the processes started this way
COMMANDS = {"worker": streams_worker}


def main(argv: list[str] | None = None) -> int:
    """``python -m rlstream.entry worker``; anything else prints the usage and returns 2."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in COMMANDS:
        print(f"usage: python -m rlstream.entry {{{','.join(COMMANDS)}}}", file=sys.stderr)
        return 2
    from streams.bus.base import BusAuthenticationError
    from streams.bus.kafka import NoBrokerError

    try:
        return COMMANDS[args[0]]()
    except (BusAuthenticationError, NoBrokerError) as e:  # a setting to fix: one line, exit 2
        print(f"rlstream {args[0]}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        print(f"rlstream {args[0]}: error: {e.code}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
