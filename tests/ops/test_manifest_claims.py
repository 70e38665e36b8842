"""What compose/ and compose/k8s/ claim, checked against each other and the code (issue 24, part 3):
the learner resumes from state that outlives its container; a GPU is requested only with the GPU
image and ``--learner.device cuda``; the Prometheus the KEDA trigger queries is deployed and scrapes every
role; the deployment guide's labels and consumer group exist; the learner tolerates preemption;
every artefact has a documented lifecycle and run directories are pruned; every role that talks to
Kafka creates its topics at the replication the ConfigMap sets (issue 24, part 1); an s3://
snapshot store's sign-in reaches the learner and the rollback Job from a Secret (issue 27)."""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlparse

import kubernetes_validate
import pytest
import yaml

from config.bus import BusConfig, Replication
from config.env import ENV_KAFKA_BROKERS, ENV_LEARNER_GROUP, ENV_VARS, Environment
from config.storage import ObjectStoreConfig
from runtime.ports import DEFAULT_PORTS
from runtime.prune import DEFAULT_OLDER_THAN
from streams.topics import TOPICS

from .test_manifests import COMPOSE, K8S, ROOT, by_kind, config_map, deployments, load_yaml_docs, pod_env

GUIDE_GROUP = "rl-trainers"  # kafka-consumer-groups.sh --describe --group rl-trainers
GUIDE_INFERENCE_LABEL = ("app", "inference-worker")  # kubectl get pods -l app=inference-worker


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return [d for p in sorted(K8S.glob("*.yaml")) for d in load_yaml_docs(p) if d["kind"] != "Kustomization"]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def gpu_overlay() -> dict[str, Any]:
    return yaml.safe_load((COMPOSE / "docker-compose.gpu.yml").read_text())


def container(dep: dict[str, Any]) -> dict[str, Any]:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def under(path: str, mount: str) -> bool:
    return PurePosixPath(mount) in (PurePosixPath(path), *PurePosixPath(path).parents)


# -- the learner resumes from state that outlives its container -----------------------------------

def test_k8s_learner_resumes_with_its_run_directory_on_a_claim(docs) -> None:
    learner = deployments(docs)["learner"]
    c, spec = container(learner), learner["spec"]["template"]["spec"]
    assert "--resume" in c["command"]
    run_dir = flag(c["command"], "--run-dir")
    assert run_dir, "the learner's run directory must be given (the default is inside the container)"
    volumes = {v["name"]: v for v in spec["volumes"]}
    (mount,) = [m for m in c["volumeMounts"] if under(run_dir, m["mountPath"])]
    claim = volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]
    claims = {d["metadata"]["name"]: d for d in by_kind(docs, "PersistentVolumeClaim")}
    # ReadWriteOnce: any storage class has it (prune.yaml's podAffinity relies on it)
    assert claims[claim]["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsUser"]  # the claim is writable
    store = config_map(docs)["data"]["RLSTREAM_SNAPSHOT_STORE"]
    # snapshots outlive the pod: an external Redis, or a path on the claim
    assert urlparse(store).scheme == "redis" or under(urlparse(store).path, mount["mountPath"]), store


def test_compose_learner_resumes_with_its_run_directory_on_a_named_volume(compose, gpu_overlay) -> None:
    for svc in (compose["services"]["learner"], gpu_overlay["services"]["learner"]):
        assert "--resume" in svc["command"]
        run_dir = flag(svc["command"], "--run-dir")
        named = [v.split(":") for v in compose["services"]["learner"]["volumes"]]
        assert any(under(run_dir, target) and name in compose["volumes"] for name, target in named), run_dir
    assert compose["services"]["redis"]["command"][1:3] == ["--appendonly", "yes"]  # snapshots survive Redis
    assert urlparse(compose["x-rlstream-env"]["RLSTREAM_SNAPSHOT_STORE"]).scheme == "redis"


def test_the_image_makes_the_data_directory_writable() -> None:
    for name in ("Dockerfile", "Dockerfile.gpu"):
        text = (COMPOSE / name).read_text()
        assert re.search(r"mkdir -p /data && chown 10001 /data", text), name
        assert "USER 10001" in text


# -- a GPU is requested only with the GPU image and --learner.device cuda ---------------------------------

def test_a_gpu_container_runs_the_gpu_image_with_device_cuda(docs) -> None:
    gpu_roles = []
    for role, dep in deployments(docs).items():
        c = container(dep)
        wants_gpu = "nvidia.com/gpu" in c.get("resources", {}).get("limits", {})
        device = flag(c["command"], "--learner.device") or "cpu"
        if wants_gpu:
            gpu_roles.append(role)
            assert device.startswith("cuda"), f"{role} reserves a GPU but runs on {device}"
            assert c["image"].split(":")[0] == "rlstream-gpu", f"{role}: the CPU image cannot use the GPU"
        else:
            assert not device.startswith("cuda") and c["image"].split(":")[0] == "rlstream", role
    assert gpu_roles == ["learner"]
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert {i["name"] for i in kust["images"]} == {"rlstream", "rlstream-gpu"}


def test_the_compose_gpu_overlay_and_the_gpu_image(gpu_overlay) -> None:
    learner = gpu_overlay["services"]["learner"]
    (device,) = learner["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"] and device["count"] == 1
    assert flag(learner["command"], "--learner.device") == "cuda"
    assert learner["build"]["dockerfile"] == "compose/Dockerfile.gpu"
    assert learner["image"].split(":")[0] == "rlstream-gpu"
    text = (COMPOSE / "Dockerfile.gpu").read_text()
    assert re.search(r'pip install "/src\[gpu\]"', text)
    assert "whl/cpu" not in text, "the GPU image must not install the CPU-only torch wheels"
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in text
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r"^gpu = \[", pyproject, re.M)
    assert (COMPOSE / "Dockerfile.gpu.dockerignore").read_text().splitlines()[1:] == \
        (COMPOSE / "Dockerfile.dockerignore").read_text().splitlines()[1:]


# -- the Prometheus KEDA queries is deployed and scrapes every role ------------------------------

def test_the_keda_prometheus_is_deployed_here_and_scrapes_the_annotated_pods(docs) -> None:
    addresses = {t["metadata"]["serverAddress"] for d in by_kind(docs, "ScaledObject")
                 for t in d["spec"]["triggers"] if t["type"] == "prometheus"}
    (address,) = addresses
    url = urlparse(address)
    host, port = url.hostname, url.port
    services = {(s["metadata"]["name"], s["metadata"]["namespace"]): s for s in by_kind(docs, "Service")}
    name, ns = host.split(".")[:2]
    assert host == f"{name}.{ns}.svc.cluster.local", host
    svc = services[(name, ns)]
    (sport,) = svc["spec"]["ports"]
    assert sport["port"] == port
    (prom,) = [d for d in by_kind(docs, "Deployment") if svc["spec"]["selector"].items()
               <= d["spec"]["template"]["metadata"]["labels"].items()]
    c = container(prom)
    assert c["image"].startswith("prom/prometheus:")
    assert {p["name"]: p["containerPort"] for p in c["ports"]}[sport["targetPort"]] == port
    spec = prom["spec"]["template"]["spec"]
    cfg_volume = next(v for v in spec["volumes"] if "configMap" in v)
    cm = next(d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"] == cfg_volume["configMap"]["name"])
    cfg = yaml.safe_load(cm["data"]["prometheus.yml"])
    (job,) = cfg["scrape_configs"]
    (sd,) = job["kubernetes_sd_configs"]
    assert sd["role"] == "pod" and sd["namespaces"]["names"] == [ns]
    rules = {tuple(r["source_labels"]): r for r in job["relabel_configs"]}
    keep = rules[("__meta_kubernetes_pod_annotation_prometheus_io_scrape",)]
    assert keep["action"] == "keep" and keep["regex"] == "true"
    assert rules[("__meta_kubernetes_pod_annotation_prometheus_io_path",)]["target_label"] == "__metrics_path__"
    addr = rules[("__address__", "__meta_kubernetes_pod_annotation_prometheus_io_port")]
    assert re.sub(addr["regex"], addr["replacement"].replace("$", "\\"), "10.0.0.7:8080;9103") == "10.0.0.7:9103"
    # the Role lets it list the pods it discovers
    (role,) = [r for r in by_kind(docs, "Role") if r["metadata"]["name"] == spec["serviceAccountName"]]
    assert any("pods" in rule["resources"] and {"list", "watch"} <= set(rule["verbs"]) for rule in role["rules"])
    # every role is annotated for it, on its port (tests/ops/test_manifests.py checks the ports)
    for r, dep in deployments(docs).items():
        ann = dep["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and int(ann["prometheus.io/port"]) == DEFAULT_PORTS[r]


# -- the deployment guide's names -----------------------------------------------------------------

def test_the_guides_labels_and_consumer_group(docs, compose) -> None:
    deps = deployments(docs)
    k, v = GUIDE_INFERENCE_LABEL
    assert deps["serve"]["spec"]["template"]["metadata"]["labels"][k] == v
    assert deps["learner"]["spec"]["template"]["metadata"]["labels"]["app"] == "rl-trainer"
    apps = [d["spec"]["template"]["metadata"]["labels"].get("app") for d in deps.values()]
    assert len(set(apps)) == len(apps), "one app label per role"
    assert config_map(docs)["data"][ENV_LEARNER_GROUP] == GUIDE_GROUP
    for role in ("actor", "learner"):  # the learner commits under it; actors read its backlog
        env = {e["name"]: e for e in container(deps[role])["env"]}
        assert env[ENV_LEARNER_GROUP]["valueFrom"]["configMapKeyRef"]["key"] == ENV_LEARNER_GROUP, role
    assert compose["x-rlstream-env"][ENV_LEARNER_GROUP] == GUIDE_GROUP


# -- replication ----------------------------------------------------------------------------------

def test_every_kafka_role_creates_its_topics_at_replication_3_with_2_in_sync(docs) -> None:
    """The one setting (``RLSTREAM_REPLICATION_FACTOR``, ``RLSTREAM_MIN_INSYNC_REPLICAS``) in the
    ConfigMap reaches each role that talks to Kafka, read by the code the role runs: ``BusConfig``
    for the rlstream commands, ``StreamsSettings`` for the Faust worker."""
    from streams.settings import StreamsSettings

    cm = config_map(docs)["data"]
    seen = {}
    for role, dep in deployments(docs).items():
        env = pod_env(container(dep), cm)
        if ENV_KAFKA_BROKERS not in env:
            continue
        environment = Environment(env)
        settings = (StreamsSettings.from_environment(environment).replication if role == "streams"
                    else BusConfig.from_environment(environment).replication)
        seen[role] = (settings.factor, settings.min_insync)
    assert seen == {role: (3, 2) for role in ("actor", "learner", "streams", "serve")}, seen
    assert Replication(3, 2).topic_config() == {"min.insync.replicas": "2"}


# -- preemption -----------------------------------------------------------------------------------

def test_the_learner_tolerates_spot_nodes_and_has_time_for_its_last_snapshot(docs, compose) -> None:
    learner = deployments(docs)["learner"]
    spec = learner["spec"]["template"]["spec"]
    assert learner["spec"]["strategy"]["type"] == "Recreate"
    assert 10 <= spec["terminationGracePeriodSeconds"] <= 30  # a spot node's notice is 30 s on GKE/AKS
    tolerated = {t["key"] for t in spec["tolerations"]}
    assert {"cloud.google.com/gke-spot", "kubernetes.azure.com/scalesetpriority"} <= tolerated
    preferred = {e["key"] for p in spec["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
                 for e in p["preference"]["matchExpressions"]}
    assert {"cloud.google.com/gke-spot", "eks.amazonaws.com/capacityType", "karpenter.sh/capacity-type"} <= preferred
    assert compose["services"]["learner"]["stop_grace_period"] == f"{spec['terminationGracePeriodSeconds']}s"


# -- retention ------------------------------------------------------------------------------------

def test_the_prune_cronjob_prunes_the_learners_runs_on_its_claim(docs) -> None:
    (cron,) = by_kind(docs, "CronJob")
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    cmd = c["command"]
    assert cmd[:2] == ["rlstream", "prune"] and "--yes" in cmd
    assert flag(cmd, "--older-than") == DEFAULT_OLDER_THAN == "30d"  # the guide: 30 days
    learner = deployments(docs)["learner"]
    lc = container(learner)
    run_dir = PurePosixPath(flag(lc["command"], "--run-dir"))
    assert PurePosixPath(cmd[2]) == run_dir.parent, "prune the directory the learner's runs are in"
    claim = lambda spec, mount: next(v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"]  # noqa: E731
                                     if v["name"] == mount["name"])
    (pm,) = c["volumeMounts"]
    (lm,) = lc["volumeMounts"]
    assert claim(pod, pm) == claim(learner["spec"]["template"]["spec"], lm) and pm["mountPath"] == lm["mountPath"]
    (term,) = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"  # a ReadWriteOnce claim: the learner's node
    assert term["labelSelector"]["matchLabels"].items() <= learner["spec"]["template"]["metadata"]["labels"].items()


def test_every_artefact_has_a_documented_lifecycle() -> None:
    text = (ROOT / "docs" / "howto" / "operate.md").read_text()
    table = text[text.index("## Retention"):].split("\n## ")[0]  # to the next section, or the end
    for topic in TOPICS:
        assert f"`{topic}`" in table, topic
    for artefact in ("process logs", "TensorBoard", "snapshot", "consumer offsets", "Faust", "Prometheus",
                     "claim-check", "prune.yaml"):
        assert artefact in table, artefact


# -- snapshots in object storage: the sign-in reaches the learner and the rollback job ------------

OBJECT_STORE_SECRET = "rlstream-object-store"
ROLLBACK_JOB = K8S / "jobs" / "rollback.yaml"


def rollback_job() -> dict[str, Any]:
    (job,) = load_yaml_docs(ROLLBACK_JOB)
    return job


def secret_vars(c: dict[str, Any]) -> dict[str, str]:
    """Variable -> the key of the object-store Secret it is read from (optional references only)."""
    out = {}
    for e in c["env"]:
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            assert ref["name"] == OBJECT_STORE_SECRET and ref.get("optional") is True, e
            out[e["name"]] = ref["key"]
    return out


def test_an_s3_snapshot_store_signs_in_from_a_secret_in_the_learner_and_the_rollback_job(docs, compose) -> None:
    """An ``s3://`` RLSTREAM_SNAPSHOT_STORE needs the endpoint and credentials ``config/storage.py``
    reads: the learner (which writes and restores snapshots) and the rollback Job get each from the
    Secret, under the same name, and ``ObjectStoreConfig`` fills every field but the session token
    from exactly those variables. No Secret with values is committed. docs/deploy.md says how."""
    job = rollback_job()
    for name, c in (("learner", container(deployments(docs)["learner"])),
                    ("rollback", job["spec"]["template"]["spec"]["containers"][0])):
        env = {e["name"]: e for e in c["env"]}
        assert env["RLSTREAM_SNAPSHOT_STORE"]["valueFrom"]["configMapKeyRef"]["key"] == "RLSTREAM_SNAPSHOT_STORE", name
        vars_ = secret_vars(c)
        assert all(var == key for var, key in vars_.items()), vars_
        store = ObjectStoreConfig.from_environment(Environment({v: f"value-of-{v}" for v in vars_}))
        assert store == ObjectStoreConfig(endpoint_url="value-of-AWS_ENDPOINT_URL", region="value-of-AWS_REGION",
                                          access_key_id="value-of-AWS_ACCESS_KEY_ID",
                                          secret_access_key="value-of-AWS_SECRET_ACCESS_KEY"), name
        assert set(vars_) <= set(ENV_VARS)
    assert not by_kind(docs, "Secret"), "credentials are created by the operator, never committed"
    # compose: the learner reads them from a git-ignored env file when it exists
    (env_file,) = compose["services"]["learner"]["env_file"]
    assert env_file == {"path": "./object-store.env", "required": False}
    assert "compose/object-store.env" in (ROOT / ".gitignore").read_text().splitlines()
    assert "compose" in (COMPOSE / "Dockerfile.dockerignore").read_text().splitlines()  # not in the image
    deploy = (ROOT / "docs" / "deploy.md").read_text()
    assert f"create secret generic {OBJECT_STORE_SECRET}" in deploy
    for var in vars_:
        assert f"--from-literal={var}=" in deploy and f"{var}=" in deploy, var
    assert "compose/k8s/jobs/rollback.yaml" in deploy and "object-store.env" in deploy


def test_the_rollback_job_runs_rollback_and_is_never_applied_by_the_kustomization(capsys) -> None:
    from rlstream.cli import build_parser

    from .test_manifest_schemas import K8S_VERSIONS

    job = rollback_job()
    kubernetes_validate.validate(job, K8S_VERSIONS[-1], strict=True)
    assert job["kind"] == "Job" and "generateName" in job["metadata"]  # kubectl create: a new Job each time
    (c,) = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    for var in re.findall(r"\$\(([A-Z_]+)\)", " ".join(c["command"])):
        assert var in env, var
    argv = [re.sub(r"\$\([A-Z_]+\)", env["ROLLBACK_TO"]["value"], a) for a in c["command"][1:]]
    ns = build_parser().parse_args(argv)
    assert ns.command == "rollback" and ns.to_version == 0
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert not any("rollback" in r or r.startswith("jobs") for r in kust["resources"])


# -- the manifests use the current flags: no deprecated flat spelling -------------------------------

def test_manifests_and_compose_files_use_no_deprecated_flat_flag() -> None:
    """A flat flag (``--device``) still works for one release but warns in every pod's log and
    goes in the next: the shipped manifests, compose files and Dockerfiles use the section flags."""
    from config.sections import OLD_FLAGS

    token = re.compile(r"(?<![\w.-])(--[a-z][\w-]*)(?![\w-])")
    compose = Path(__file__).resolve().parents[2] / "compose"
    files = [p for p in compose.rglob("*") if p.is_file() and (p.suffix in (".yml", ".yaml", ".sh")
                                                                 or p.name.startswith("Dockerfile"))]
    assert len(files) >= 8, files
    found = {(p.relative_to(compose).as_posix(), f) for p in files for f in token.findall(p.read_text())
             if f in OLD_FLAGS}
    assert not found, sorted(found)
