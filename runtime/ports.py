"""Ports, environment variable names and CLI command names: the one source of truth.

Every process runs one small HTTP server (``runtime.http.MetricsServer``)
serving ``/metrics``, ``/healthz`` and ``/readyz`` on the port of its role.
``compose/`` and ``compose/k8s/`` are tested against this module
(``tests/ops/test_manifests.py``), so a port or variable renamed here and not
there fails the tests.

The policy server (``rlstream serve``) serves inference *and* its metrics and
probes on the same port, 8080, so that a Service has one port to expose.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

#: Metrics/probe port per role. ``colocated`` is the single-process mode
#: (``rlstream train``), where all roles share one registry with a ``role`` label.
DEFAULT_PORTS: dict[str, int] = {
    "colocated": 9100,
    "actor": 9101,
    "streams": 9102,
    "learner": 9103,
    "serve": 8080,
}

#: Roles that have a process (and so a port) of their own.
ROLES: tuple[str, ...] = tuple(DEFAULT_PORTS)

# Environment variables read by the entry points (rlstream/config.py parses
# them once; nothing deeper in the code reads the environment).

#: Overrides the role's port from DEFAULT_PORTS (0 = pick a free port).
ENV_METRICS_PORT = "RLSTREAM_METRICS_PORT"
#: Kafka bootstrap servers, comma separated ``host:port`` (e.g. ``kafka:9092``).
ENV_KAFKA_BROKERS = "KAFKA_BROKERS"
#: Redis URL (``redis://host:6379/0``) for claim-check weights and snapshots.
ENV_REDIS_URL = "REDIS_URL"
#: Directory of the host's one verified copy of each claim-checked blob (``streams.blobcache``),
#: or ``off``; unset: ``/dev/shm/rlstream-blobs-<uid>``.
ENV_BLOB_CACHE = "RLSTREAM_BLOB_CACHE"
#: Bus backend: ``memory`` (co-located default) or ``kafka``.
ENV_BUS = "RLSTREAM_BUS"
#: Snapshot store URL or path (``file:///data/snapshots``, ``redis://redis:6379/0``);
#: see ``learner.snapshots.open_store``.
ENV_SNAPSHOT_STORE = "RLSTREAM_SNAPSHOT_STORE"
#: Run identifier bound into every log line (``runtime.logging``).
ENV_RUN_ID = "RLSTREAM_RUN_ID"
#: Actor index (its id is ``actor-<index>``). Set per pod by compose/k8s/actor.yaml
#: from the StatefulSet ordinal and passed as ``rlstream actor --index``.
ENV_ACTOR_INDEX = "RLSTREAM_ACTOR_INDEX"
#: Staleness window of the stream processors (the Faust worker reads these):
#: max policy versions behind, max age in ms, and ``drop`` or ``downweight``.
ENV_STALENESS_K = "RLSTREAM_STALENESS_K"
ENV_STALENESS_MS = "RLSTREAM_STALENESS_MS"
ENV_STALENESS_MODE = "RLSTREAM_STALENESS_MODE"
#: Algorithm whose stream-processor defaults the Faust worker starts from (``PrepareConfig.for_algo``).
ENV_ALGO = "RLSTREAM_ALGO"
#: Policy the Faust worker follows (``PrepareConfig.policy_id``; default ``policy``): versions
#: of any other policy on rl.policy.versions are ignored.
ENV_POLICY_ID = "RLSTREAM_POLICY_ID"
#: Run namespace (``streams.topics.Namespace``) of every role and tool started without
#: ``--namespace``, the Faust worker included, so separately started processes agree; unset:
#: the legacy unscoped topic and group names.
ENV_NAMESPACE = "RLSTREAM_NAMESPACE"
#: Run directory of a decoupled run, set for the Faust worker (started by faust's own CLI), which
#: writes its summary there (``runtime.roles.write_summary``); unset: no summary file.
ENV_RUN_DIR = "RLSTREAM_RUN_DIR"
#: The name a decoupled run's supervisor gave this child (``streams``, ``streams-1``, ...): the
#: Faust worker's summary file is named after it, so N workers do not overwrite one file.
ENV_PROCESS = "RLSTREAM_PROCESS"
#: A run's config file (``<run-dir>/config.json``, ``rlstream.config.write_config``): ``rlstream
#: actor``/``learner`` and the Faust worker take every setting from it instead of flags/env.
ENV_CONFIG = "RLSTREAM_CONFIG"

#: Every environment variable an rlstream process reads. Manifests may set no
#: other variable on an rlstream container.
ENV_VARS: tuple[str, ...] = (
    ENV_METRICS_PORT,
    ENV_KAFKA_BROKERS,
    ENV_REDIS_URL,
    ENV_BLOB_CACHE,
    ENV_BUS,
    ENV_SNAPSHOT_STORE,
    ENV_RUN_ID,
    ENV_ACTOR_INDEX,
    ENV_STALENESS_K,
    ENV_STALENESS_MS,
    ENV_STALENESS_MODE,
    ENV_ALGO,
    ENV_POLICY_ID,
    ENV_NAMESPACE,
    ENV_RUN_DIR,
    ENV_CONFIG,
)

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


def metrics_port(role: str, env: Mapping[str, str] | None = None) -> int:
    """Port for ``role``: ``$RLSTREAM_METRICS_PORT`` if set, else ``DEFAULT_PORTS[role]``.

    Raises ``KeyError`` for an unknown role and ``ValueError`` for a value that is
    not a port number.
    """
    default = DEFAULT_PORTS[role]
    env = os.environ if env is None else env
    raw = env.get(ENV_METRICS_PORT, "").strip()
    if not raw:
        return default
    port = int(raw)
    if not 0 <= port <= 65535:
        raise ValueError(f"{ENV_METRICS_PORT}={raw!r} is not a port number")
    return port
