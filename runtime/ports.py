"""Ports and CLI command names: the one source of truth (environment variable names are
``config.env``'s).

Every process runs one small HTTP server (``runtime.http.MetricsServer``)
serving ``/metrics``, ``/healthz`` and ``/readyz`` on the port of its role.
``compose/`` and ``compose/k8s/`` are tested against this module
(``tests/ops/test_manifests.py``), so a port or variable renamed here and not
there fails the tests.

The policy server (``rlstream serve``) serves inference *and* its metrics and
probes on the same port, 8080, so that a Service has one port to expose.
"""

from __future__ import annotations

from dataclasses import dataclass

from config.env import Environment

#: Metrics/probe port per role. ``colocated`` is the single-process mode
#: (``rlstream train``), where all roles share one registry with a ``role`` label.
DEFAULT_PORTS: dict[str, int] = {
    "colocated": 9100,
    "actor": 9101,
    "streams": 9102,
    "learner": 9103,
    "serve": 8080,
}



@dataclass(frozen=True)
class Probe:
    """An HTTP probe as Kubernetes runs an ``httpGet`` one: every ``period_s`` a GET of ``path``,
    which fails unless it answers 2xx or 3xx within ``timeout_s``; ``failure_threshold`` failures
    in a row act (a liveness probe: the container is killed and restarted)."""

    path: str
    period_s: float
    timeout_s: float
    failure_threshold: int


#: The liveness probe of every role: the manifests' ``livenessProbe`` (compose/k8s/, checked by
#: tests/ops/test_manifests.py) and the local decoupled supervisor's (``rlstream.supervisor``).
LIVENESS_PROBE = Probe(path="/healthz", period_s=10.0, timeout_s=3.0, failure_threshold=3)
#: The start-up probe the liveness probe waits behind (the manifests' ``startupProbe``; its
#: ``timeoutSeconds`` is Kubernetes' default, 1). Locally it sets how often a child not yet
#: answering is asked.
STARTUP_PROBE = Probe(path="/healthz", period_s=5.0, timeout_s=1.0, failure_threshold=24)

#: Roles that have a process (and so a port) of their own.
ROLES: tuple[str, ...] = tuple(DEFAULT_PORTS)

#: Sub-commands of the ``rlstream`` CLI (rlstream/cli.py is wired to this list).
KNOWN_COMMANDS: tuple[str, ...] = (
    "train",
    "actor",
    "learner",
    "serve",
    "replay",
    "subscribe",
    "broker",
    "rollback",
    "eval",
    "verify",
    "fork",
    "lineage",
    "validate",
    "prune",
    "lag",
    "runs",
)

#: The role whose port each long-running command uses.
COMMAND_ROLES: dict[str, str] = {
    "train": "colocated",
    "actor": "actor",
    "learner": "learner",
    "serve": "serve",
}

#: Ports of the infrastructure services in compose/ (in-cluster addresses).
INFRA_PORTS: dict[str, int] = {
    "kafka": 9092,
    "kafka_controller": 9093,
    "redis": 6379,
    "prometheus": 9090,
    "grafana": 3000,
}


def metrics_port(role: str, env: Environment) -> int:
    """Port for ``role``: ``$RLSTREAM_METRICS_PORT`` if set, else ``DEFAULT_PORTS[role]``.

    Raises ``KeyError`` for an unknown role and ``ValueError`` for a value that is
    not a port number.
    """
    return env.metrics_port(DEFAULT_PORTS[role])
