"""The flags and argument checks the ``rlstream`` commands share (``rlstream.cli`` and its
command groups ``cli_tools`` and ``cli_runs``)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from typing import Any


def kv(items: list[str] | None, flag: str = "--set") -> dict[str, Any]:
    """``--set key=value`` items as a dict, each value JSON where it parses, else the string."""
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise SystemExit(f"{flag} expects key=value, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def wrapper_names(csv: str) -> tuple[str, ...]:
    """``--wrappers A,B`` as names, each checked (an unknown one: exit 2 with the known ones)."""
    from actor.envs import wrapper_fns

    names = tuple(n.strip() for n in csv.split(",") if n.strip())
    try:
        wrapper_fns(names)
    except ValueError as e:
        raise SystemExit(f"--wrappers: {e}") from e
    return names


def add_common(p: argparse.ArgumentParser) -> None:
    """The flags of every command that reads a run's bus: backend, bootstrap, metrics, logging,
    run id, namespace, event log."""
    p.add_argument("--bus", choices=["memory", "kafka"], default=None,
                   help="bus backend (default: memory for colocated, kafka otherwise; env RLSTREAM_BUS)")
    p.add_argument("--bootstrap", default=None, help="Kafka bootstrap servers (env KAFKA_BROKERS)")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus/health port; -1 disables")
    p.add_argument("--log-level", default="info")
    p.add_argument("--log-json", action="store_true", help="JSON log lines (default: console)")
    p.add_argument("--run-id", default="")
    p.add_argument("--namespace", default=None,
                   help="run namespace scoping every topic and consumer group (<ns>.rl.samples.raw); "
                        "default: env RLSTREAM_NAMESPACE, else the run id for `train --mode decoupled`, "
                        "the one --run-dir (default runs/latest) records for the Kafka tools "
                        "(subscribe, replay, serve, rollback, lag), and the legacy unscoped names otherwise")
    p.add_argument("--log-dir", default=None,
                   help="memory bus: directory of a run's event log (e.g. runs/latest/log) to read or extend")


def refuse(message: str):
    """One line on stderr and exit code 2: input the command cannot use."""
    print(f"rlstream: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def stop_on_signals() -> threading.Event:
    """An event SIGINT and SIGTERM set (a command stops cleanly on either)."""
    stop = threading.Event()

    def handler(signum, frame) -> None:
        stop.set()

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, handler)
    return stop
