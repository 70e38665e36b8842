"""``rlstream validate RUN``: the deployment guide's go-live table of a run, from its summary
files; on a real (tiny) co-located run and on a hand-made decoupled run of known figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from config import BusConfig, TrainConfig
from rlstream.cli import main
from rlstream.colocated import run_colocated
from runtime import golive


def write(run: Path, name: str, data) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / name).write_text(json.dumps(data))


def rows(report) -> dict[str, tuple]:
    return {r["metric"]: (r["value"], r["status"]) for r in report["rows"]}


def decoupled_run(run: Path, fresh=(700, 150), gpu=None) -> Path:
    write(run, "config.json", {"mode": "decoupled"})
    write(run, "summary.json", {"mode": "decoupled", "ended": "learner_done"})
    write(run, "actor-0.summary.json", {"policy_latency_ms": {"count": 50, "p50": 3.0, "p99": 42.5}})
    write(run, "actor-1.summary.json", {"policy_latency_ms": {"count": 40, "p50": 9.0, "p99": 120.0},
                                         "startup_adoption_ms": 2500.0})
    write(run, "learner.summary.json", {"samples_trained": 120_000, "wall_s": 8.0,
                                         "gpu": gpu or {"status": "ok", "devices": 1, "samples": 8,
                                                        "utilization_pct_mean": 90.0}})
    write(run, "streams.summary.json", {"fresh_samples": fresh[0], "checked_samples": 1000, "freshness": 0.7})
    write(run, "streams-1.summary.json", {"fresh_samples": fresh[1], "checked_samples": 200, "freshness": 0.75})
    return run


def test_decoupled_figures_from_the_role_summaries(tmp_path):
    report = golive.check(decoupled_run(tmp_path / "d"))
    assert report["mode"] == "decoupled"
    assert rows(report) == {
        "policy_latency_p99_ms": (120.0, "fail"),  # the worst actor's p99, over 100 ms
        "gpu_utilization_pct": (90.0, "pass"),  # in 85-95
        "throughput_sps": (15000.0, "pass"),  # 120,000 samples in 8 s, at least 12,000
        "freshness_pct": (70.833, "pass"),  # 850 of 1,200 checked samples, above 70
    }
    sources = {r["metric"]: r["source"] for r in report["rows"]}
    assert sources["policy_latency_p99_ms"].startswith("actor-1.summary.json")
    notes = {r["metric"]: r["note"] for r in report["rows"]}
    assert notes["policy_latency_p99_ms"] == ("worst of 2 actor(s), 40 adoptions; "
                                              "start-up adoption 2500 ms apart, not counted")
    assert report["plot"] is None and "no timeline.json" in report["plot_note"]


def test_thresholds_are_the_guides_at_their_edges(tmp_path):
    edge = golive.check(decoupled_run(tmp_path / "e", fresh=(700, 140),  # exactly 70 %: not above
                                      gpu={"status": "ok", "utilization_pct_mean": 95.0, "samples": 1}))
    assert rows(edge)["freshness_pct"] == (70.0, "fail") and rows(edge)["gpu_utilization_pct"] == (95.0, "pass")
    assert golive.judge("max", (10.0,), 9.99) and not golive.judge("max", (10.0,), 10.0)
    assert golive.judge("min", (5000.0,), 5000.0) and not golive.judge("min", (5000.0,), 4999.0)
    assert not golive.judge("range", (60.0, 80.0), 59.9) and not golive.judge("range", (60.0, 80.0), 80.1)
    assert golive.THRESHOLDS["policy_latency_p99_ms"] == {"colocated": ("max", (10.0,)),
                                                           "decoupled": ("max", (100.0,))}
    assert golive.THRESHOLDS["throughput_sps"]["colocated"][1] == (5000.0,)
    assert golive.THRESHOLDS["freshness_pct"]["colocated"] == ("above", (95.0,))
    assert golive.THRESHOLDS["gpu_utilization_pct"]["colocated"] == ("range", (60.0, 80.0))


def test_no_gpu_is_said_and_a_missing_learner_summary_is_absent_not_guessed(tmp_path, capsys):
    run = decoupled_run(tmp_path / "n", gpu={"status": "no GPU", "reason": "NVML: no device"})
    assert rows(golive.check(run))["gpu_utilization_pct"] == ("no GPU", "absent")
    (run / "learner.summary.json").unlink()
    write(run, "learner.state.json", {"steps": 4096})
    r = golive.check(run)
    assert rows(r)["throughput_sps"] == (None, "absent") and rows(r)["gpu_utilization_pct"] == (None, "absent")
    assert "the learner wrote no summary (its last state: 4096 samples)" in json.dumps(r)
    assert main(["validate", str(run)]) == 1  # a threshold failed: a pipeline stops here
    got = capsys.readouterr()
    assert "FAIL" in got.out and "ABSENT" in got.out and "1 pass, 1 fail, 2 absent" in got.out
    assert "1 threshold(s) failed" in got.err
    assert main(["validate", str(run), "--report-only"]) == 0  # the same report, exit 0
    assert "1 pass, 1 fail, 2 absent" in capsys.readouterr().out


def test_cli_json_and_unusable_run_directories(tmp_path, capsys):
    run = decoupled_run(tmp_path / "j")
    assert main(["validate", str(run), "--json"]) == 1  # its latency fails: still the whole report
    report = json.loads(capsys.readouterr().out)
    assert rows(report)["throughput_sps"] == (15000.0, "pass")
    assert golive.failed(report) == ["policy_latency_p99_ms"]
    assert main(["validate", str(tmp_path / "nope")]) == 2
    assert "no such run directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["validate", str(tmp_path / "empty")]) == 2
    assert "not a run directory" in capsys.readouterr().err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "summary.json").write_text("{not json")
    assert main(["validate", str(tmp_path / "bad")]) == 2
    assert "not readable JSON" in capsys.readouterr().err


def test_a_real_colocated_run_fills_every_row_and_plots_its_timeline(tmp_path, capsys):
    torch.set_num_threads(1)
    cfg = TrainConfig(env_id="CartPole-v1", total_steps=1024, train_batch_size=256, seed=1, run_dir=tmp_path,
                      log_every_s=0.0, plot=False, torch_threads=1, bus=BusConfig(log_dir=str(tmp_path / "log")))
    summary = run_colocated(cfg)
    assert summary["policy_latency_ms"]["count"] >= 3  # versions 1-3 adopted by the actor
    # version 0, adopted at the actor's first step, ended its start-up: apart, not policy latency
    actor = json.loads((tmp_path / "actor-0.summary.json").read_text())
    assert actor["policy_versions_adopted"] == summary["policy_latency_ms"]["count"] + 1
    assert summary["startup_adoption_ms"] == actor["startup_adoption_ms"] > 0
    report = golive.check(tmp_path)
    got = rows(report)
    note = {r["metric"]: r["note"] for r in report["rows"]}["policy_latency_p99_ms"]
    assert f"start-up adoption {summary['startup_adoption_ms']:g} ms apart, not counted" in note
    assert report["mode"] == "colocated"
    p99, status = got["policy_latency_p99_ms"]
    assert p99 == summary["policy_latency_ms"]["p99"] and status == ("pass" if p99 < 10 else "fail")
    assert got["throughput_sps"] == (summary["sps"], "pass" if summary["sps"] >= 5000 else "fail")
    assert got["freshness_pct"] == (100.0, "pass")  # co-located PPO: every sample in the window
    if not torch.cuda.is_available():
        assert got["gpu_utilization_pct"] == ("no GPU", "absent")
    timeline = json.loads((tmp_path / "timeline.json").read_text())
    assert any(line["policy_latency_p99_ms"] is not None for line in timeline)
    assert all(line["freshness"] in (None, 1.0) for line in timeline)
    assert report["plot"] == str(tmp_path / golive.PLOT_FILE) and Path(report["plot"]).stat().st_size > 0
    assert main(["validate", str(tmp_path), "--no-plot"]) == (1 if golive.failed(report) else 0)
    assert "go-live check" in capsys.readouterr().out
    assert main(["validate", str(tmp_path), "--no-plot", "--report-only"]) == 0


def test_validate_gates_a_pipeline(tmp_path, capsys):
    """Exit 0 when every measured figure passes (absent ones do not fail), 1 when one fails, 0
    with --report-only, 2 for a directory that is not a run."""
    run = decoupled_run(tmp_path / "ok")
    write(run, "actor-1.summary.json", {"policy_latency_ms": {"count": 40, "p50": 9.0, "p99": 60.0}})
    assert golive.failed(golive.check(run, plot=False)) == []
    assert main(["validate", str(run), "--no-plot"]) == 0
    assert "4 pass, 0 fail, 0 absent" in capsys.readouterr().out
    write(run, "learner.summary.json", {"samples_trained": 120_000, "wall_s": 8.0,
                                        "gpu": {"status": "no GPU", "reason": "NVML: no device"}})
    assert main(["validate", str(run), "--no-plot"]) == 0  # the GPU row absent: not a failure
    assert "3 pass, 0 fail, 1 absent" in capsys.readouterr().out
    write(run, "actor-1.summary.json", {"policy_latency_ms": {"count": 40, "p50": 9.0, "p99": 120.0}})
    assert main(["validate", str(run), "--no-plot"]) == 1
    assert "validate: 1 threshold(s) failed (policy_latency_p99_ms)" in capsys.readouterr().err
    assert main(["validate", str(run), "--no-plot", "--report-only"]) == 0
    assert main(["validate", str(tmp_path / "nope"), "--report-only"]) == 2
