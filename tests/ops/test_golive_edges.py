"""``rlstream validate``'s judgement at the edges the main tests leave open: the lower bound of
a utilisation range is inside it, a co-located run that checked no sample has no freshness
figure (absent, not 100 %), and a run whose summary.json names the decoupled mode is judged as
one even when no role wrote its own files."""

from __future__ import annotations

import json
from pathlib import Path

from runtime import golive


def write(run: Path, name: str, data) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / name).write_text(json.dumps(data))


def rows(report) -> dict[str, tuple]:
    return {r["metric"]: (r["value"], r["status"]) for r in report["rows"]}


def colocated(run: Path, *, gpu_pct: float, streams: dict) -> Path:
    write(run, "summary.json", {"mode": "colocated", "policy_latency_ms": {"count": 5, "p99": 4.0}, "sps": 6000.0,
                                "gpu": {"status": "ok", "devices": 1, "samples": 3, "utilization_pct_mean": gpu_pct},
                                "streams": streams})
    return run


def test_the_lower_end_of_a_utilisation_range_passes_in_both_modes(tmp_path):
    assert golive.judge("range", (60.0, 80.0), 60.0) and golive.judge("range", (85.0, 95.0), 85.0)
    report = golive.check(colocated(tmp_path / "c", gpu_pct=60.0, streams={"freshness": 1.0, "checked_samples": 9}),
                          plot=False)
    assert rows(report)["gpu_utilization_pct"] == (60.0, "pass")
    low = golive.check(colocated(tmp_path / "d", gpu_pct=59.99, streams={"freshness": 1.0, "checked_samples": 9}),
                       plot=False)
    assert rows(low)["gpu_utilization_pct"] == (59.99, "fail")


def test_a_colocated_run_that_checked_no_sample_has_no_freshness_figure(tmp_path):
    report = golive.check(colocated(tmp_path / "c", gpu_pct=70.0, streams={"freshness": 1.0, "checked_samples": 0}),
                          plot=False)
    assert rows(report)["freshness_pct"] == (None, "absent")
    (row,) = [r for r in report["rows"] if r["metric"] == "freshness_pct"]
    assert row["note"] == "no sample was checked for staleness"
    checked = golive.check(colocated(tmp_path / "d", gpu_pct=70.0, streams={"freshness": 0.96, "checked_samples": 50}),
                           plot=False)
    assert rows(checked)["freshness_pct"] == (96.0, "pass")


def test_a_summary_naming_the_decoupled_mode_is_judged_as_decoupled_without_role_files(tmp_path):
    """The supervisor wrote summary.json but no role got as far as its files: a report of absent
    figures against the decoupled thresholds, not an unusable run."""
    run = tmp_path / "d"
    write(run, "summary.json", {"mode": "decoupled", "ended": "child_exited"})
    report = golive.check(run, plot=False)
    assert report["mode"] == "decoupled"
    assert {status for _, status in rows(report).values()} == {"absent"}
    thresholds = {r["metric"]: r["threshold"] for r in report["rows"]}
    assert thresholds["policy_latency_p99_ms"] == "< 100 ms" and thresholds["throughput_sps"] == ">= 12000 samples/s"
