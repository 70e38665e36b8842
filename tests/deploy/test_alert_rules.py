"""compose/prometheus/alerts.yml: every guide threshold has a rule, every rule names metrics the
code exports, and promtool (Debian's prometheus package) checks the rules and runs their unit
tests (compose/prometheus/alerts.test.yml). The compose run (test_compose_up.py) sees one fire."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.ops.test_manifests import exported_series_names

from .conftest import missing

PROMETHEUS = Path(__file__).resolve().parents[2] / "compose" / "prometheus"
RULES = PROMETHEUS / "alerts.yml"
UNIT_TESTS = PROMETHEUS / "alerts.test.yml"
#: the deployment guide's thresholds, one alert each (two modes where the guide has two bounds)
GUIDE_ALERTS = {
    "RlstreamPolicyLatencyHigh": {"decoupled": "> 0.1", "colocated": "> 0.01"},
    "RlstreamSampleFreshnessLow": {"decoupled": "< 0.70", "colocated": "< 0.95"},
    "RlstreamGpuUtilizationOutOfBand": {"decoupled": "0.85", "colocated": "0.60"},
    "RlstreamConsumerLagGrowing": {},
    "RlstreamRoleDown": {},
    "RlstreamCircuitBreakerOpen": {},
    "RlstreamLearnerFenced": {},  # not the guide's: a fenced learner waits (--learner.on-fenced wait)
}


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_every_guide_threshold_has_a_rule_in_each_mode() -> None:
    by_name: dict[str, list[dict]] = {}
    for r in rules():
        by_name.setdefault(r["alert"], []).append(r)
    assert set(by_name) == set(GUIDE_ALERTS)
    for name, modes in GUIDE_ALERTS.items():
        for mode, bound in modes.items():
            (rule,) = [r for r in by_name[name] if r["labels"].get("mode") == mode]
            assert bound in rule["expr"], (name, mode, rule["expr"])
            selector = 'job="colocated"' if mode == "colocated" else 'job!="colocated"'
            assert selector in rule["expr"], (name, mode)
    assert all(r["labels"]["severity"] in {"info", "warning", "critical"} for r in rules())


def test_every_rule_names_metrics_the_code_exports() -> None:
    exported = exported_series_names() | {"up"}
    for r in rules():
        names = set(re.findall(r"\b(rlstream_[a-z0-9_]+|up)\b(?=\s*[{\[)<>=!]|\s*$)", r["expr"]))
        assert names, r["alert"]
        assert names <= exported, f"{r['alert']}: {sorted(names - exported)} not exported by runtime/metrics.py"


def test_every_alert_has_a_unit_test() -> None:
    tested = {t["alertname"] for case in yaml.safe_load(UNIT_TESTS.read_text())["tests"]
              for t in case.get("alert_rule_test", [])}
    assert tested == set(GUIDE_ALERTS)


def promtool() -> str:
    tool = shutil.which("promtool")
    if tool is None:
        missing("promtool is not installed (apt-get install prometheus)")
    return tool


@pytest.mark.deploy
def test_promtool_checks_the_rules_and_runs_their_unit_tests() -> None:
    tool = promtool()
    check = subprocess.run([tool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(rules())} rules found" in check.stdout
    run = subprocess.run([tool, "test", "rules", UNIT_TESTS.name], cwd=PROMETHEUS, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


@pytest.mark.deploy
def test_promtool_fails_a_rule_that_does_not_fire(tmp_path) -> None:
    """The unit tests can fail: a threshold moved past the test's series is caught."""
    tool = promtool()
    (tmp_path / "alerts.yml").write_text(RULES.read_text().replace("rlstream_circuit_breaker_state == 1",
                                                                   "rlstream_circuit_breaker_state == 3"))
    (tmp_path / "alerts.test.yml").write_text(UNIT_TESTS.read_text())
    run = subprocess.run([tool, "test", "rules", "alerts.test.yml"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode != 0 and "RlstreamCircuitBreakerOpen" in run.stdout + run.stderr


@pytest.mark.deploy
def test_promtool_checks_the_compose_configs(tmp_path) -> None:
    """Both Prometheus configs load, with the rules beside them as they are mounted."""
    tool = promtool()
    shutil.copy(RULES, tmp_path / "alerts.yml")
    for cfg in (PROMETHEUS / "prometheus.yml", PROMETHEUS.parent / "podman" / "prometheus.host.yml"):
        shutil.copy(cfg, tmp_path / "prometheus.yml")
        res = subprocess.run([tool, "check", "config", "prometheus.yml"], cwd=tmp_path, capture_output=True,
                             text=True, timeout=60)
        assert res.returncode == 0, cfg.name + "\n" + res.stdout + res.stderr
        assert "SUCCESS: 10 rules found" in res.stdout, res.stdout
