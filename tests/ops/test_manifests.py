"""compose/ and compose/k8s/ agree with runtime/ports.py, config/env.py, metrics.py and http.py."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from runtime.http import MetricsServer
from runtime.metrics import Metrics
from config.env import ENV_VARS
from runtime.ports import (
    COMMAND_ROLES,
    DEFAULT_PORTS,
    INFRA_PORTS,
    KNOWN_COMMANDS,
    LIVENESS_PROBE,
    STARTUP_PROBE,
)

from .test_metrics import FakeCuda

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose"
K8S = COMPOSE / "k8s"
RLSTREAM_IMAGE = "rlstream:latest"
TRAINING_ROLES = {"actor", "streams", "learner"}


def load_yaml_docs(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def k8s_docs() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs.extend(d for d in load_yaml_docs(path) if d["kind"] != "Kustomization")
    return docs


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads((COMPOSE / "grafana" / "dashboards" / "rlstream.json").read_text())


def role_of(command: list[str]) -> str:
    """Role (DEFAULT_PORTS key) a container command runs; fails on unknown commands."""
    if command[:1] == ["faust"]:
        assert command[:3] == ["faust", "-A", "streams"], command
        return "streams"
    assert command[0] == "rlstream", command
    assert command[1] in KNOWN_COMMANDS, f"unknown rlstream command {command[1]!r}"
    return COMMAND_ROLES.get(command[1], "")


def exported_series_names() -> set[str]:
    """Every series name the Metrics registry can expose (GPU included, via a fake GPU)."""
    m = Metrics(gpu_probe=FakeCuda())
    names: set[str] = set()
    for line in m.render().decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "histogram":
                names.update({f"{name}_bucket", f"{name}_sum", f"{name}_count"})
    return names


# -- every file parses -------------------------------------------------------


def test_every_yaml_and_json_file_parses() -> None:
    files = sorted(p for p in COMPOSE.rglob("*") if p.suffix in (".yml", ".yaml", ".json"))
    assert len(files) >= 10
    for path in files:
        if path.suffix == ".json":
            json.loads(path.read_text())
        else:
            assert load_yaml_docs(path), f"{path} is empty"


# -- docker compose ----------------------------------------------------------


def rlstream_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in compose["services"].items() if s.get("image") == RLSTREAM_IMAGE or "build" in s}


def test_compose_infrastructure(compose: dict[str, Any]) -> None:
    services = compose["services"]
    kafka = services["kafka"]
    assert kafka["image"] == "apache/kafka:3.9.1"
    env = kafka["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft, single node
    assert f"PLAINTEXT://kafka:{INFRA_PORTS['kafka']}" in env["KAFKA_ADVERTISED_LISTENERS"]
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == f"1@kafka:{INFRA_PORTS['kafka_controller']}"
    assert {"redis", "prometheus", "grafana"} <= set(services)
    assert f"{INFRA_PORTS['prometheus']}:{INFRA_PORTS['prometheus']}" in services["prometheus"]["ports"]
    assert f"{INFRA_PORTS['grafana']}:{INFRA_PORTS['grafana']}" in services["grafana"]["ports"]


def test_compose_roles_ports_env_and_commands(compose: dict[str, Any]) -> None:
    services = rlstream_services(compose)
    roles_seen = set()
    for name, svc in services.items():
        assert svc["build"] == {"context": "..", "dockerfile": "compose/Dockerfile"}, name
        env = svc["environment"]
        assert set(env) <= set(ENV_VARS), f"{name}: unknown env {set(env) - set(ENV_VARS)}"
        assert env["KAFKA_BROKERS"] == f"kafka:{INFRA_PORTS['kafka']}"
        assert env["REDIS_URL"].startswith(f"redis://redis:{INFRA_PORTS['redis']}/")
        role = role_of(svc["command"])
        assert role, f"{name}: {svc['command']} is not a long-running role"
        roles_seen.add(role)
        if role in COMMAND_ROLES.values() and role != "serve":
            assert "--log-json" in svc["command"], f"{name}: services log JSON"
        port = DEFAULT_PORTS[role]
        assert int(env["RLSTREAM_METRICS_PORT"]) == port, name
        published = [str(p) for p in svc.get("expose", [])] + [str(p).split(":")[-1] for p in svc.get("ports", [])]
        assert str(port) in published, f"{name} does not expose {port}"
    assert TRAINING_ROLES | {"serve"} <= roles_seen
    assert services["actor"]["command"][:4] == ["rlstream", "actor", "--index", "0"]
    assert role_of(services["streams"]["command"]) == "streams"
    assert services["streams"]["command"] == ["faust", "-A", "streams", "worker", "-l", "info"]


def test_dockerfile() -> None:
    text = (COMPOSE / "Dockerfile").read_text()
    # the base is a build argument: a public image by default, the debootstrap one where nothing pulls
    assert re.search(r"^ARG BASE=python:3\.11-slim$", text, re.M)
    assert re.search(r"^FROM \$\{BASE\}$", text, re.M)
    assert re.search(r"^ARG TORCH_INDEX_URL=", text, re.M)
    assert re.search(r"pip install .*/src", text)
    # the dependencies are a layer of their own, before the project's code
    assert text.index("COPY pyproject.toml") < text.index("-r /src/requirements.txt") < text.index("COPY . /src")
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    assert cmd[0] == "rlstream"
    assert "RLSTREAM_METRICS_PORT" in text and "/healthz" in text


def test_prometheus_scrapes_every_role_port(compose: dict[str, Any]) -> None:
    cfg = yaml.safe_load((COMPOSE / "prometheus" / "prometheus.yml").read_text())
    targets: dict[str, int] = {}
    for job in cfg["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            for name in sd["names"]:
                targets[name] = int(sd["port"])
        for sc in job.get("static_configs", []):
            for t in sc["targets"]:
                host, port = t.rsplit(":", 1)
                targets[host] = int(port)
    services = compose["services"]
    for role in ("actor", "streams", "learner", "serve"):
        assert targets[role] == DEFAULT_PORTS[role], role
        assert role in services
    mount = services["prometheus"]["volumes"][0]
    assert mount.startswith("./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml")


def test_grafana_provisioning_matches_compose(compose: dict[str, Any], dashboard: dict[str, Any]) -> None:
    ds = yaml.safe_load((COMPOSE / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"][0]
    assert ds["url"] == f"http://prometheus:{INFRA_PORTS['prometheus']}"
    provider = yaml.safe_load((COMPOSE / "grafana/provisioning/dashboards/rlstream.yml").read_text())["providers"][0]
    mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"] if v.startswith("./"))
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    uids = set()
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            uids.add(panel["datasource"]["uid"])
            uids.update(t["datasource"]["uid"] for t in panel["targets"])
    assert uids == {ds["uid"]}


# -- Grafana dashboard vs metrics.py ----------------------------------------


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"]]
    return exprs


def test_every_dashboard_metric_exists(dashboard: dict[str, Any]) -> None:
    exported = exported_series_names()
    referenced = {m for e in dashboard_exprs(dashboard) for m in re.findall(r"\brlstream_[a-z0-9_]+", e)}
    assert referenced, "dashboard references no rlstream metric"
    missing = referenced - exported
    assert not missing, f"dashboard uses metrics that metrics.py does not export: {sorted(missing)}"


def test_dashboard_covers_the_required_panels(dashboard: dict[str, Any]) -> None:
    text = "\n".join(dashboard_exprs(dashboard))
    for metric in (
        "rlstream_policy_latency_seconds_bucket",
        "rlstream_gpu_utilization_ratio",
        "rlstream_gpu_memory_allocated_bytes",
        "rlstream_samples_total",
        "rlstream_sample_freshness_ratio",
        "rlstream_consumer_lag",
        "rlstream_drops_total",
        "rlstream_dead_letters_total",
        "rlstream_batch_size",
        "rlstream_fragment_length",
        "rlstream_circuit_breaker_state",
        "rlstream_policy_lag_versions",
    ):
        assert metric in text, metric
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_name_check_can_fail() -> None:
    """The check above really compares names (guard against a vacuous test)."""
    exported = exported_series_names()
    assert "rlstream_policy_latency_seconds_bucket" in exported
    assert "rlstream_learner_steps_total" in exported
    assert "rlstream_policy_latency_bucket" not in exported
    assert "rlstream_learner_steps" not in exported  # counters only as *_total


# -- Kubernetes ---------------------------------------------------------------


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def test_k8s_kustomization_lists_every_file() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == files
    assert kust["namespace"] == "rlstream"


def test_k8s_namespace_and_configmap(k8s_docs: list[dict[str, Any]]) -> None:
    (ns,) = by_kind(k8s_docs, "Namespace")
    for d in k8s_docs:
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == ns["metadata"]["name"], d["metadata"]["name"]
    cm = config_map(k8s_docs)
    assert set(cm["data"]) <= set(ENV_VARS)
    assert cm["data"]["KAFKA_BROKERS"].endswith(f":{INFRA_PORTS['kafka']}")


WORKLOAD_KINDS = ("Deployment", "StatefulSet")


def config_map(k8s_docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The ConfigMap every rlstream container reads its variables from."""
    (cm,) = [d for d in by_kind(k8s_docs, "ConfigMap") if d["metadata"]["name"] == "rlstream-config"]
    return cm


def pod_env(c: dict[str, Any], cm: dict[str, str]) -> dict[str, str]:
    """A container's environment as the kubelet gives it: values, and ConfigMap keys resolved
    (Secret references, which no file here holds, left out)."""
    out = {}
    for e in c.get("env", []):
        ref = e.get("valueFrom", {}).get("configMapKeyRef")
        if "value" in e:
            out[e["name"]] = e["value"]
        elif ref is not None and ref["name"] == "rlstream-config":
            out[e["name"]] = cm[ref["key"]]
    return out


def is_rlstream_image(image: str) -> bool:
    return image.split(":")[0] in ("rlstream", "rlstream-gpu")


def workloads(k8s_docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The long-running rlstream workloads (Prometheus's Deployment is not one)."""
    return [d for d in k8s_docs if d["kind"] in WORKLOAD_KINDS
            and all(is_rlstream_image(c["image"]) for c in d["spec"]["template"]["spec"]["containers"])]


def pod_specs(k8s_docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pod specs of every workload and CronJob running an rlstream image."""
    specs = [d["spec"]["template"]["spec"] for d in workloads(k8s_docs)]
    specs += [d["spec"]["jobTemplate"]["spec"]["template"]["spec"] for d in by_kind(k8s_docs, "CronJob")]
    return specs


def deployments(k8s_docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Workloads by role."""
    out = {}
    for d in workloads(k8s_docs):
        (container,) = d["spec"]["template"]["spec"]["containers"]
        out[role_of(container["command"])] = d
    return out


def test_k8s_deployments_ports_probes_env_annotations(k8s_docs: list[dict[str, Any]]) -> None:
    cm = config_map(k8s_docs)
    deps = deployments(k8s_docs)
    assert set(deps) == TRAINING_ROLES | {"serve"}
    for role, dep in deps.items():
        port = DEFAULT_PORTS[role]
        tmpl = dep["spec"]["template"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= tmpl["metadata"]["labels"].items()
        ann = tmpl["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true"
        assert int(ann["prometheus.io/port"]) == port, role
        assert ann["prometheus.io/path"] == "/metrics"
        (c,) = tmpl["spec"]["containers"]
        assert [p["containerPort"] for p in c["ports"]] == [port], role
        assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port}, role
        # one source for the numbers: runtime.ports, which the local supervisor probes with too
        for key, probe in (("livenessProbe", LIVENESS_PROBE), ("startupProbe", STARTUP_PROBE)):
            assert c[key]["httpGet"]["path"] == probe.path, (role, key)
            assert (c[key]["periodSeconds"], c[key].get("timeoutSeconds", 1), c[key]["failureThreshold"]) \
                == (probe.period_s, probe.timeout_s, probe.failure_threshold), (role, key)
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port}, role
        env = {e["name"]: e for e in c["env"]}
        assert set(env) <= set(ENV_VARS), f"{role}: unknown env {set(env) - set(ENV_VARS)}"
        assert "KAFKA_BROKERS" in env and "REDIS_URL" in env
        assert int(env["RLSTREAM_METRICS_PORT"]["value"]) == port
        for e in env.values():
            ref = e.get("valueFrom", {}).get("configMapKeyRef")
            if ref:
                assert ref["name"] == cm["metadata"]["name"] and ref["key"] in cm["data"], e
        for var in re.findall(r"\$\(([A-Z_]+)\)", " ".join(c["command"])):
            assert var in env, f"{role}: command uses $({var}) but the container does not define it"
        if role != "serve":
            assert "--log-json" in c["command"] or c["command"][0] == "faust"
    assert deps["learner"]["spec"]["replicas"] == 1
    assert deps["learner"]["spec"]["strategy"]["type"] == "Recreate"
    assert deps["learner"]["kind"] == "Deployment"


def test_k8s_actors_are_a_deployment_without_indices(k8s_docs: list[dict[str, Any]]) -> None:
    actor = deployments(k8s_docs)["actor"]
    assert actor["kind"] == "Deployment"  # interchangeable pods: ids come from rl.actors (actor.identity)
    (c,) = actor["spec"]["template"]["spec"]["containers"]
    assert c["command"][:2] == ["rlstream", "actor"] and "--index" not in c["command"]


def test_k8s_inference_service(k8s_docs: list[dict[str, Any]]) -> None:
    services = {s["metadata"]["name"]: s for s in by_kind(k8s_docs, "Service")}
    svc = services["rlstream-serve"]
    assert svc["spec"]["type"] == "ClusterIP"
    serve = deployments(k8s_docs)["serve"]
    assert svc["spec"]["selector"].items() <= serve["spec"]["template"]["metadata"]["labels"].items()
    (port,) = svc["spec"]["ports"]
    assert port["port"] == DEFAULT_PORTS["serve"]
    (c,) = serve["spec"]["template"]["spec"]["containers"]
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert named[port["targetPort"]] == DEFAULT_PORTS["serve"]
    assert c["command"][:2] == ["rlstream", "serve"]
    assert c["command"][c["command"].index("--port") + 1] == str(DEFAULT_PORTS["serve"])


# -- commands and probe paths are real ---------------------------------------


def all_commands(compose: dict[str, Any], k8s_docs: list[dict[str, Any]]) -> list[list[str]]:
    cmds = [s["command"] for s in rlstream_services(compose).values()]
    gpu = yaml.safe_load((COMPOSE / "docker-compose.gpu.yml").read_text())
    cmds += [s["command"] for s in gpu["services"].values() if "command" in s]
    for spec in pod_specs(k8s_docs):
        cmds += [c["command"] for c in spec["containers"]]
    return cmds


def test_every_rlstream_command_parses_with_the_real_cli(compose: dict[str, Any], k8s_docs: list[dict[str, Any]],
                                                         capsys: pytest.CaptureFixture) -> None:
    """Each manifest command goes through ``rlstream.cli.build_parser`` as the container would run
    it (``$(VAR)`` expanded to a sample value): an option renamed or removed in the CLI fails here."""
    from rlstream.cli import build_parser

    cmds = all_commands(compose, k8s_docs)
    assert len(cmds) >= 10
    for cmd in cmds:
        if cmd[0] != "rlstream":
            assert cmd[:3] == ["faust", "-A", "streams"], cmd
            continue
        argv = [re.sub(r"\$\([A-Z_]+\)", "0", a) for a in cmd[1:]]
        try:
            ns = build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{cmd}: rejected by the rlstream CLI: {capsys.readouterr().err.strip()}")
        assert ns.command == cmd[1] and cmd[1] in KNOWN_COMMANDS, cmd


def test_probe_paths_are_served(k8s_docs: list[dict[str, Any]]) -> None:
    paths = set()
    for dep in workloads(k8s_docs):
        for c in dep["spec"]["template"]["spec"]["containers"]:
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                paths.add(c[probe]["httpGet"]["path"])
            paths.add(dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"])
    assert paths == {"/healthz", "/readyz", "/metrics"}
    with MetricsServer(Metrics(gpu=False), host="127.0.0.1", port=0) as srv:
        for path in sorted(paths):
            try:
                with urllib.request.urlopen(srv.url + path, timeout=5) as resp:
                    assert resp.status == 200, path
            except urllib.error.HTTPError as err:  # pragma: no cover - reported as failure
                pytest.fail(f"{path}: HTTP {err.code}")


# -- the learner as N data-parallel ranks (k8s/ranks, not in the kustomization) --------------------

def test_learner_ranks_statefulset_validates_and_agrees_with_the_learner() -> None:
    import kubernetes_validate

    from tests.ops.test_manifest_schemas import K8S_VERSIONS

    ranks = load_yaml_docs(K8S / "ranks" / "learner-ranks.yaml")
    for d in ranks:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(d, version, strict=True)
    sts = next(d for d in ranks if d["kind"] == "StatefulSet")
    svc = next(d for d in ranks if d["kind"] == "Service")
    assert svc["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == svc["metadata"]["name"]
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    world = sts["spec"]["replicas"]
    assert env["WORLD_SIZE"]["value"] == str(world) and c["command"][c["command"].index("--learner.learners") + 1] == str(world)
    assert env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert env["MASTER_ADDR"]["value"].startswith(f"{sts['metadata']['name']}-0.{svc['metadata']['name']}.")
    assert env["MASTER_PORT"]["value"] == str(svc["spec"]["ports"][0]["port"])
    assert sts["spec"]["template"]["metadata"]["labels"]["app"] == "rl-trainer"
    learner = next(d for d in load_yaml_docs(K8S / "learner.yaml") if d["kind"] == "Deployment")
    (lc,) = learner["spec"]["template"]["spec"]["containers"]
    assert {e["name"] for e in lc["env"] if "configMapKeyRef" in e.get("valueFrom", {})} == \
        {e["name"] for e in c["env"] if "configMapKeyRef" in e.get("valueFrom", {})}
    assert "--resume" in c["command"] and role_of(c["command"]) == "learner"


# -- a fenced learner waits where every exit is restarted ------------------------------------------

def learner_commands() -> dict[str, list[str]]:
    """Every learner command of the manifests, by where it is: Kubernetes (a Deployment and the
    StatefulSet of ranks) and docker compose (the file, its GPU override, the host's variant)."""
    out = {}
    for path in (K8S / "learner.yaml", K8S / "ranks" / "learner-ranks.yaml"):
        (workload,) = [d for d in load_yaml_docs(path) if d["kind"] in ("Deployment", "StatefulSet")]
        (c,) = workload["spec"]["template"]["spec"]["containers"]
        out[str(path.relative_to(COMPOSE))] = c["command"]
    for name in ("docker-compose.yml", "docker-compose.gpu.yml", "docker-compose.host.yml"):
        cmd = yaml.safe_load((COMPOSE / name).read_text())["services"]["learner"]["command"]
        if cmd[:2] == ["sh", "-c"]:  # exec rlstream learner ... $$RLSTREAM_ROLE_ARGS
            cmd = [a for a in cmd[2].replace("exec ", "", 1).split() if not a.startswith("$")]
        out[name] = cmd
    return out


def test_every_learner_waits_when_fenced() -> None:
    """Kubernetes restarts every container that exits (a Deployment allows no other
    restartPolicy), and so does docker compose's ``restart: unless-stopped``/``on-failure`` for
    exit 4: a fenced learner that exited would be restarted and fence the newer learner in turn
    (ping-pong). Every manifest's learner runs ``--learner.on-fenced wait``, as the real CLI reads it."""
    from rlstream.cli import build_parser

    cmds = learner_commands()
    assert len(cmds) == 5
    for where, cmd in cmds.items():
        assert role_of(cmd) == "learner", where
        argv = [re.sub(r"\$\([A-Z_]+\)", "0", a) for a in cmd[1:]]
        assert build_parser().parse_args(argv).train.learner.on_fenced == "wait", f"{where}: {cmd}"
    for path in (K8S / "learner.yaml", K8S / "ranks" / "learner-ranks.yaml"):
        (workload,) = [d for d in load_yaml_docs(path) if d["kind"] in ("Deployment", "StatefulSet")]
        assert workload["spec"]["template"]["spec"].get("restartPolicy", "Always") == "Always", path
        assert "--learner.on-fenced wait" in path.read_text().split("apiVersion")[0].replace("\n#", ""), \
            f"{path.name}'s header does not say why it waits when fenced"
