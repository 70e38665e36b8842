"""Each container of compose/docker-compose.yml and compose/k8s/ run as a local process: its
command (+ args), with its environment (the ConfigMap's values, ``$(VAR)`` expanded as the kubelet
does), against a broker this test starts and the local Redis; every long-running role must
answer ``/healthz`` on its metrics port, the learner must join its consumer group under the
name the manifests give it, and the prune CronJob's command must exit 0. Containers cannot run
on these machines, so this is the closest honest check that the manifests start what they say.

What is changed, and only that, is what a container has and a process here does not:
service host names become the local broker and Redis (on free ports), a volume's mount path
becomes a directory under tmp, each metrics port a free port (roles share this host),
``--learner.device cuda`` becomes ``cpu`` when torch sees no GPU, and the ConfigMap's
``RLSTREAM_REPLICATION_FACTOR`` "3" and ``RLSTREAM_MIN_INSYNC_REPLICAS`` "2" become "1": the roles
run against a single local broker here, where a factor of 3 is refused by design
(``ReplicationError``; ``tests/ops/test_manifest_claims.py`` checks that every Kafka role gets 3 and 2,
``tests/faults/test_cluster_faults.py`` runs them on a 3-broker cluster). Every process runs in its own
session; the whole group is killed, pass or fail."""

from __future__ import annotations

import re
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from config.env import ENV_MIN_INSYNC_REPLICAS, ENV_REPLICATION_FACTOR
from tests.faults.conftest import private_kafka  # noqa: F401 (fixture)
from tests.support import Role, wait_for
from testbed.ports import free_port

from .test_manifests import COMPOSE, K8S, ROOT, config_map, load_yaml_docs, pod_env, role_of, rlstream_services

pytestmark = [pytest.mark.kafka, pytest.mark.redis, pytest.mark.slow]

VENV_BIN = str(Path(sys.executable).parent)
#: The ConfigMap's replication, overridden for the single local broker these commands run against.
SINGLE_BROKER = {ENV_REPLICATION_FACTOR: "1", ENV_MIN_INSYNC_REPLICAS: "1"}


def cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


def localise(value: str, local: dict[str, str]) -> str:
    """A manifest value with the cluster's service addresses replaced by the local ones."""
    for remote, here in local.items():
        value = value.replace(remote, here)
    return value


def k8s_containers(cm_values: dict[str, str]) -> dict[str, tuple[list[str], dict[str, str], dict[str, str]]]:
    """name -> (command + args, env, {mountPath: volume name}) of every rlstream container."""
    docs = [d for p in sorted(K8S.glob("*.yaml")) for d in load_yaml_docs(p) if d["kind"] != "Kustomization"]
    out = {}
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            spec = d["spec"]["template"]["spec"]
        elif d["kind"] == "CronJob":
            spec = d["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        else:
            continue
        for c in spec["containers"]:
            if not c["image"].startswith("rlstream"):
                continue
            env = pod_env(c, cm_values)  # the optional object-store Secret does not exist here: unset
            argv = [*c["command"], *c.get("args", [])]
            # the kubelet's $(VAR) expansion, from the container's own variables
            argv = [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), a) for a in argv]
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            out[d["metadata"]["name"]] = (argv, env, mounts)
    return out


def compose_containers(compose: dict[str, Any]) -> dict[str, tuple[list[str], dict[str, str], dict[str, str]]]:
    out = {}
    for name, svc in rlstream_services(compose).items():
        mounts = {v.split(":")[1]: v.split(":")[0] for v in svc.get("volumes", [])}
        out[name] = (list(svc["command"]), {k: str(v) for k, v in svc["environment"].items()}, mounts)
    return out


def is_one_shot(argv: list[str]) -> bool:
    return argv[:2] == ["rlstream", "prune"]


def run_containers(containers, tmp: Path, local: dict[str, str], while_running=lambda roles: None) -> None:
    """Start every container as a process, wait until each long-running one answers /healthz and
    each one-shot exits 0, call ``while_running``, then kill them all (pass or fail)."""
    roles: dict[str, tuple[Role, int]] = {}
    one_shots: dict[str, Role] = {}
    try:
        def start(name, argv, env, mounts):
            env = {k: localise(v, local) for k, v in env.items()}
            argv = [localise(a, local) for a in argv]
            for mount, volume in mounts.items():  # the volume: a directory here
                here = tmp / "volumes" / volume
                here.mkdir(parents=True, exist_ok=True)
                argv = [str(here) + a[len(mount):] if a == mount or a.startswith(mount + "/") else a for a in argv]
            if "--learner.device" in argv and argv[argv.index("--learner.device") + 1].startswith("cuda") and not cuda():
                argv[argv.index("--learner.device") + 1] = "cpu"
            home = tmp / "home" / name
            home.mkdir(parents=True)
            proc_env = {"PATH": f"{VENV_BIN}:/usr/bin:/bin", "HOME": str(home), "PYTHONPATH": str(ROOT),
                        "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HOSTNAME": f"{name}-0", **env}
            if is_one_shot(argv):
                one_shots[name] = Role(name, argv, tmp / f"{name}.log", proc_env, cwd=home)
                return
            port = free_port()
            proc_env["RLSTREAM_METRICS_PORT"] = str(port)
            if "--port" in argv:  # serve: the one port of its pod
                argv[argv.index("--port") + 1] = str(port)
            roles[name] = (Role(name, argv, tmp / f"{name}.log", proc_env, cwd=home), port)  # own session

        for name, (argv, env, mounts) in containers.items():
            if not is_one_shot(argv):
                start(name, argv, env, mounts)
        logs = lambda: "\n".join(f"--- {n}\n{r.tail(25)}" for n, r in  # noqa: E731
                                 [*((n, r) for n, (r, _) in roles.items()), *one_shots.items()])

        def healthy(role: Role, port: int) -> bool:
            assert role.alive(), f"{role.name} exited ({role.proc.returncode}):\n{role.tail()}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    return r.status == 200
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                return False

        for name, (role, port) in roles.items():
            wait_for(lambda: healthy(role, port), 180, f"{name}'s /healthz", every=0.5, on_timeout=logs)
        # the CronJob's job runs beside a running learner, as it would in the cluster
        for name, (argv, env, mounts) in containers.items():
            if is_one_shot(argv):
                start(name, argv, env, mounts)
        for name, role in one_shots.items():
            wait_for(lambda: not role.alive(), 120, f"{name} to finish", every=0.5, on_timeout=logs)
            assert role.proc.returncode == 0, f"{name}:\n{role.tail()}"
        assert {role_of(r.proc.args) for r, _ in roles.values()} >= {"actor", "streams", "learner", "serve"}
        while_running(roles)
        for name, (role, _) in roles.items():
            assert role.alive(), f"{name} exited ({role.proc.returncode}):\n{role.tail()}"
    finally:
        for role, _ in roles.values():
            if role.alive():
                role.kill()  # killpg: the process and its children
        for role in one_shots.values():
            if role.alive():
                role.kill()


def learner_group_joined(bootstrap: str, group: str) -> bool:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    listed = admin.list_consumer_groups(request_timeout=5).result()
    return group in {g.group_id for g in listed.valid}


@pytest.mark.parametrize("source", ["k8s", "compose"])
def test_every_container_command_starts_and_is_healthy(source, private_kafka, redis_url, redis_prefix,  # noqa: F811
                                                       tmp_path) -> None:
    redis_hostport = redis_url.split("//", 1)[1].split("/", 1)[0]
    if source == "k8s":
        docs = [d for p in sorted(K8S.glob("*.yaml")) for d in load_yaml_docs(p) if d["kind"] != "Kustomization"]
        # one broker here: the cluster's replication cannot be held (see the module docstring)
        cm = {**config_map(docs)["data"], **SINGLE_BROKER}
        local = {"rlstream-kafka-bootstrap.kafka.svc.cluster.local:9092": private_kafka.bootstrap,
                 "redis.rlstream.svc.cluster.local:6379": redis_hostport, "prefix=rlstream:snapshots":
                 f"prefix={redis_prefix}:snapshots"}
        containers = k8s_containers(cm)
        group = cm["RLSTREAM_LEARNER_GROUP"]
        assert "rlstream-prune" in containers
    else:
        compose = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
        local = {"kafka:9092": private_kafka.bootstrap, "redis:6379": redis_hostport,
                 "prefix=rlstream:snapshots": f"prefix={redis_prefix}:snapshots"}
        containers = compose_containers(compose)
        group = compose["x-rlstream-env"]["RLSTREAM_LEARNER_GROUP"]
    assert len(containers) >= 4
    assert group == "rl-trainers"

    def learner_in_its_group(roles) -> None:
        wait_for(lambda: learner_group_joined(private_kafka.bootstrap, group), 90,
                 f"the learner's consumer in group {group!r}", every=1.0, ignore=(Exception,),
                 on_timeout=lambda: roles["rlstream-learner" if source == "k8s" else "learner"][0].tail())

    run_containers(containers, tmp_path, local, learner_in_its_group)
