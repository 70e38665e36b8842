"""Co-located mode: actors, stream processor and learner in one process over the memory bus.

The roles are the same objects decoupled mode runs in separate processes; here one driver
steps them in turn (Sample Factory's serial mode): actor fragments -> prepare -> learner
update -> new PolicyVersion -> actors adopt it before their next fragment. On-policy data
therefore stays fresh (policy lag 0 for the PPO family) and every event is still on a topic.

``--overlap`` (``TrainConfig.overlap``) drives the same roles with ``runtime.roles.drive_overlapped``:
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
from collections import deque
from pathlib import Path
from typing import Any

from rlstream import wiring
from config import TrainConfig
from runtime.gpu import GpuSampler
from runtime.logging import bind_policy_version
from runtime.metrics import Metrics
from runtime.tensorboard import TensorBoardRun
from runtime.progress import Progress, quantiles_ms
from runtime.rundir import RunDir
from runtime.roles import OverlapTimes, Slot, drive, drive_overlapped, write_summary
from streams.topics import DEADLETTER, LEARNER_STEPS, POLICY_VERSIONS, SAMPLES_PREPARED, SAMPLES_RAW


def run_colocated(cfg: TrainConfig, log: Any = None, stop: threading.Event | None = None,
                  metrics: Metrics | None = None, bus=None) -> dict[str, Any]:
    stop = stop or threading.Event()
    if cfg.actor_lag_versions:
        raise ValueError("--actor-lag-versions applies to decoupled mode only "
                         "(co-located actors always act with the learner's newest version)")
    import torch

    # one thread unless asked: a small MLP's update gains nothing from a second one on an idle
    # machine and runs tens of times slower beside another busy process (config.train)
    torch.set_num_threads(cfg.torch_threads or 1)
    metrics = metrics or Metrics(role="colocated")
    bus = bus or wiring.build_bus(cfg.bus)
    events = wiring.build_events(bus, metrics)
    info = wiring.env_info(cfg)
    algo = wiring.build_algo(cfg, info.obs_dim, info.act_dim, info.nvec)
    latencies: deque[float] = deque(maxlen=100_000)  # policy latency (s): publish -> an actor acts with it
    recent: list[float] = []  # the same, since the last progress line
    gpu = GpuSampler()
    worker_ref: list[Any] = []
    seen = {"fresh": 0, "checked": 0}  # freshness counts at the last progress line

    def on_latency(s: float) -> None:
        latencies.append(s)
        recent.append(s)

    def live() -> dict[str, Any]:
        """Each progress line's go-live figures over the window since the line before (the run's
        ``timeline.json``, which ``rlstream validate`` plots)."""
        gpu.sample()
        p99 = quantiles_ms(recent).get("p99")
        recent.clear()
        fresh = checked = 0
        if worker_ref:
            st = worker_ref[0].prepare.staleness.stats
            fresh, checked = st.fresh_samples - seen["fresh"], st.checked_samples - seen["checked"]
            seen.update(fresh=st.fresh_samples, checked=st.checked_samples)
        return {"policy_latency_p99_ms": p99, "freshness": round(fresh / checked, 4) if checked else None,
                "gpu_utilization_pct": gpu.samples[-1] if gpu.samples else None}

    progress = Progress(total_steps=cfg.total_steps, log_every_s=cfg.log_every_s, log=log, extra=live,
                        record_timeline=True)

    learner_ref: dict[str, Any] = {}
    tb_actor = TensorBoardRun(cfg.tensorboard, cfg.effective_run_id(), "actor")
    tb_learner = TensorBoardRun(cfg.tensorboard, cfg.effective_run_id(), "learner")

    lags = {"batches": 0, "total": 0, "max": 0}  # policy lag per fragment, over the run
    collected: list[Any] = []  # overlap: the round's fragments, counted once its update is joined

    def count_batch(batch) -> None:
        lr = learner_ref.get("learner")
        lag = (lr.version - batch.policy_version) if lr is not None else 0
        lags["batches"] += 1
        lags["total"] += lag
        lags["max"] = max(lags["max"], lag)
        progress.on_batch(batch.size, batch.episode_returns, lag)
        tb_actor.episodes(progress.steps, batch.episode_returns, batch.episode_lengths)
        tb_actor.sps(progress.steps)

    def on_batch(batch, seconds: float) -> None:
        if cfg.overlap:  # (the actors' thread) the learner's version is known once the round is joined
            collected.append(batch)
        else:
            count_batch(batch)

    def on_round() -> None:
        while collected:
            count_batch(collected.pop(0))
        progress.maybe_log()

    def on_update(learner, m, seconds) -> None:
        progress.updates = learner.stats.updates
        progress.version = learner.version
        bind_policy_version(learner.version)
        tb_learner.losses(progress.steps, m)
        tb_learner.sps(progress.steps)

    # every role built is closed, also when a later one fails to build (an --overlap actor's
    # rollout child would otherwise live until the interpreter exits)
    actors: list[Any] = []
    worker = None
    ran = False
    learner = wiring.build_learner(cfg, events, metrics, algo, on_update=on_update, gpu_util=gpu.utilization)
    try:
        learner_ref["learner"] = learner
        learner.start(resume=cfg.resume)
        if cfg.resume and learner.stats.updates:
            progress.steps = learner.stats.updates * cfg.train_batch_size
            progress.updates = learner.stats.updates
        progress.version = learner.version
        worker = wiring.build_prepare_worker(cfg, events, metrics)
        worker_ref.append(worker)
        for i in range(cfg.num_actors):
            actors.append(wiring.build_actor(cfg, events, metrics, i, on_batch=on_batch, log=log,
                                             on_latency=on_latency))
        if log is not None:
            log.info("train_start", **wiring.describe(cfg), policy_version=learner.version)
        roles = {**{f"actor-{i}": a for i, a in enumerate(actors)}, "streams": worker, "learner": learner}
        times = OverlapTimes() if cfg.overlap else None
        done = lambda: progress.steps >= cfg.total_steps  # noqa: E731
        ran = True
        if times is not None:
            drive_overlapped([Slot(Pinned(a)) for a in actors], [Slot(learner)], [Slot(worker, drain=True)],
                             before=lambda: [a.adopt() for a in actors], done=done, stop=stop,
                             on_round=on_round, times=times)
        else:
            drive([*(Slot(a) for a in actors), Slot(worker, drain=True), Slot(learner)],
                  done=done, stop=stop, on_round=on_round)
        progress.maybe_log(force=True)
    finally:
        for a in actors:
            a.close()
        if ran and learner.snapshots is not None and learner.stats.updates:
            learner.snapshot()
        learner.close()
        if worker is not None:
            worker.close()
        tb_actor.close()
        tb_learner.close()
    for name, role in roles.items():
        write_summary(cfg.run_dir, name, role.summary())
    summary = progress.summary()
    stats = worker.prepare.stats.as_dict()
    summary.update({
        "mode": "colocated", "algo": cfg.algo, "env": cfg.env_id, "wrappers": list(cfg.wrappers),
        "events": {t: sum(bus.end_offsets(t).values())
                   for t in (POLICY_VERSIONS, SAMPLES_RAW, SAMPLES_PREPARED, LEARNER_STEPS, DEADLETTER)},
        "streams": stats,
        "duplicates_skipped": learner.stats.duplicates_skipped,
        "env_rejected_fragments": sum(a.rejected for a in actors),
        "policy_latency_ms": quantiles_ms(latencies),  # start-up adoptions apart (actor.policy_client)
        "startup_adoption_ms": _worst_startup(actors),
        "policy_lag": {"mean": round(lags["total"] / lags["batches"], 4) if lags["batches"] else 0.0,
                       "max": lags["max"], "fragments": lags["batches"]},
        "overlap": times.as_dict() if times is not None else None,
        "gpu": gpu.summary(),
    })
    summary.update(progress.write(cfg.run_dir, cfg.plot, f"{cfg.algo} on {cfg.env_id} (co-located)"))
    if cfg.tensorboard:
        summary["tensorboard"] = str(Path(cfg.tensorboard) / cfg.effective_run_id())
    RunDir(cfg.run_dir).write_summary(summary)
    return summary


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
