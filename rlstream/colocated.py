"""Co-located mode: actors, stream processor and learner in one process over the memory bus.

The roles are the same objects decoupled mode runs in separate processes; here one driver
steps them in turn (Sample Factory's serial mode): actor fragments -> prepare -> learner
update -> new PolicyVersion -> actors adopt it before their next fragment. On-policy data
therefore stays fresh (policy lag 0 for the PPO family) and every event is still on a topic.

``--actor.overlap`` (``TrainConfig.actor.overlap``) drives the same roles with ``runtime.roles.drive_overlapped``:
the actors adopt the newest version, then collect fragment k+1 with it (version v) while the
learner trains fragment k into v+1; the stream processor then prepares k+1, which the learner
trains in the next round at v+1. Each actor's envs run in a child process
(``actor.rollout_process``), so collection and the update use two cores (two threads of this
process would take turns on CPython's GIL); the actors' thread only waits on the child's pipe.
Every fragment after the first is one version stale (lag 1), and the run's lag figures say so:
the progress lines' and the summary's ``policy_lag`` (the learner's version when a fragment is
counted, after the round's update, minus the fragment's) and the stream processor's
``lag_versions``. The algorithm corrects for it (``config.algos``: PPO as decoupled PPO).
"""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

from rlstream import wiring
from config import TrainConfig
from rlstream.harness import RoleProcess
from runtime.metrics import Metrics
from runtime.roles import OverlapTimes, Slot
from runtime.rundir import RunDir
from streams.topics import DEADLETTER, LEARNER_STEPS, POLICY_VERSIONS, SAMPLES_PREPARED, SAMPLES_RAW


def run_colocated(cfg: TrainConfig, log: Any = None, stop: threading.Event | None = None,
                  metrics: Metrics | None = None, bus=None) -> dict[str, Any]:
    """Train ``cfg`` in this process (see the module docstring) and return the run's summary,
    also written to ``<run_dir>/summary.json`` beside each role's."""
    cfg = cfg if cfg.mode == "colocated" else replace(cfg, mode="colocated")  # (its checks: TrainConfig's)
    wiring.set_threads(cfg)
    metrics = metrics or Metrics(role="colocated")
    bus = bus or wiring.build_bus(cfg.bus)
    events = wiring.build_events(bus, metrics)
    times = OverlapTimes() if cfg.actor.overlap else None
    proc = RoleProcess(cfg, "colocated", total_steps=cfg.run.total_steps, log=log, timeline=True, gpu=True,
                       defer_batches=cfg.actor.overlap)
    progress = proc.progress
    with proc:
        learner = wiring.add_learner(proc, cfg, events, metrics)
        if cfg.run.resume and learner.stats.updates:
            progress.steps = learner.stats.updates * cfg.learner.train_batch_size
            progress.updates = learner.stats.updates
        progress.version = learner.version
        worker = wiring.add_prepare_worker(proc, cfg, events, metrics)
        progress.extra = _live(proc, worker)
        actors = [wiring.add_actor(proc, cfg, events, metrics, i, board="actor",
                                   lag=lambda batch: learner.version - batch.policy_version)
                  for i in range(cfg.actor.num_actors)]
        if log is not None:
            log.info("train_start", **wiring.describe(cfg), policy_version=learner.version)
        done = lambda: progress.steps >= cfg.run.total_steps  # noqa: E731
        if times is not None:
            proc.drive_overlapped([Slot(Pinned(a)) for a in actors], [Slot(learner)], [Slot(worker, drain=True)],
                                  before=lambda: [a.adopt() for a in actors], done=done, stop=stop, times=times)
        else:
            proc.drive([*(Slot(a) for a in actors), Slot(worker, drain=True), Slot(learner)], done=done, stop=stop)
    proc.write_summaries()
    summary = {**progress.summary(), **_figures(cfg, proc, bus, learner, worker, actors, times)}
    summary.update(progress.write(cfg.run.run_dir, cfg.run.plot, f"{cfg.run.algo} on {cfg.run.env_id} (co-located)"))
    if cfg.run.tensorboard:
        summary["tensorboard"] = str(Path(cfg.run.tensorboard) / cfg.effective_run_id())
    RunDir(cfg.run.run_dir).write_summary(summary)
    return summary


def _live(proc: RoleProcess, worker: Any):
    """Each progress line's go-live figures over the window since the line before (the run's
    ``timeline.json``, which ``rlstream validate`` plots)."""
    seen = {"fresh": 0, "checked": 0}  # freshness counts at the last progress line

    def live() -> dict[str, Any]:
        proc.gpu.sample()
        st = worker.prepare.staleness.stats
        fresh, checked = st.fresh_samples - seen["fresh"], st.checked_samples - seen["checked"]
        seen.update(fresh=st.fresh_samples, checked=st.checked_samples)
        return {"policy_latency_p99_ms": proc.latencies.window_p99_ms(),
                "freshness": round(fresh / checked, 4) if checked else None,
                "gpu_utilization_pct": proc.gpu.samples[-1] if proc.gpu.samples else None}
    return live


def _figures(cfg: TrainConfig, proc: RoleProcess, bus, learner, worker, actors: list[Any],
             times: OverlapTimes | None) -> dict[str, Any]:
    """The co-located summary's figures beside the progress's."""
    return {
        "mode": "colocated", **wiring.task(cfg),
        "events": {t: sum(bus.end_offsets(t).values())
                   for t in (POLICY_VERSIONS, SAMPLES_RAW, SAMPLES_PREPARED, LEARNER_STEPS, DEADLETTER)},
        "streams": worker.prepare.stats.as_dict(),
        "duplicates_skipped": learner.stats.duplicates_skipped,
        "env_rejected_fragments": sum(a.rejected for a in actors),
        "policy_latency_ms": proc.latencies.quantiles_ms(),  # start-up adoptions apart (actor.policy_client)
        "startup_adoption_ms": _worst_startup(actors),
        "policy_lag": proc.lag.as_dict(),
        "overlap": times.as_dict() if times is not None else None,
        "gpu": proc.gpu.summary(),
    }


def _worst_startup(actors: list[Any]) -> float | None:
    """The slowest actor's first adoption (ms): start-up, not policy latency."""
    lats = [a.subscriber.startup_latency_s for a in actors if a.subscriber.startup_latency_s is not None]
    return round(max(lats) * 1e3, 3) if lats else None


class Pinned:
    """An actor as the overlap thread steps it: with the version it adopted before the round
    (``Actor.step(pinned=True)``), whatever the learner publishes meanwhile."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def step(self, timeout: float = 0.0) -> Any:
        return self.actor.step(timeout, pinned=True)

    def close(self) -> None:
        self.actor.close()

    def summary(self) -> dict[str, Any]:
        return self.actor.summary()
