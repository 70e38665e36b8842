"""Structured logs: JSON lines for the services, a console renderer for the co-located CLI.

Configured once, at the entry point::

    configure_logging(role="learner", run_id=cfg.run_id, level="info", json=True)
    log = get_logger(__name__)
    ...
    bind_policy_version(7)          # every later line in this thread/task carries it
    log.info("step", loss=0.31, sps=5120.0)
    # {"event": "step", "loss": 0.31, "sps": 5120.0, "policy_version": 7,
    #  "run_id": "...", "role": "learner", "level": "info", "timestamp": "..."}

Context:

* ``run_id`` and ``role`` are process-wide defaults, added to every line from
  every thread (including stdlib ``logging`` records from faust, confluent-kafka,
  ...).
* ``policy_version`` (and anything else bound with ``bound_context``) lives in
  ``contextvars``, so it is per thread / asyncio task. In the co-located
  process the actor and learner threads each bind their own version, and
  ``bind_role("actor")`` overrides the process role for one thread. New
  threads start with an empty context: bind in the thread that logs.
"""

from __future__ import annotations

import contextlib
import json as jsonlib
import logging
import sys
import time
import uuid
from collections.abc import Iterator, MutableMapping
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, FilteringBoundLogger, Processor

__all__ = [
    "bind_policy_version",
    "bind_role",
    "bound_context",
    "configure_logging",
    "get_logger",
    "new_run_id",
    "RateLimiter",
]

_HANDLER_MARK = "_rlstream_handler"
# structlog.get_logger() reserves the keyword ``logger``; get_logger() binds the
# name under this key and _logger_field() renames it to ``logger``.
_NAME_KEY = "logger_name"


def _logger_field(logger: Any, method: str, event_dict: EventDict) -> EventDict:
    name = event_dict.pop(_NAME_KEY, None)
    if name is not None:
        event_dict.setdefault("logger", name)
    return event_dict


class _ProcessDefaults:
    """Adds ``run_id`` and ``role`` unless the context already set them."""

    def __init__(self, role: str, run_id: str) -> None:
        self.role = role
        self.run_id = run_id

    def __call__(self, logger: Any, method: str, event_dict: EventDict) -> EventDict:
        event_dict.setdefault("run_id", self.run_id)
        event_dict.setdefault("role", self.role)
        return event_dict


class _Stderr:
    """Writes to whatever ``sys.stderr`` is at each write, not the one at configuration time.

    A command run in-process under a capture (a test's, a notebook's) configures logging
    while ``sys.stderr`` is the capture; once that is closed, later lines must still go
    somewhere open.
    """

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return _isatty(sys.stderr)


def _level_number(level: str | int) -> int:
    if isinstance(level, int):
        return level
    number = logging.getLevelName(level.strip().upper())
    if not isinstance(number, int):
        raise ValueError(f"unknown log level {level!r}")
    return number


def new_run_id() -> str:
    """A fresh run identifier (12 hex characters)."""
    return uuid.uuid4().hex[:12]


def configure_logging(
    role: str,
    run_id: str,
    level: str | int = "info",
    json: bool = True,
    *,
    stream: TextIO | None = None,
    capture_stdlib: bool = True,
) -> None:
    """Configure structlog (and optionally the stdlib root logger) for this process.

    Args:
        role: default ``role`` field (``actor``, ``streams``, ``learner``, ``serve``,
            ``colocated``).
        run_id: ``run_id`` field on every line.
        level: minimum level, name or ``logging`` number.
        json: one JSON object per line (services); ``False`` gives the human
            console renderer (co-located CLI).
        stream: where lines go; by default the current ``sys.stderr`` at each write.
        capture_stdlib: route stdlib ``logging`` records (third-party libraries)
            through the same renderer and context.

    Calling it again replaces the configuration (tests do).
    """
    lvl = _level_number(level)
    out: TextIO = stream if stream is not None else _Stderr()  # type: ignore[assignment]
    defaults = _ProcessDefaults(role, run_id)
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        _logger_field,
        defaults,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: Processor
    if json:
        shared.append(structlog.processors.format_exc_info)
        renderer = structlog.processors.JSONRenderer(serializer=jsonlib.dumps, default=str)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=_isatty(out))

    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        context_class=dict,
        logger_factory=structlog.WriteLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )

    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, _HANDLER_MARK, False):
            root.removeHandler(handler)
    if capture_stdlib:
        handler = logging.StreamHandler(out)
        setattr(handler, _HANDLER_MARK, True)
        handler.setFormatter(
            structlog.stdlib.ProcessorFormatter(
                foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
                processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            )
        )
        root.addHandler(handler)
        root.setLevel(lvl)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def get_logger(name: str | None = None, **initial: Any) -> FilteringBoundLogger:
    """A structlog logger; ``name`` becomes the ``logger`` field."""
    # A lazy proxy: it follows configure_logging() even when created at import time.
    if name is not None:
        initial.setdefault(_NAME_KEY, name)
    log: FilteringBoundLogger = structlog.get_logger(**initial)
    return log


def bind_policy_version(version: int | None) -> None:
    """Set the ``policy_version`` field for this thread / task (``None`` removes it)."""
    if version is None:
        structlog.contextvars.unbind_contextvars("policy_version")
    else:
        structlog.contextvars.bind_contextvars(policy_version=int(version))


def bind_role(role: str) -> None:
    """Override the process ``role`` for this thread / task (co-located mode)."""
    structlog.contextvars.bind_contextvars(role=role)


@contextlib.contextmanager
def bound_context(**kw: Any) -> Iterator[MutableMapping[str, Any]]:
    """Bind fields for the duration of a ``with`` block, then restore the previous ones."""
    with structlog.contextvars.bound_contextvars(**kw):
        yield structlog.contextvars.get_contextvars()


class RateLimiter:
    """At most one log line per ``every_s`` per key; the lines in between are counted, and the
    next line that is let through reports how many were suppressed::

        limiter = RateLimiter(every_s=10.0)
        ok, suppressed = limiter.allow("stale_versions")
        if ok:
            log.warning("... (%d more suppressed)", suppressed)
    """

    def __init__(self, every_s: float, clock: Any = None) -> None:
        self.every_s = float(every_s)
        self.clock = clock or time.monotonic
        self._last: dict[Any, float] = {}
        self._suppressed: dict[Any, int] = {}

    def allow(self, key: Any) -> tuple[bool, int]:
        """(whether to log this one, how many of ``key`` were suppressed since the last logged)."""
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False, 0
        self._last[key] = now
        return True, self._suppressed.pop(key, 0)
