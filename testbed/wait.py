"""The one way a test or a bench waits: a condition polled until a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(pred: Callable[[], T], timeout: float, what: str, *, every: float = 0.1,
             on_timeout: Callable[[], str] = lambda: "", ignore: tuple[type[BaseException], ...] = ()) -> T:
    """Poll ``pred()`` until it returns something truthy and return that; fail with ``what`` (and
    ``on_timeout()``, e.g. process logs) once ``timeout`` seconds have passed. Exceptions of the
    types in ``ignore`` count as "not yet"."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = pred()
            if value:
                return value
        except ignore:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{on_timeout()}")
        time.sleep(every)
