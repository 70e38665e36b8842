"""The broker's error codes on this process's produce requests, counted by name (``PRODUCE_ERRORS``).

librdkafka retries a retriable produce error (``NOT_ENOUGH_REPLICAS`` below
``min.insync.replicas``, ``REQUEST_TIMED_OUT``, ``NOT_LEADER_FOR_PARTITION``...) by itself until
the record's delivery timeout, so neither a delivery report nor the error callback carries it;
only its ``msg`` debug context says so, one line per failed message set (facility ``MSGSET``:
``... encountered error: Broker: Not enough in-sync replicas (actions Retry,MsgNotPersisted)``).
The producers run with that context on (``PRODUCE_DEBUG``) and the bus's librdkafka logger hands
those lines to ``PRODUCE_ERRORS.note``, which counts the code by its ``KafkaError`` name; the
roles export the counts as ``rlstream_produce_errors_total{code}`` (``listen``)."""

from __future__ import annotations

import re
import threading
import weakref
from collections import Counter
from collections.abc import Callable

#: The producer's librdkafka debug context that reports each failed produce request.
PRODUCE_DEBUG = "msg"
FACILITY = "MSGSET"
_ERROR = re.compile(r"encountered error: (.+?) \(actions ")


def _names() -> dict[str, str]:
    """librdkafka's text of each error code -> the code's name (``Broker: Not enough in-sync
    replicas`` -> ``NOT_ENOUGH_REPLICAS``)."""
    from confluent_kafka import KafkaError

    out = {}
    for name in dir(KafkaError):
        code = getattr(KafkaError, name)
        if name.isupper() and isinstance(code, int):
            out.setdefault(KafkaError(code).str(), name.lstrip("_") if name.startswith("_") else name)
    return out


class ProduceErrors:
    """Produce errors by code name, from librdkafka's ``MSGSET`` debug lines (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._names: dict[str, str] | None = None
        self._listeners: list[weakref.WeakMethod] = []

    def listen(self, count: Callable[[str], None]) -> None:
        """Call the bound method ``count(code)`` on every error from now on (held weakly: a
        role's ``Metrics.count_produce_error``, dropped with its ``Metrics``)."""
        with self._lock:
            self._listeners = [w for w in self._listeners if w() is not None]
            if all(w() != count for w in self._listeners):
                self._listeners.append(weakref.WeakMethod(count))

    def note(self, facility: str, text: str) -> str | None:
        """Count the error a ``MSGSET`` line reports; the code's name, or None for another line."""
        if facility != FACILITY:
            return None
        m = _ERROR.search(text)
        if m is None:
            return None
        if self._names is None:
            self._names = _names()
        code = self._names.get(m[1], "OTHER")
        with self._lock:
            self._counts[code] += 1
            listeners = [f for w in self._listeners if (f := w()) is not None]
        for count in listeners:
            count(code)
        return code

    def counts(self) -> dict[str, int]:
        """Code name -> failed produce requests since the process started."""
        with self._lock:
            return dict(self._counts)


PRODUCE_ERRORS = ProduceErrors()
