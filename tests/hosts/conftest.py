"""Simulated hosts for the decoupled roles (``testbed.netns``): a namespace per host on one
private switch, the Kafka broker on its own host, listening on and advertising that host's
address, and a ``Rig`` (``tests/faults/conftest.py``) whose roles each run on their host.

Hosts: ``kafka``, ``learner``, ``streams`` (the Faust worker) and ``actor-0``, ``actor-1``.
The test process reaches them through its own port on the switch (the ledger, the progress
counters); nothing but those addresses and loopback is contacted. Every namespace, link and
process is removed when the test ends, pass or fail (``Network.close``, then the reaper).
Where namespaces cannot be made (not root, no ``ip``/``nft``), or a delay is asked for where
neither ``sch_netem`` nor NFQUEUE works, the tests skip with the reason; under ``CI=true`` they
fail instead (``missing``), as for a missing broker (``tests/support/services.py``): the harness's
own tests (``test_netns.py``) as much as the hosts tests, and an impairment is never silently
dropped there.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass

import pytest

from tests.faults.conftest import Rig
from testbed import netns

HOSTS = ("kafka", "learner", "streams", "actor-0", "actor-1")


def missing(msg: str) -> None:
    """Skip for something this machine lacks (namespaces, a delay method); fail under ``CI=true``,
    where .ci/run installs what they need."""
    if os.environ.get("CI", "").strip().lower() == "true":
        pytest.fail(f"CI=true: {msg}")
    pytest.skip(msg)
KAFKA_PORT = 9092  # free (and 9093, its controller's): the broker's namespace holds nothing else


@dataclass
class Hosts:
    net: netns.Network
    bootstrap: str

    def __getitem__(self, name: str) -> netns.Host:
        return self.net.hosts[name]

    def place(self, role: str) -> list[str]:
        """``Rig``'s command prefix: role ``streams-<n>`` on host ``streams``, the rest on their own."""
        return self[("streams" if role.startswith("streams") else role)].cmd([])

    def rig(self, run_dir, **kw) -> Rig:
        return Rig(self.bootstrap, run_dir, place=self.place, **kw)

    def impair(self, loss_pct: int, delay_ms: float) -> dict:
        """``loss_pct`` on every host's link and ``delay_ms`` on every packet a host sends; what was applied."""
        applied = {"loss_pct": loss_pct, "delay_ms": delay_ms, "delay_method": self.net.delay_method}
        for h in self.net.hosts.values():
            h.loss(loss_pct)
            if self.net.delay_method is not None and delay_ms:
                h.delay(delay_ms)
        if delay_ms and self.net.delay_method is None:
            missing("delay: unavailable (kernel lacks sch_netem and NFQUEUE)")  # outside CI: skip, not run undelayed
            applied["delay_ms"] = 0
            applied["delay"] = "unavailable (kernel lacks sch_netem and NFQUEUE)"
        print("HOSTS impairments:", json.dumps(applied, sort_keys=True))
        return applied

    def report(self) -> dict:
        """Per host: its address, impairments and the frames the switch dropped; the delayers' counts."""
        return {name: {**h.impairments(), "delayer": h.delay_counts()} for name, h in self.net.hosts.items()}


@pytest.fixture
def hosts(tmp_path_factory):
    why = netns.unavailable()
    if why is not None:
        missing(f"network namespaces unavailable for the simulated hosts: {why}")
    net = netns.Network()
    try:
        for name in HOSTS:
            net.add(name)
        try:
            bootstrap = net.hosts["kafka"].start_kafka(tmp_path_factory.mktemp("hosts-kafka"), KAFKA_PORT)
        except RuntimeError as e:
            missing(f"no Kafka broker on the simulated host: {e}")
        yield Hosts(net, bootstrap)
    finally:
        with contextlib.suppress(Exception):
            net.close()
