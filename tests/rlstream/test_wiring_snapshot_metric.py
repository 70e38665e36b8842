"""The learner ``wiring`` builds counts a failed snapshot save in its role's metrics
(``rlstream_snapshot_failures_total``): the hook is wired, not only available."""

from __future__ import annotations

from config import BusConfig, TrainConfig
from rlstream import wiring
from runtime.metrics import Metrics


def failures(m: Metrics) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in m.render().decode().splitlines()
               if line.startswith("rlstream_snapshot_failures_total{"))


def test_a_failed_save_is_counted_in_the_roles_metrics(tmp_path) -> None:
    store = tmp_path / "snaps"
    cfg = TrainConfig(env_id="Pendulum-v1", run_dir=tmp_path / "run", snapshot_store=str(store),
                      snapshot_every=1, bus=BusConfig(kind="memory"))
    metrics = Metrics(role="learner")
    bus = wiring.build_bus(cfg.bus)
    try:
        events = wiring.build_events(bus, metrics)
        info = wiring.env_info(cfg)
        algo = wiring.build_algo(cfg, info.obs_dim, info.act_dim, info.nvec)
        learner = wiring.build_learner(cfg, events, metrics, algo)
        learner.start()  # publishes version 0
        import shutil

        shutil.rmtree(store)
        store.write_text("a file where the store's directory was\n")  # every save now fails
        learner.snapshot()
        assert learner.snapshot_failures == 1
        assert failures(metrics) == 1
        learner.close()
    finally:
        bus.close()
