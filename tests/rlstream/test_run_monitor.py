"""A decoupled run's progress lines carry each window's go-live figures, taken from the children's
state files, and ``timeline.json`` keeps them for ``rlstream validate`` (no broker: the group lags
are missing figures here)."""

from __future__ import annotations

import json

from config import TrainConfig
from rlstream.monitor import RunMonitor
from runtime.rundir import RunDir
from runtime import golive
from runtime.progress import TIMELINE_FILE, write_state


class NoBroker:
    def group_lag(self, group: str, topic: str) -> int:
        raise ConnectionError("no broker in this test")


def actor_state(cfg, name: str, latencies_ms: list[float], pid: int = 1) -> None:
    write_state(RunDir(cfg.run_dir).state_file(name), {"pid": pid, "steps": 0, "policy_latency_count": len(latencies_ms),
                                        "policy_latency_recent_ms": latencies_ms})


def streams_state(cfg, name: str, fresh: int, checked: int, pid: int = 1) -> None:
    write_state(cfg.run_dir / f"{name}.state.json", {"pid": pid, "fresh_samples": fresh, "checked_samples": checked})


def test_each_line_has_its_windows_latency_p99_and_freshness_and_the_timeline_is_plotted(tmp_path):
    cfg = TrainConfig(run_dir=tmp_path, total_steps=1000, num_actors=2)
    mon = RunMonitor(cfg, NoBroker(), ["actor-0", "actor-1"], streams=["streams", "streams-1"])

    first = mon.log_line()  # nothing adopted nor checked yet: no figure, not a made-up one
    assert first["policy_latency_p99_ms"] is None and first["freshness"] is None

    actor_state(cfg, "actor-0", [5.0, 7.0])
    actor_state(cfg, "actor-1", [30.0])
    streams_state(cfg, "streams", 90, 100)
    streams_state(cfg, "streams-1", 10, 100)
    second = mon.log_line()
    assert second["policy_latency_p99_ms"] == 30.0  # over both actors
    assert second["freshness"] == 0.5  # (90 + 10) / 200

    # the next window holds only what came after: actor-0's newest latency, 40 more samples
    actor_state(cfg, "actor-0", [5.0, 7.0, 2.0])
    streams_state(cfg, "streams", 130, 140)
    third = mon.log_line()
    assert third["policy_latency_p99_ms"] == 2.0 and third["freshness"] == 1.0

    # a restarted child (another process) counts from 0 again: its counts are the window's
    actor_state(cfg, "actor-1", [4.0], pid=2)
    streams_state(cfg, "streams-1", 3, 4, pid=2)
    fourth = mon.log_line()
    assert fourth["policy_latency_p99_ms"] == 4.0 and fourth["freshness"] == 0.75

    timeline = json.loads((tmp_path / TIMELINE_FILE).read_text())
    assert [ln["policy_latency_p99_ms"] for ln in timeline] == [None, 30.0, 2.0, 4.0]
    assert [ln["freshness"] for ln in timeline] == [None, 0.5, 1.0, 0.75]
    assert all(b["t_s"] >= a["t_s"] for a, b in zip(timeline, timeline[1:]))

    report = golive.plot_timeline(tmp_path, "decoupled")
    assert report["plot"] == str(tmp_path / golive.PLOT_FILE) and (tmp_path / golive.PLOT_FILE).stat().st_size > 0
    assert report["plot_note"].startswith("6 points")
