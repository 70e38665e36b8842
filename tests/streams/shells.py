"""The processor shells as interchangeable test subjects (one scenario suite runs over all):

* ``inproc-memory``: ``PrepareWorker`` on the memory bus, stepped in the test's thread;
* ``inproc-kafka``: ``PrepareWorker`` on a real broker, in a run namespace of the test's own;
* ``faust``: the real ``faust -A streams worker`` process on a real broker, same namespace rule.

Each takes its pipeline settings from the same environment variables (``RLSTREAM_ALGO``,
``RLSTREAM_STALENESS_*``, ``RLSTREAM_POLICY_ID``, read by ``streams.settings.prepare_config_of``), and
offers the same three things: ``bus`` (the test's view of the topics, namespaced),
``follows(version)`` and ``settle()`` (every raw record handled and committed).
"""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
from pathlib import Path

from streams.topics import SAMPLES_RAW, STREAMS_GROUP, Namespace, all_topics
from tests.support import Role, free_port, http_json, wait_for

ROOT = Path(__file__).resolve().parents[2]
SHELLS = ["inproc-memory", "inproc-kafka", "faust"]


class InProcessShell:
    """``PrepareWorker`` over ``bus``, stepped by the test."""

    def __init__(self, bus, env: dict[str, str]) -> None:
        from config import Environment
        from rlstream.wiring import build_events, build_prepare
        from streams.settings import prepare_config_of
        from streams.worker import PrepareWorker

        self.bus = bus
        self.events = build_events(bus, None, publish_schemas=False)  # as every process: the one assembly
        self.prepare = build_prepare(prepare_config_of(Environment(env)), None, None)
        self.worker: PrepareWorker | None = None
        self._make = lambda: PrepareWorker(self.events, self.prepare)

    def start(self) -> None:
        self.worker = self._make()

    def stats(self) -> dict:
        return self.prepare.stats.as_dict()

    def follows(self, version: int, timeout: float = 60) -> None:
        def seen() -> bool:
            self.worker.step(0.05)
            return self.prepare.stats.latest_version == version
        wait_for(seen, timeout, f"the worker to follow version {version}", every=0)

    def settle(self, timeout: float = 120) -> None:
        def done() -> bool:
            idle = self.worker.step(0.2) == 0
            return idle and self.bus.group_lag(STREAMS_GROUP, SAMPLES_RAW) == 0
        wait_for(done, timeout, "the worker to handle and commit every raw record", every=0)

    def summary(self) -> dict:
        return {**self.worker.core.counts(), **self.stats()}

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


class FaustShell:
    """``faust -A streams worker`` processes in ``namespace`` (``start`` adds one)."""

    def __init__(self, bus, bootstrap: str, namespace: Namespace, env: dict[str, str], tmp: Path) -> None:
        self.bus = bus
        self.tmp = tmp
        # Faust's own BROKER_SESSION_TIMEOUT: a SIGKILLed worker leaves in seconds (``env`` may set another)
        self.env = {**os.environ, "BROKER_SESSION_TIMEOUT": "6", **env, "KAFKA_BROKERS": bootstrap,
                    "RLSTREAM_NAMESPACE": namespace.name,
                    "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                    "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.workers: list[Role] = []
        self.ports: list[int] = []

    def start(self) -> Role:
        n = len(self.workers) + 1
        port = free_port()
        cmd = [sys.executable, "-m", "faust", "-A", "streams", "--datadir", str(self.tmp / f"faust-{n}"),
               "worker", "-l", "info", "--web-port", str(port)]
        role = Role(f"faust-{n}", cmd, self.tmp / f"faust-{n}.log", {**self.env, "RLSTREAM_METRICS_PORT": str(port)})
        self.workers.append(role)
        self.ports.append(port)
        return role

    def stats_doc(self, i: int = -1) -> dict:
        """Worker ``i``'s ``/healthz``: its raw partitions and processor stats."""
        return http_json(f"http://127.0.0.1:{self.ports[i]}/healthz")

    def stats(self, i: int = -1) -> dict:
        return self.stats_doc(i)["stats"]

    def logs(self) -> str:
        return "\n".join(f"--- {w.name} ---\n{w.tail(60)}" for w in self.workers)

    def _alive(self) -> None:
        for w in self.workers:
            assert w.alive() or w.ended_by_test, f"{w.name} exited:\n{w.tail(80)}"

    def follows(self, version: int, timeout: float = 180) -> None:
        def seen() -> bool:
            self._alive()
            return all(self.stats(i)["latest_version"] == version
                       for i, w in enumerate(self.workers) if w.alive())
        wait_for(seen, timeout, f"the Faust worker to follow version {version}", every=0.5,
                 ignore=(OSError, ValueError, KeyError), on_timeout=self.logs)

    def settle(self, timeout: float = 180) -> None:
        def done() -> bool:
            self._alive()
            return self.bus.group_lag(STREAMS_GROUP, SAMPLES_RAW) == 0
        wait_for(done, timeout, "the Faust worker to handle and commit every raw record", every=0.5,
                 on_timeout=self.logs)

    def summary(self) -> dict:
        """SIGTERM the last worker; its summary line."""
        return self.workers[-1].stop(60)

    def close(self) -> None:
        for w in self.workers:
            if w.alive():
                with contextlib.suppress(Exception):
                    w.kill()


@contextlib.contextmanager
def open_shell(kind: str, env: dict[str, str], tmp: Path, kafka_bootstrap=None, raw_partitions: int | None = None):
    """A shell of ``kind`` (``SHELLS``), not started, over fresh topics of its own."""
    if kind == "inproc-memory":
        from streams.bus.memory import MemoryBus

        bus = MemoryBus()
        bus.create_topics(all_topics(raw_partitions))
        shell = InProcessShell(bus, env)
        try:
            yield shell
        finally:
            shell.close()
        return
    from streams.bus.kafka import KafkaBus
    from streams.bus.namespaced import NamespacedBus

    bootstrap = kafka_bootstrap()
    ns = Namespace(f"shell-{uuid.uuid4().hex[:10]}")
    bus = NamespacedBus(KafkaBus(bootstrap, client_id=f"test-{ns.name}"), ns)
    bus.create_topics(all_topics(raw_partitions))
    shell = InProcessShell(bus, env) if kind == "inproc-kafka" else FaustShell(bus, bootstrap, ns, env, tmp)
    try:
        yield shell
    finally:
        shell.close()
        bus.close()
