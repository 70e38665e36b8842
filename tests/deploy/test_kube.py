"""The Kubernetes manifests, run as pods with ``podman play kube``, against a Kafka broker and a
Redis the test starts with testcontainers (the project's own images, through podman's Docker API).

podman runs Pods, Deployments (one replica), ConfigMaps and PersistentVolumeClaims; this machine
has no cluster network and no GPU, so each manifest is rendered for it first, changing only what
a node would provide: ``hostNetwork: true`` with every port on loopback (each role's port a free
one), the ConfigMap's addresses pointing at the test's broker and Redis with replication 1, the
locally built image, and the learner on the CPU (no ``nvidia.com/gpu``, no ``--learner.device cuda``,
as learner.yaml's header says for a CPU learner). The StatefulSet of ranks (k8s/ranks) is
rendered into its N pods, as its controller would make them (RANK from the ordinal, MASTER_ADDR
rank 0's address). What podman cannot run (KEDA's ScaledObjects, the HPA, Services' virtual
IPs, CronJob schedules) stays schema-validated (tests/ops/test_manifest_schemas.py)."""

from __future__ import annotations

import copy
import json
import os
import signal
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from schemas.codec import Codec
from schemas.events import GradientStep, PolicyVersion
from streams.bus.kafka import KafkaBus
from streams.topics import LEARNER_STEPS, POLICY_VERSIONS, SAMPLES_PREPARED
from tests.support.kafka import committed, end_offsets
from testbed.ports import free_port, free_ports

from .conftest import COMPOSE, podman, wait_for

pytestmark = [pytest.mark.deploy, pytest.mark.timeout(1200)]
K8S = COMPOSE / "k8s"
CODEC = Codec()
IMAGE = "localhost/rlstream:latest"
RUN_ARGS = ["--algo", "ppo", "--env", "Pendulum-v1", "--learner.train-batch-size", "64", "--actor.fragment-steps", "32",
            "--actor.num-envs", "1", "--learner.snapshot-every", "3", "--set", "update_epochs=1", "--set", "num_minibatches=1",
            "--deploy.torch-threads", "1",
            # eager updates: a captured one compiles for minutes at every learner start on a small
            # CPU (test_gpu_image.py checks the images compile); the run is otherwise the same
            "--learner.compile-update", "False"]


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def env_list(c: dict, name: str, value: str) -> None:
    for e in c.setdefault("env", []):
        if e["name"] == name:
            e.pop("valueFrom", None)
            e["value"] = value
            return
    c["env"].append({"name": name, "value": value})


def set_port(c: dict, old: int, new: int) -> None:
    """Move a container's port (env, containerPort, probes, --port) from ``old`` to ``new``."""
    for e in c.get("env", []):
        if e.get("value") == str(old):
            e["value"] = str(new)
    c.pop("ports", None)  # on the host's network a port is the process's own: podman refuses mappings
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        if probe in c and c[probe].get("httpGet", {}).get("port") == old:
            c[probe]["httpGet"]["port"] = new
    c["command"] = [str(new) if a == str(old) else a for a in c["command"]]


def for_this_machine(d: dict, port_of: dict[str, int], extra: list[str], total_steps: int) -> dict:
    """One Deployment rendered for podman on this machine (see the module's docstring)."""
    d = copy.deepcopy(d)
    d["spec"]["replicas"] = 1
    spec = d["spec"]["template"]["spec"]
    spec["hostNetwork"] = True
    for c in spec["containers"]:
        c["image"] = IMAGE
        role = d["metadata"]["name"].removeprefix("rlstream-")
        old = int(d["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"])
        set_port(c, old, port_of[role])
        c.get("resources", {}).get("limits", {}).pop("nvidia.com/gpu", None)
        cmd = c["command"]
        if "--learner.device" in cmd:
            i = cmd.index("--learner.device")
            del cmd[i:i + 2]
        if cmd[:2] in (["rlstream", "learner"], ["rlstream", "actor"]):
            cmd += [*RUN_ARGS, "--total-steps", str(total_steps), *extra]
        c["env"] = [e for e in c.get("env", []) if not e.get("valueFrom", {}).get("secretKeyRef")]
        env_list(c, "OMP_NUM_THREADS", "1")
        env_list(c, "RLSTREAM_ALGO", "ppo")
    return d


def configmap(bootstrap: str, redis_port: int) -> dict:
    (cm,) = docs("configmap.yaml")
    cm = copy.deepcopy(cm)
    data = cm["data"]
    assert data["RLSTREAM_LEARNER_GROUP"] == "rl-trainers"  # the guide's group, kept as it is
    data.update({"KAFKA_BROKERS": bootstrap, "RLSTREAM_REPLICATION_FACTOR": "1", "RLSTREAM_MIN_INSYNC_REPLICAS": "1",
                 "REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
                 "RLSTREAM_SNAPSHOT_STORE": f"redis://127.0.0.1:{redis_port}/1?prefix=rlstream:snapshots"})
    return cm


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


def count(bootstrap: str, topic: str) -> int:
    try:
        return sum(end_offsets(bootstrap, topic).values())
    except Exception:
        return 0


def read(bootstrap: str, topic: str) -> list:
    with KafkaBus(bootstrap, client_id="deploy-kube", auto_create=False) as bus:
        return [CODEC.decode(r.value) for r in bus.read_all(topic)]


class Kube:
    """``podman play kube`` of rendered manifests; ``down`` removes the pods and their volumes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.played: list[Path] = []

    def play(self, manifests: list[dict], name: str) -> str:
        f = self.path / f"{name}.yaml"
        f.write_text(yaml.safe_dump_all(manifests, sort_keys=False))
        self.played.append(f)
        res = podman("play", "kube", str(f), check=False, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        return res.stdout

    def pods(self, label: str | None = None) -> list[dict]:
        args = ["pod", "ps", "--format", "json"] + (["--filter", f"label={label}"] if label else [])
        return json.loads(podman(*args).stdout or "[]")

    def container(self, pod: str, name: str) -> dict:
        res = json.loads(podman("inspect", f"{pod}-{name}").stdout)
        return res[0]

    def logs(self, pod: str, name: str, tail: int = 40) -> str:
        res = podman("logs", "--tail", str(tail), f"{pod}-{name}", check=False)
        return res.stdout + res.stderr

    def down(self) -> None:
        for f in reversed(self.played):
            podman("play", "kube", "--down", str(f), check=False, timeout=300)
        for v in ("rlstream-learner-data",):
            podman("volume", "rm", "-f", v, check=False)


@pytest.fixture
def kube(podman_ready, images, tmp_path):
    k = Kube(tmp_path)
    yield k
    k.down()


@pytest.fixture
def broker_and_redis(docker_api):
    """The project's Kafka and Redis images, started with testcontainers on free loopback ports."""
    from testcontainers.core.container import DockerContainer

    kport, cport = free_ports(2)
    rport = free_port()
    kafka = (DockerContainer("localhost/rlstream-kafka:3.9.1").with_name(f"rlsdeploy-kafka-{kport}")
             .with_env("CLUSTER_ID", "EM60aLttSwmv45nWkWbhCw").with_env("KAFKA_NODE_ID", "1")
             .with_env("KAFKA_PROCESS_ROLES", "broker,controller")
             .with_env("KAFKA_CONTROLLER_QUORUM_VOTERS", f"1@127.0.0.1:{cport}")
             .with_env("KAFKA_LISTENERS", f"PLAINTEXT://127.0.0.1:{kport},CONTROLLER://127.0.0.1:{cport}")
             .with_env("KAFKA_ADVERTISED_LISTENERS", f"PLAINTEXT://127.0.0.1:{kport}")
             .with_env("KAFKA_LISTENER_SECURITY_PROTOCOL_MAP", "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT")
             .with_env("KAFKA_CONTROLLER_LISTENER_NAMES", "CONTROLLER")
             .with_env("KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR", "1")
             .with_env("KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR", "1")
             .with_env("KAFKA_TRANSACTION_STATE_LOG_MIN_ISR", "1")
             .with_env("KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS", "0")
             .with_kwargs(network_mode="host"))
    redis = (DockerContainer("localhost/rlstream-redis:latest").with_name(f"rlsdeploy-redis-{rport}")
             .with_command(f"redis-server --bind 127.0.0.1 --port {rport} --save '' --appendonly no")
             .with_kwargs(network_mode="host"))
    started = []
    try:
        for c in (kafka, redis):
            c.start()
            started.append(c)
        from localkafka.probe import probe

        wait_for(lambda: probe("127.0.0.1", kport, timeout=5).get("ready"), 180, "Kafka (testcontainers)", every=2,
                 on_timeout=lambda: kafka.get_wrapped_container().logs(tail=40).decode(errors="replace"))
        import redis as redis_client

        wait_for(lambda: _ping(redis_client, rport), 60, "Redis (testcontainers)")
        yield f"127.0.0.1:{kport}", rport
    finally:
        for c in started:
            c.stop()


def _ping(redis_client, port: int) -> bool:
    try:
        return bool(redis_client.Redis(host="127.0.0.1", port=port, socket_timeout=2).ping())
    except Exception:
        return False


def test_the_manifests_run_as_pods_with_their_selectors_probes_and_a_resuming_learner(kube, broker_and_redis):
    bootstrap, rport = broker_and_redis
    port_of = dict(zip(["actor", "streams", "learner", "serve"], free_ports(4)))
    pvc = [d for d in docs("learner.yaml") if d["kind"] == "PersistentVolumeClaim"]
    deployments = {d["metadata"]["name"].removeprefix("rlstream-"): d
                   for f in ("actor.yaml", "streams.yaml", "learner.yaml", "serve.yaml")
                   for d in docs(f) if d["kind"] == "Deployment"}
    rendered = [for_this_machine(d, port_of, [], 10**7) for d in deployments.values()]
    kube.play([configmap(bootstrap, rport), *pvc, *rendered], "roles")
    report: dict = {}

    # every pod runs; the guide's selector finds the policy server
    pods = {p["Name"]: p for p in kube.pods("app.kubernetes.io/part-of=rlstream")}
    assert {f"rlstream-{r}-pod-0" for r in deployments} <= set(pods), sorted(pods)
    inference = kube.pods("app=inference-worker")
    assert [p["Name"] for p in inference] == ["rlstream-serve-pod-0"], inference
    assert [p["Name"] for p in kube.pods("app=rl-trainer")] == ["rlstream-learner-pod-0"]

    # training flows, in the guide's consumer group rl-trainers
    wait_for(lambda: count(bootstrap, LEARNER_STEPS) >= 5, 400, "5 updates from the pods", every=2,
             on_timeout=lambda: kube.logs("rlstream-learner-pod-0", "learner"))
    wait_for(lambda: sum(committed(bootstrap, "rl-trainers", SAMPLES_PREPARED).values()) > 0, 120,
             "offsets committed by the consumer group rl-trainers")

    # each probe of each container answers on the path and port the manifest gives it
    probed = {}
    for d in rendered:
        for c in d["spec"]["template"]["spec"]["containers"]:
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                get = c[kind]["httpGet"]
                url = f"http://127.0.0.1:{get['port']}{get['path']}"
                probed[f"{d['metadata']['name']} {kind}"] = wait_for(lambda u=url: http_status(u) == 200 and 200, 120,
                                                                    f"{url} to answer 200")
    report["probes"] = sorted(probed)

    # the learner pod resumes after a kill (restartPolicy Always; --resume: snapshot + offsets)
    first = kube.container("rlstream-learner-pod-0", "learner")["State"]
    before = count(bootstrap, POLICY_VERSIONS)
    os.kill(first["Pid"], signal.SIGKILL)
    v_kill = max(v.version for v in read(bootstrap, POLICY_VERSIONS) if isinstance(v, PolicyVersion))

    def restarted():
        st = kube.container("rlstream-learner-pod-0", "learner")["State"]
        return st["Running"] and st["Pid"] not in (0, first["Pid"])
    wait_for(restarted, 120, "the learner pod's container to restart")
    wait_for(lambda: count(bootstrap, POLICY_VERSIONS) >= before + 3, 300, "3 versions of the resumed learner",
             every=2, on_timeout=lambda: kube.logs("rlstream-learner-pod-0", "learner"))
    versions = [v for v in read(bootstrap, POLICY_VERSIONS) if isinstance(v, PolicyVersion)]
    numbers = [v.version for v in versions]
    assert numbers == sorted(set(numbers))  # a learner started afresh would publish its versions again
    # the second life's first version names the snapshot it restored: at or before the last
    # version of the first life (the updates past the snapshot died with it), never version 0
    first_after = min((v for v in versions if v.version > v_kill), key=lambda v: v.version)
    assert first_after.version == v_kill + 1 and 1 <= first_after.parent_version <= v_kill, \
        (first_after.version, first_after.parent_version, v_kill)
    gaps = [(v.version, v.parent_version) for v in versions
            if v.parent_version is not None and v.parent_version != v.version - 1]
    assert len(gaps) <= 1, gaps
    report["learner_resumed"] = {"killed_at_version": v_kill, "first_version_after": first_after.version,
                                 "its_parent_snapshot": first_after.parent_version}
    print("DEPLOY kube:", json.dumps(report, sort_keys=True))


def test_the_learner_ranks_run_as_two_pods(kube, broker_and_redis):
    """compose/k8s/ranks/learner-ranks.yaml with 2 ranks, each a pod; an actor and the Faust worker
    feed them over 2 partitions. Both ranks train and both exit 0 at the budget."""
    bootstrap, rport = broker_and_redis
    ports = free_ports(4)
    port_of = {"actor": ports[0], "streams": ports[1]}
    master = ports[2]
    parts = ["--partitions", "2"]
    feeders = [for_this_machine(d, port_of, parts, 10**7) for f in ("actor.yaml", "streams.yaml")
               for d in docs(f) if d["kind"] == "Deployment"]
    (sts,) = [d for d in docs("ranks/learner-ranks.yaml") if d["kind"] == "StatefulSet"]
    world = 2
    assert sts["spec"]["replicas"] == world
    budget = 64 * 12
    ranks = []
    for rank in range(world):  # what the StatefulSet controller makes: pod <name>-<ordinal>
        pod_spec = copy.deepcopy(sts["spec"]["template"])
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"{sts['metadata']['name']}-{rank}",
                            "labels": {**pod_spec["metadata"]["labels"], "apps.kubernetes.io/pod-index": str(rank)}},
               "spec": pod_spec["spec"]}
        spec = pod["spec"]
        spec["hostNetwork"] = True
        spec["restartPolicy"] = "Never"
        spec["volumes"] = [{"name": "data", "emptyDir": {}}]  # volumeClaimTemplates: a volume per pod
        (c,) = spec["containers"]
        c["image"] = IMAGE
        c["resources"]["limits"].pop("nvidia.com/gpu")
        i = c["command"].index("--learner.device")
        c["command"][i + 1] = "cpu"
        c["command"] += [*RUN_ARGS, "--total-steps", str(budget), *parts]
        env_list(c, "RANK", str(rank))  # the fieldRef on the pod-index label, resolved
        env_list(c, "MASTER_ADDR", "127.0.0.1")
        env_list(c, "MASTER_PORT", str(master))
        env_list(c, "RLSTREAM_METRICS_PORT", str(ports[3]))
        env_list(c, "OMP_NUM_THREADS", "1")
        c.pop("ports")  # on the host's network: no port mappings
        ranks.append(pod)
    kube.play([configmap(bootstrap, rport), *ranks, *feeders], "ranks")

    def exited(name: str):
        st = kube.container(name, "learner")["State"]
        return st if st["Status"] == "exited" else None
    states = [wait_for(lambda n=f"rlstream-learner-ranks-{r}": exited(n), 600, f"rank {r} to reach its budget",
                       every=3, on_timeout=lambda: "\n".join(kube.logs(f"rlstream-learner-ranks-{i}", "learner")
                                                             for i in range(world)))
              for r in range(world)]
    # stdout and stderr come interleaved: the summary need not be among the last lines, nor start one
    logs = [kube.logs(f"rlstream-learner-ranks-{r}", "learner", 2000) for r in range(world)]
    assert [s["ExitCode"] for s in states] == [0, 0], [log[-3000:] for log in logs]

    def last(log: str, prefix: str) -> dict:
        """The last JSON object starting with ``prefix``, wherever the interleaving put it in a line."""
        at = log.rfind(prefix)
        assert at >= 0, f"no {prefix} in:\n{log[-3000:]}"
        return json.JSONDecoder().raw_decode(log, at)[0]

    summary = last(logs[0], '{"summary"')["summary"]
    rank1 = last(logs[1], '{"rank_summary"')
    assert summary["world_size"] == world and summary["rank"] == 0, summary
    steps = [s for s in read(bootstrap, LEARNER_STEPS) if isinstance(s, GradientStep)]
    assert sum(s.num_samples for s in steps) >= budget
    print("DEPLOY ranks:", json.dumps({"updates": summary["updates"], "samples_trained": summary["samples_trained"],
                                       "world_size": summary["world_size"], "rank1": rank1["rank_summary"].get("rank")}))
