"""Where co-located policy latency goes: from the learner publishing version v to the actor acting
with it, which work runs in between (one process, roles stepped in turn: ``runtime.roles.drive``).

Wraps the steps that can run between the two (the learner's snapshot, its per-update hook, the
progress line, the stream worker, the actor's weight load, the GradientStep event) with timers,
runs a short co-located training, and attributes each adoption's latency to them. Prints JSON:
per-version latency, per-phase totals, the latency quantiles, and the same with snapshots every
update vs never (the peer figure: the one phase that scales with the model). Garbage-collector
pauses are a phase too (``gc.callbacks``).

Each run also reports the run summary's ``policy_latency_ms`` (``after``: the actors' adoptions
of versions published while they were acting) beside the same run's adoptions with the start-up
one counted in (``before``: version 0, published before the actor and its env are built, as the
summary counted it until the start-up adoption was kept apart, ``startup_adoption_ms``).

    python bench/latency_breakdown.py --env Pendulum-v1 --batch 512 --updates 30
    python bench/latency_breakdown.py --env HalfCheetah-v5 --algo agro --batch 2048 --updates 16 --only-default
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from config import TrainConfig
from runtime.progress import quantiles_ms

PHASES = {  # name: (module, class or None, attribute)
    "learner_snapshot": ("learner.learner", "Learner", "snapshot"),
    "events_flush": ("streams.events", "EventBus", "flush"),  # the GradientStep event's, after the version's
    "offset_commit": ("streams.events", "EventConsumer", "commit"),
    "follower_poll": ("streams.policy.follower", "PolicyFollower", "poll"),
    "progress_line": ("runtime.progress", "Progress", "maybe_log"),
    "stream_worker": ("streams.worker", "PrepareWorker", "step"),
    "weight_load": ("actor.policy_client", None, "load_policy"),
    "tensorboard": ("runtime.tensorboard", "TensorBoardRun", "losses"),
}


@contextmanager
def timed_phases(spans: list[tuple[str, float, float]]):
    """Wrap every phase that exists in this code with a timer appending (name, start, end)."""
    import importlib

    undo = []
    for name, (mod_name, cls_name, attr) in PHASES.items():
        mod = importlib.import_module(mod_name)
        owner = getattr(mod, cls_name) if cls_name else mod
        orig = getattr(owner, attr, None)
        if orig is None:
            continue

        def wrap(*a, __orig=orig, __name=name, **k):
            t0 = time.perf_counter()
            try:
                return __orig(*a, **k)
            finally:
                spans.append((__name, t0, time.perf_counter()))

        setattr(owner, attr, wrap)
        undo.append((owner, attr, orig))
    import gc

    started: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            spans.append(("gc", started.pop(), time.perf_counter()))

    gc.callbacks.append(on_gc)
    try:
        yield
    finally:
        gc.callbacks.remove(on_gc)
        for owner, attr, orig in undo:
            setattr(owner, attr, orig)


def run(env: str, batch: int, updates: int, snapshot_every: int, algo: str = "ppo") -> dict:
    import streams.policy.publish as publish
    from rlstream.colocated import run_colocated

    spans: list[tuple[str, float, float]] = []
    published: dict[int, float] = {}
    adopted: list[tuple[float, float]] = []  # (perf time at adoption, latency s)
    orig_publish = publish.publish_policy_version

    def publish_timed(events, pv, **kw):
        orig_publish(events, pv, **kw)
        published[pv.version] = time.perf_counter()

    import learner.learner as learner_mod

    learner_mod.publish_policy_version = publish_timed
    with tempfile.TemporaryDirectory() as tmp, timed_phases(spans):
        cfg = TrainConfig(env_id=env, algo=algo, train_batch_size=batch, total_steps=batch * updates,
                          run_dir=Path(tmp), snapshot_every=snapshot_every, plot=False, metrics_port=-1,
                          log_every_s=1.0, torch_threads=1, tensorboard=None, preset="none")
        from actor import policy_client

        orig_poll = policy_client.PolicySubscriber.poll

        def poll(self, timeout=0.0, __orig=orig_poll):
            before = self.adopted
            took = __orig(self, timeout)
            if self.adopted > before:
                adopted.append((time.perf_counter(), self.version))
            return took

        policy_client.PolicySubscriber.poll = poll
        try:
            summary = run_colocated(cfg)
        finally:
            policy_client.PolicySubscriber.poll = orig_poll
            learner_mod.publish_policy_version = orig_publish
    rows, totals = [], {n: 0.0 for n in [*PHASES, "gc"]}
    for t_adopt, version in adopted:
        t_pub = published.get(version)
        if t_pub is None or version == 0:
            continue
        inside = {}
        for name, a, b in spans:
            overlap = min(b, t_adopt) - max(a, t_pub)
            if overlap > 0:
                inside[name] = inside.get(name, 0.0) + overlap
        lat = t_adopt - t_pub
        rows.append({"version": version, "latency_ms": round(lat * 1e3, 3),
                     **{k: round(v * 1e3, 3) for k, v in inside.items()},
                     # not in a timed phase (gc pauses run inside the others: not subtracted)
                     "other_ms": round((lat - sum(v for k, v in inside.items() if k != "gc")) * 1e3, 3)})
        for k, v in inside.items():
            totals[k] += v
    lats = [r["latency_ms"] / 1e3 for r in rows]
    after = summary["policy_latency_ms"]
    startup = summary.get("startup_adoption_ms")
    # the summary's values are not kept one by one: its adoptions are ``rows`` (this bench's clock)
    before = quantiles_ms(lats + ([startup / 1e3] if startup is not None else []))
    return {"snapshot_every": snapshot_every, "adoptions": len(rows), "latency_ms": quantiles_ms(lats),
            "summary_policy_latency_ms_after": after, "startup_adoption_ms": startup,
            "policy_latency_ms_startup_counted_before": before,
            "phase_total_ms": {k: round(v * 1e3, 2) for k, v in totals.items() if v},
            "worst": sorted(rows, key=lambda r: -r["latency_ms"])[:5]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env", default="Pendulum-v1")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--updates", type=int, default=30)
    p.add_argument("--algo", default="ppo")
    p.add_argument("--only-default", action="store_true", help="only the default snapshot schedule")
    a = p.parse_args()
    import os

    out = {"bench": "latency_breakdown", "env": a.env, "algo": a.algo, "batch": a.batch, "updates": a.updates,
           "cpus": os.cpu_count(), "loadavg_before": os.getloadavg(),
           "default_snapshots": run(a.env, a.batch, a.updates, 10, a.algo)}
    if not a.only_default:
        out["peer_every_update"] = run(a.env, a.batch, a.updates, 1, a.algo)
        out["peer_no_snapshots"] = run(a.env, a.batch, a.updates, 0, a.algo)
    out["loadavg_after"] = os.getloadavg()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
