"""A local N-node KRaft cluster: N ``LocalKafka`` nodes, each a combined broker+controller on its
own ports and data dir, all voters of one controller quorum, formatted with one cluster id; or,
with ``controllers=K``, N broker-only nodes (ids 1..N) beside K controller-only ones (ids N+1..N+K,
the quorum's only voters), so brokers can be lost without losing the quorum.

    cluster = LocalCluster(3, ports=[(19092, 19093), (19094, 19095), (19096, 19097)])
    cluster.start()              # launch every node, wait until all three brokers are registered
    cluster.bootstrap            # "127.0.0.1:19092,127.0.0.1:19094,127.0.0.1:19096"
    cluster.leader("rl.samples.raw", 0)    # node id leading that partition (describe_topics)
    cluster.controller()         # node id of the active controller (kafka-metadata-quorum)
    cluster.kill(2)              # SIGKILL node 2 (a crash); its data dir is kept
    cluster.stop(2)              # controlled shutdown (SIGTERM): leadership moves first
    cluster.start_node(2)        # start it again on its data; wait_in_sync() until it caught up
    cluster.close()              # SIGKILL every node (tests); stop_all() for a controlled stop

    LocalCluster(3, controllers=1, port=19092)  # brokers 1-3 on 19092..19097, controller 4 on 19098

The internal topics and the topic defaults follow the number of brokers (``render.cluster_replication``:
3 copies, 2 in sync for 3 brokers), on the controllers too (a KRaft controller creates topics). Which node leads a partition comes from librdkafka's admin
client (``describe_topics``); which node is the active controller from Kafka's own
``kafka-metadata-quorum describe --status`` (a KRaft broker's metadata names a random broker as
"controller", so ``describe_cluster`` cannot say). ``rlstream broker start --nodes 3`` starts one
from the command line (``localkafka.cli``); its ``cluster.json`` in the data dir (default
``<cache>/kafka-<ver>/cluster-<port>``) lets ``status``/``stop`` find it again, and the data dir
``start`` recorded for its port lets them find it from ``--port`` alone.

Standard library only for starting and stopping (like ``localkafka.broker``); the questions about
leaders and sync import confluent-kafka when asked.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from config.env import Environment
from localkafka.broker import DEFAULT_START_TIMEOUT, DEFAULT_STOP_TIMEOUT, JVM_HEAP, LocalKafka, new_cluster_id
from localkafka.render import BROKER, COMBINED, CONTROLLER
from localkafka.paths import DEFAULT_PORT, HOST, BrokerError, _atomic_write, default_version, kafka_home

CLUSTER_FILE = "cluster.json"
METADATA_QUORUM = "org.apache.kafka.tools.MetadataQuorumCommand"


def default_ports(port: int, nodes: int) -> list[tuple[int, int]]:
    """Node i (from 0) on ``port + 2i``, its controller on ``port + 2i + 1``."""
    return [(port + 2 * i, port + 2 * i + 1) for i in range(nodes)]


def default_controller_ports(port: int, nodes: int, controllers: int) -> list[int]:
    """Dedicated controller j (from 0) on ``port + 2 * nodes + j``, after the brokers' pairs."""
    return [port + 2 * nodes + j for j in range(controllers)]


def default_data_dir(port: int, version: str | None = None) -> Path:
    """``<cache>/kafka-<ver>/cluster-<port>``: one directory per node under it (``node-<id>``)."""
    return kafka_home(version or default_version()) / f"cluster-{port}"


class LocalCluster:
    """``nodes`` KRaft nodes on ``host`` (see the module docstring). ``ports``: (broker,
    controller) per node, default ``default_ports(port, nodes)``; node ids are 1..N. The data dir
    keeps ``cluster.json`` (cluster id, nodes, ports) and one data dir per node, so the same
    cluster comes back after a stop.

    ``controllers`` > 0: the ``nodes`` are broker-only (their controller ports unused) and
    ``controllers`` controller-only nodes, ids N+1..N+K on ``controller_ports`` (default
    ``default_controller_ports``), form the quorum. ``nodes`` (the dict) holds them all;
    ``broker_ids`` and ``controller_ids`` say which is which (the same ids, combined)."""

    def __init__(self, nodes: int = 3, *, controllers: int = 0, port: int = DEFAULT_PORT,
                 ports: Sequence[tuple[int, int]] | None = None, controller_ports: Sequence[int] | None = None,
                 data_dir: str | Path | None = None,
                 version: str | None = None, extra_properties: Mapping[str, object] | None = None,
                 heap: Sequence[str] = JVM_HEAP, quiet: bool = False, env: Environment | None = None,
                 host: str = HOST) -> None:
        if nodes < 1:
            raise BrokerError(f"a cluster needs at least one node, not {nodes}")
        self.env = env or Environment.read()
        self.version = version or default_version(self.env)
        self.host = host
        self.ports = [tuple(p) for p in (ports or default_ports(port, nodes))]
        if len(self.ports) != nodes:
            raise BrokerError(f"{nodes} nodes need {nodes} (broker, controller) port pairs, not {len(self.ports)}")
        if controllers < 0:
            raise BrokerError(f"controllers {controllers}: 0 (every node a controller too) or more")
        self.controllers = controllers
        self.controller_ports = [int(c) for c in (controller_ports or default_controller_ports(
            self.ports[0][0], nodes, controllers))] if controllers else []
        if len(self.controller_ports) != controllers:
            raise BrokerError(f"{controllers} controllers need {controllers} ports, not {len(self.controller_ports)}")
        self.data_dir = Path(data_dir).expanduser().resolve() if data_dir else default_data_dir(
            self.ports[0][0], self.version)
        self.quiet = quiet
        self._admin_client = None  # (bootstrap, confluent_kafka AdminClient)
        self.cluster_id = self._cluster_id(nodes)
        self.broker_ids = list(range(1, nodes + 1))
        quorum = ([(nodes + j, c) for j, c in enumerate(self.controller_ports, 1)] if controllers
                  else [(i, c) for i, (_, c) in enumerate(self.ports, 1)])
        self.controller_ids = [i for i, _ in quorum]
        self.voters = ",".join(f"{i}@{host}:{c}" for i, c in quorum)

        def node(i: int, p: int, c: int, roles: str) -> LocalKafka:
            return LocalKafka(port=p, controller_port=c, version=self.version, data_dir=self.data_dir / f"node-{i}",
                              extra_properties=extra_properties, heap=heap, quiet=True, env=self.env, host=host,
                              node_id=i, voters=self.voters, cluster_id=self.cluster_id, roles=roles,
                              brokers=nodes)

        self.nodes: dict[int, LocalKafka] = {
            i: node(i, p, c, BROKER if controllers else COMBINED) for i, (p, c) in enumerate(self.ports, 1)}
        self.nodes.update({i: node(i, c, c, CONTROLLER) for i, c in quorum if controllers})

    # -- identity ------------------------------------------------------------------------------
    def _cluster_id(self, nodes: int) -> str:
        """The id in ``cluster.json`` (the same cluster again), else a new one written there."""
        path = self.data_dir / CLUSTER_FILE
        want = {"nodes": nodes, "ports": [list(p) for p in self.ports], "host": self.host}
        if self.controllers:  # absent for a combined cluster, as in the files written before
            want.update(controllers=self.controllers, controller_ports=self.controller_ports)
        try:
            known = json.loads(path.read_text())
        except (OSError, ValueError):
            known = None
        if known is not None:
            if {k: known.get(k) for k in (*want, "controllers")} != {"controllers": None, **want}:
                raise BrokerError(
                    f"{self.data_dir} holds another cluster ({known.get('nodes')} nodes on ports "
                    f"{known.get('ports')}); stop it and start with --fresh, or use another --data-dir")
            return known["cluster_id"]
        cid = new_cluster_id()
        _atomic_write(path, json.dumps({"cluster_id": cid, "version": self.version, **want}, indent=1) + "\n")
        return cid

    @classmethod
    def open(cls, data_dir: str | Path, **kw) -> "LocalCluster":
        """The cluster whose ``cluster.json`` is in ``data_dir`` (BrokerError if there is none)."""
        path = Path(data_dir).expanduser().resolve() / CLUSTER_FILE
        try:
            known = json.loads(path.read_text())
        except (OSError, ValueError):
            raise BrokerError(f"no local cluster at {path.parent} (no {CLUSTER_FILE})") from None
        return cls(known["nodes"], ports=[tuple(p) for p in known["ports"]], data_dir=path.parent,
                   controllers=known.get("controllers", 0), controller_ports=known.get("controller_ports"),
                   host=known.get("host", HOST), version=kw.pop("version", None) or known.get("version"), **kw)

    @property
    def bootstrap(self) -> str:
        """Every broker's address, comma separated (KAFKA_BROKERS)."""
        return ",".join(self.nodes[i].bootstrap for i in self.broker_ids)

    def node(self, node_id: int) -> LocalKafka:
        try:
            return self.nodes[node_id]
        except KeyError:
            raise BrokerError(f"no node {node_id}: the nodes are {sorted(self.nodes)}") from None

    def _say(self, msg: str) -> None:
        if not self.quiet:
            print(f"rlstream broker: {msg}", file=sys.stderr, flush=True)

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, timeout: float = DEFAULT_START_TIMEOUT) -> None:
        """Launch every node that is not running (together: none is ready before a majority runs),
        then wait until each answers and every broker is registered with the controller. On a
        failure, the nodes this call launched are killed and BrokerError says why."""
        t0 = time.monotonic()
        launched = [n for n in self.nodes.values() if not n.is_running()]
        try:
            for n in launched:
                n.launch()
            self.wait_ready(timeout)
        except BrokerError:
            for n in launched:
                n.kill()
            raise
        self._say(f"{len(self.nodes)}-node Kafka {self.version} cluster ready on {self.bootstrap} "
                  f"({time.monotonic() - t0:.1f}s, data {self.data_dir})")

    def wait_ready(self, timeout: float = DEFAULT_START_TIMEOUT, nodes: Iterable[int] | None = None) -> None:
        """Until each running node of ``nodes`` (default all) answers a metadata request and lists
        all of them as alive brokers (with confluent-kafka importable)."""
        deadline = time.monotonic() + timeout
        want = sorted(nodes) if nodes is not None else sorted(self.nodes)
        for i in want:
            self.node(i).wait_ready(max(1.0, deadline - time.monotonic()))
        want = [i for i in want if i in self.broker_ids]  # a controller-only node is no broker
        if not want:
            return
        try:
            import confluent_kafka  # noqa: F401
        except ImportError:
            return  # each node answered: the quorum has formed
        while True:
            alive = set(self.brokers())
            if set(want) <= alive:
                return
            if time.monotonic() >= deadline:
                raise BrokerError(f"brokers {sorted(set(want) - alive)} not registered after {timeout:g}s "
                                  f"(alive: {sorted(alive)})")
            time.sleep(0.25)

    def kill(self, node_id: int) -> None:
        """SIGKILL one node (a crash: no controlled shutdown); its data dir is kept."""
        self.node(node_id).kill()

    def stop(self, node_id: int, timeout: float = DEFAULT_STOP_TIMEOUT) -> None:
        """Controlled shutdown of one node (SIGTERM: it hands its leaderships over first)."""
        self.node(node_id).stop(timeout)

    def start_node(self, node_id: int, timeout: float = DEFAULT_START_TIMEOUT) -> None:
        """Start one stopped node again on its data and wait until it is a registered broker."""
        n = self.node(node_id)
        n.launch()
        self.wait_ready(timeout, nodes=[node_id])

    def stop_all(self, timeout: float = DEFAULT_STOP_TIMEOUT) -> list[int]:
        """SIGTERM every running node at once, SIGKILL what still runs after ``timeout``; the
        node ids that were running. Dedicated controllers go after the brokers (a broker's
        controlled shutdown asks the controller)."""
        stopped = []
        tiers = [self.broker_ids, [i for i in self.controller_ids if i not in self.broker_ids]]
        for ids in filter(None, tiers):
            stopped += self._stop_together(ids, timeout)
        return sorted(stopped)

    def _stop_together(self, ids: Iterable[int], timeout: float) -> list[int]:
        running = {i: self.nodes[i].pid for i in ids if self.nodes[i].pid is not None}
        for i, pid in running.items():
            self.nodes[i]._signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for i, pid in running.items():
            n = self.nodes[i]
            if not n._wait_exit(pid, max(0.0, deadline - time.monotonic())):
                self._say(f"node {i} (pid {pid}) did not exit in {timeout:.0f}s; SIGKILL")
                n._signal(pid, signal.SIGKILL)
                n._wait_exit(pid, 10)
            n._cleanup()
        return sorted(running)

    def close(self) -> None:
        """SIGKILL every node (a test's teardown: the data is thrown away)."""
        for n in self.nodes.values():
            n.kill()

    def wipe(self) -> None:
        """Stop every node and delete the cluster's data dir."""
        self.stop_all()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def status(self) -> dict:
        return {"nodes": len(self.broker_ids), "controllers": self.controllers, "bootstrap": self.bootstrap,
                "cluster_id": self.cluster_id,
                "data_dir": str(self.data_dir), "version": self.version,
                "members": [n.status() for n in self.nodes.values()]}

    # -- what the cluster says ---------------------------------------------------------------
    def running(self) -> list[int]:
        """Node ids whose process runs."""
        return [i for i, n in self.nodes.items() if n.is_running()]

    def _live(self) -> str:
        """The running brokers' addresses, comma separated."""
        return ",".join(self.nodes[i].bootstrap for i in self.running() if i in self.broker_ids)

    def _admin(self):
        """An admin client on the running brokers, kept while they stay the same (a client that is
        dropped while a request of it is pending never completes that request)."""
        from confluent_kafka.admin import AdminClient

        live = self._live() or self.bootstrap
        if self._admin_client is None or self._admin_client[0] != live:
            self._admin_client = (live, AdminClient({"bootstrap.servers": live, "log_level": 0}))
        return self._admin_client[1]

    def brokers(self, timeout: float = 5.0) -> list[int]:
        """Ids of the brokers the cluster reports alive (``describe_cluster``); [] if none answers."""
        from confluent_kafka import KafkaException

        admin = self._admin()
        try:
            desc = admin.describe_cluster(request_timeout=timeout).result(timeout=timeout + 1)
        except (KafkaException, concurrent.futures.TimeoutError):
            return []
        return sorted(n.id for n in desc.nodes)

    def describe(self, topics: Iterable[str], timeout: float = 30.0) -> dict[str, list[dict]]:
        """topic -> per partition {partition, leader, replicas, isr} (node ids; leader -1: none),
        from ``describe_topics``. Asked again while the cluster is settling (a node just lost:
        the request went to it; a topic just made: the node asked has not had its metadata yet,
        which Kafka spreads to each broker on its own time), until ``timeout``."""
        from confluent_kafka import KafkaException, TopicCollection

        topics = list(topics)
        deadline = time.monotonic() + timeout
        while True:
            admin = self._admin()
            try:
                futures = admin.describe_topics(TopicCollection(topics), request_timeout=5.0)
                out = {}
                for name, fut in futures.items():
                    desc = fut.result(timeout=6.0)
                    out[name] = [{"partition": p.id, "leader": p.leader.id if p.leader is not None else -1,
                                  "replicas": sorted(r.id for r in p.replicas),
                                  "isr": sorted(r.id for r in p.isr)}
                                 for p in sorted(desc.partitions, key=lambda p: p.id)]
                return out
            except (KafkaException, concurrent.futures.TimeoutError) as e:
                err = e.args[0] if e.args else None
                settling = "Timed out" in str(err) or "UNKNOWN_TOPIC_OR_PART" in str(err)
                if time.monotonic() >= deadline or (hasattr(err, "retriable") and not err.retriable()
                                                    and not settling):
                    raise BrokerError(f"describe_topics {topics}: {e}") from None
                self._admin_client = None  # a fresh client: fresh metadata
                time.sleep(0.25)

    def leader(self, topic: str, partition: int = 0) -> int:
        """Node id of the leader of ``topic``'s ``partition`` (-1: none right now)."""
        return self.describe([topic])[topic][partition]["leader"]

    def controller(self, timeout: float = 60.0) -> int:
        """Node id of the active controller: the KRaft quorum's leader, as Kafka's own
        ``kafka-metadata-quorum describe --status`` reports it."""
        from localkafka import kafka_tools

        live = self._live()
        res = kafka_tools.run_tool(METADATA_QUORUM, "--bootstrap-server", live, "describe", "--status",
                                   bootstrap=None, version=self.version, timeout=timeout)
        m = re.search(r"^LeaderId:\s+(-?\d+)", res.stdout, re.M)
        if m is None:
            raise BrokerError(f"kafka-metadata-quorum printed no LeaderId:\n{res.stdout}{res.stderr}")
        return int(m[1])

    def out_of_sync(self, topics: Iterable[str] | None = None) -> dict[str, list[int]]:
        """topic -> partitions without a leader or with a replica missing from the ISR (every
        topic of the cluster, internal ones too, when ``topics`` is None); {} when in sync."""
        if topics is None:
            md = self._admin().list_topics(timeout=10)
            topics = list(md.topics)
        out = {}
        for name, parts in self.describe(topics).items():
            bad = [p["partition"] for p in parts if p["leader"] < 0 or p["isr"] != p["replicas"]]
            if bad:
                out[name] = bad
        return out

    def wait_in_sync(self, timeout: float = 120.0, topics: Iterable[str] | None = None) -> None:
        """Until every partition (of ``topics``, default all) has a leader and all its replicas in
        sync, e.g. after a node came back."""
        deadline = time.monotonic() + timeout
        last: object = None
        while True:
            try:
                last = self.out_of_sync(None if topics is None else list(topics))
                if not last:
                    return
            except Exception as e:  # noqa: BLE001 - a settling cluster answers with many errors
                last = e
            if time.monotonic() >= deadline:
                raise BrokerError(f"cluster not in sync after {timeout:g}s: {last}")
            time.sleep(0.25)

    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    def __repr__(self) -> str:
        return (f"LocalCluster(nodes={len(self.broker_ids)}, controllers={self.controllers}, "
                f"bootstrap={self.bootstrap!r}, data_dir='{self.data_dir}')")
