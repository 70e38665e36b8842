"""compose/k8s against the schemas and the code: every core manifest validates against the
Kubernetes API schema (``kubernetes-validate``'s bundled schemas, strict); the KEDA ScaledObjects
against a small ScaledObject schema kept here (``schemas/keda-scaledobject.schema.json``, written
from KEDA's CRD: KEDA ships no pip package); and every metric, label, topic and consumer group the
autoscalers name is one the code exports or uses (read from the metrics registry and
``streams.topics``, not restated)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from runtime.metrics import Metrics
from streams.topics import SAMPLES_RAW, STREAMS_GROUP

from .test_manifests import K8S, exported_series_names, load_yaml_docs

K8S_VERSION = "1.30.0"
KEDA_SCHEMA = json.loads((Path(__file__).parent / "schemas" / "keda-scaledobject.schema.json").read_text())
SERIES = re.compile(r"\b(rlstream_[a-z_]+)(?:\{([^}]*)\})?")


def docs() -> list[dict[str, Any]]:
    return [d for p in sorted(K8S.glob("*.yaml")) for d in load_yaml_docs(p) if d["kind"] != "Kustomization"]


def scaled_objects() -> dict[str, dict[str, Any]]:
    return {d["spec"]["scaleTargetRef"]["name"]: d for d in docs() if d["kind"] == "ScaledObject"}


def exported_labels() -> dict[str, set[str]]:
    """Label names of each series, from samples the registry renders once the roles' setters ran."""
    m = Metrics(gpu=False)
    m.set_consumer_lag(STREAMS_GROUP, SAMPLES_RAW, 1)
    m.circuit_breaker_hook()(0, 1)
    out: dict[str, set[str]] = {}
    for line in m.render().decode().splitlines():
        hit = re.match(r"(rlstream_[a-z_]+)\{([^}]*)\}", line)
        if hit:
            out.setdefault(hit[1], set()).update(re.findall(r'(\w+)="', hit[2]))
    return out


def unknown_series(query: str) -> list[str]:
    """Series names or label names in a PromQL ``query`` that the code does not export."""
    names, labels = exported_series_names(), exported_labels()
    bad = []
    for name, selector in SERIES.findall(query):
        if name not in names:
            bad.append(name)
            continue
        for label in re.findall(r"(\w+)\s*=~?", selector or ""):
            if label not in labels.get(name, set()):
                bad.append(f"{name}{{{label}}}")
    return bad


def test_core_manifests_validate_against_the_kubernetes_schema() -> None:
    kinds = set()
    for d in docs():
        if d["apiVersion"].startswith("keda.sh/"):
            continue
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)  # raises ValidationError
        kinds.add(d["kind"])
    assert kinds >= {"Namespace", "ConfigMap", "Service", "Deployment"}
    actor = next(d for d in docs() if d["kind"] == "Deployment" and d["metadata"]["name"] == "rlstream-actor")
    actor["spec"]["replica"] = 4  # a typo the strict schema refuses
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(actor, K8S_VERSION, strict=True)


def test_scaled_objects_validate_and_target_the_workloads() -> None:
    deployments = {d["metadata"]["name"] for d in docs() if d["kind"] == "Deployment"}
    objs = scaled_objects()
    assert set(objs) == {"rlstream-actor", "rlstream-streams"}
    for name, obj in objs.items():
        jsonschema.validate(obj, KEDA_SCHEMA)
        assert name in deployments, f"{name}: the ScaledObject's target is not a Deployment here"
        assert 1 <= obj["spec"]["minReplicaCount"] <= obj["spec"]["maxReplicaCount"]


def test_keda_schema_rejects_a_broken_object() -> None:
    obj = json.loads(json.dumps(scaled_objects()["rlstream-streams"]))
    obj["spec"]["triggers"][0]["metadata"]["lagThreshold"] = 64  # KEDA wants strings
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(obj, KEDA_SCHEMA)
    del obj["spec"]["triggers"][0]["metadata"]["lagThreshold"]
    obj["spec"]["triggers"][0]["metadata"]["consumerGroup"] = STREAMS_GROUP
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(obj, KEDA_SCHEMA)


def test_streams_scale_on_their_groups_lag() -> None:
    (kafka,) = [t for t in scaled_objects()["rlstream-streams"]["spec"]["triggers"] if t["type"] == "kafka"]
    assert kafka["metadata"]["consumerGroup"] == STREAMS_GROUP
    assert kafka["metadata"]["topic"] == SAMPLES_RAW
    assert kafka["metadata"]["allowIdleConsumers"] == "false"  # no more workers than partitions


def test_actors_scale_on_exported_metrics() -> None:
    queries = [t["metadata"]["query"] for obj in scaled_objects().values() for t in obj["spec"]["triggers"]
               if t["type"] == "prometheus"]
    assert queries and all(SERIES.search(q) for q in queries)
    for q in queries:
        assert unknown_series(q) == [], q
        assert f'group="{STREAMS_GROUP}"' in q and f'topic="{SAMPLES_RAW}"' in q


def test_the_metric_check_can_fail() -> None:
    assert unknown_series('sum(rlstream_consumer_lagg{group="x"})') == ["rlstream_consumer_lagg"]
    assert unknown_series('sum(rlstream_consumer_lag{partition="0"})') == ["rlstream_consumer_lag{partition}"]
