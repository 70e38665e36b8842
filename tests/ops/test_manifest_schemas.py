"""Every manifest against its published schema, strictly (an unknown field fails):

* ``compose/docker-compose*.yml``: the Compose Specification's JSON schema (vendored,
  ``schemas/compose-spec.json``), each file and the GPU overlay merged over the base;
* ``compose/k8s/*.yaml`` but KEDA's: the Kubernetes API schemas ``kubernetes-validate`` bundles,
  ``strict=True``, at the oldest and newest 1.3x it has that we support;
* KEDA ScaledObjects: the ScaledObject CRD's ``openAPIV3Schema`` (vendored from KEDA), closed as
  ``kubectl --validate=strict`` closes it.

Sources and versions of the vendored files: ``schemas/README.md``. Each validator is shown to
refuse a broken document, so none passes vacuously."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from .test_manifests import COMPOSE, K8S, load_yaml_docs

SCHEMAS = Path(__file__).parent / "schemas"
K8S_VERSIONS = ("1.30.0", "1.37.0")


# -- Compose -------------------------------------------------------------------------------------

def compose_validator() -> jsonschema.protocols.Validator:
    schema = json.loads((SCHEMAS / "compose-spec.json").read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def compose_files() -> list[Path]:
    return sorted(COMPOSE.glob("docker-compose*.yml"))


def merge(base: Any, over: Any) -> Any:
    """``docker compose -f base -f over`` for the keys used here: mappings merge, the rest replaces."""
    if isinstance(base, dict) and isinstance(over, dict):
        return {k: merge(base[k], v) if k in base else v for k, v in over.items()} | \
            {k: v for k, v in base.items() if k not in over}
    return over


def compose_errors(doc: dict[str, Any]) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in compose_validator().iter_errors(doc)]


def test_compose_files_validate_against_the_compose_spec() -> None:
    files = compose_files()
    assert {p.name for p in files} >= {"docker-compose.yml", "docker-compose.gpu.yml"}
    for path in files:
        assert compose_errors(yaml.safe_load(path.read_text())) == [], path.name


def test_the_gpu_overlay_merged_over_the_base_validates() -> None:
    base = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    gpu = yaml.safe_load((COMPOSE / "docker-compose.gpu.yml").read_text())
    merged = merge(base, gpu)
    assert compose_errors(merged) == []
    assert merged["services"]["learner"]["volumes"] == base["services"]["learner"]["volumes"]


def test_the_compose_schema_refuses_a_broken_file() -> None:
    base = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    bad = copy.deepcopy(base)
    bad["services"]["learner"]["comand"] = ["rlstream"]  # a typo: unknown service field
    assert any("comand" in e for e in compose_errors(bad))
    bad = copy.deepcopy(base)
    bad["services"]["learner"]["stop_grace_period"] = {"seconds": 25}  # a duration is a string
    assert compose_errors(bad)
    bad = copy.deepcopy(base)
    bad["services"]["learner"]["deploy"] = {"resources": {"reservations": {"devices": [{"driver": "nvidia",
                                                                                       "gpus": 1}]}}}
    assert compose_errors(bad)


# -- Kubernetes ----------------------------------------------------------------------------------

def k8s_docs() -> list[dict[str, Any]]:
    return [d for p in sorted(K8S.glob("*.yaml")) for d in load_yaml_docs(p) if d["kind"] != "Kustomization"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kubernetes_manifests_validate_strictly(version: str) -> None:
    kinds = set()
    for d in k8s_docs():
        if d["apiVersion"].startswith("keda.sh/"):
            continue
        kubernetes_validate.validate(d, version, strict=True)  # raises ValidationError
        kinds.add(d["kind"])
    assert kinds >= {"Namespace", "ConfigMap", "Service", "Deployment", "PersistentVolumeClaim", "CronJob",
                     "ServiceAccount", "Role", "RoleBinding"}


def test_strict_kubernetes_validation_refuses_unknown_fields() -> None:
    learner = next(d for d in k8s_docs() if d["metadata"]["name"] == "rlstream-learner" and d["kind"] == "Deployment")
    bad = copy.deepcopy(learner)
    bad["spec"]["template"]["spec"]["toleration"] = []  # a typo of tolerations
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)
    cron = next(d for d in k8s_docs() if d["kind"] == "CronJob")
    bad = copy.deepcopy(cron)
    bad["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


# -- KEDA ----------------------------------------------------------------------------------------

def closed(schema: Any) -> Any:
    """The CRD schema with every object that lists ``properties`` closed to other fields, unless it
    keeps unknown fields on purpose (``x-kubernetes-preserve-unknown-fields``)."""
    if isinstance(schema, dict):
        out = {k: closed(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [closed(v) for v in schema]
    return schema


def scaled_object_validator() -> jsonschema.protocols.Validator:
    crd = yaml.safe_load((SCHEMAS / "keda.sh_scaledobjects.yaml").read_text())
    assert crd["spec"]["names"]["kind"] == "ScaledObject"
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    schema = closed(served["schema"]["openAPIV3Schema"])
    # apiVersion and kind are what the API server routes on
    schema["properties"]["apiVersion"] = {"const": f"{crd['spec']['group']}/v1alpha1"}
    schema["properties"]["kind"] = {"const": "ScaledObject"}
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata", "spec"})
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def scaled_objects() -> list[dict[str, Any]]:
    return [d for d in k8s_docs() if d["kind"] == "ScaledObject"]


def test_scaled_objects_validate_against_the_keda_crd() -> None:
    validator = scaled_object_validator()
    objs = scaled_objects()
    assert len(objs) == 2
    for obj in objs:
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]
        assert errors == [], obj["metadata"]["name"]


def test_the_keda_crd_refuses_a_broken_scaled_object() -> None:
    validator = scaled_object_validator()
    obj = scaled_objects()[0]
    for breakage in (lambda o: o["spec"].update(maxReplicas=4),  # not a field (maxReplicaCount)
                     lambda o: o["spec"]["triggers"][0]["metadata"].update(lagThreshold=64),  # strings only
                     lambda o: o["spec"]["scaleTargetRef"].pop("name"),  # required
                     lambda o: o["spec"].update(minReplicaCount="1")):  # int32
        bad = copy.deepcopy(obj)
        breakage(bad)
        assert not validator.is_valid(bad), bad["spec"]
