"""The role protocol, the one driver loop and role summary files (runtime/roles.py)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from actor.actor import Actor
from learner.learner import Learner
from rlstream.colocated import run_colocated
from config import BusConfig, TrainConfig
from runtime.roles import (OverlapTimes, Role, RoundWatchdog, Slot, clear_summaries, drive, drive_overlapped,
                           read_summaries, summary_path, write_summary)
from streams.worker import PrepareWorker
from testbed.wait import wait_for


class Counter:
    """A role with ``work`` units queued: each step does one, then it is idle."""

    def __init__(self, work: int = 0) -> None:
        self.work, self.steps, self.timeouts = work, 0, []

    def step(self, timeout: float = 0.0) -> int:
        self.steps += 1
        self.timeouts.append(timeout)
        if self.work:
            self.work -= 1
            return 1
        return 0

    def close(self) -> None:
        pass

    def summary(self) -> dict:
        return {"steps": self.steps}


@pytest.mark.parametrize("cls", [Actor, Learner, PrepareWorker])
def test_every_role_has_the_protocol(cls):
    assert issubclass(cls, Role)


def test_drive_stops_when_done_and_drains_drain_slots():
    a, w = Counter(), Counter(work=3)
    rounds = []
    ended = drive([Slot(a, timeout=0.5), Slot(w, drain=True)], done=lambda: len(rounds) >= 2,
                  on_round=lambda: rounds.append(1))
    assert ended == "done" and len(rounds) == 2
    assert a.steps == 2 and a.timeouts == [0.5, 0.5]
    assert w.steps == 5  # round 1: 3 units then one idle step; round 2: one idle step


def test_drive_ends_on_stop_and_on_deadline():
    stop = threading.Event()
    role = Counter()
    assert drive([Slot(role)], stop=stop, on_round=lambda: role.steps >= 3 and stop.set()) == "stopped"
    assert role.steps == 3
    t0 = time.monotonic()
    assert drive([Slot(Counter())], deadline=t0 + 0.2) == "deadline"
    assert time.monotonic() - t0 >= 0.2


class Logged:
    """A role that logs its steps (name, round, thread) in a shared list; ``meet``: a barrier
    every step waits on, so a round only passes if its partner steps at the same time."""

    def __init__(self, name: str, log: list, meet: threading.Barrier | None = None, fail_at: int | None = None):
        self.name, self.log, self.meet, self.fail_at, self.steps = name, log, meet, fail_at, 0

    def step(self, timeout: float = 0.0) -> int:
        self.steps += 1
        if self.meet is not None:
            self.meet.wait(timeout=30)  # a deadlock guard, not a timing: both sides arrive at once
        self.log.append((self.name, self.steps, threading.current_thread().name))
        if self.steps == self.fail_at:
            raise RuntimeError(f"{self.name} failed")
        return 0

    def close(self) -> None:
        pass

    def summary(self) -> dict:
        return {}


class Blocking(Counter):
    """A role whose first step blocks in ``wait_for_broker`` until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__(work=1)
        self.release = threading.Event()

    def wait_for_broker(self) -> None:
        self.release.wait(30)

    def step(self, timeout: float = 0.0) -> int:
        if self.steps == 0:
            self.wait_for_broker()
        return super().step(timeout)


class Looks(threading.Event):
    """The watchdog's stop event, recording when its watcher woke to look (``wait`` returned)."""

    def __init__(self) -> None:
        super().__init__()
        self.at: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        stopped = super().wait(timeout)
        self.at.append(time.monotonic())
        return stopped


def test_a_round_that_blocks_is_logged_with_where_it_is_blocked(caplog):
    role = Blocking()
    watch = RoundWatchdog([Slot(role)], warn_s=0.2)
    watch._closed = looks = Looks()
    with caplog.at_level("WARNING", logger="runtime.roles"), watch:
        watch.begin()
        # released once it has warned twice: repeated while it stays blocked, not once
        releaser = threading.Thread(target=lambda: (wait_for(lambda: watch.warnings >= 2, 60, "a second warning"),
                                                    role.release.set()))
        releaser.start()
        role.step()
        watch.end()
        releaser.join()
        blocked = watch.warnings
        assert blocked >= 2
        for _ in range(5):  # fast rounds after it: nothing more
            watch.begin()
            role.step()
            watch.end()
        idle_from = time.monotonic()
        # the watcher has looked after the last round began more than twice warn_s ago: a
        # warning it should not give would have been given by then
        wait_for(lambda: any(t > idle_from + 2 * watch.warn_s for t in looks.at), 60, "the watchdog to look again")
        assert watch.warnings == blocked
    lines = [r.getMessage() for r in caplog.records if r.name == "runtime.roles"]
    assert len(lines) == blocked
    assert "round of Blocking running for" in lines[0]
    assert "Blocking.wait_for_broker (ops/test_roles.py:" in lines[0]
    assert not watch._watcher.is_alive()


def test_drive_overlapped_runs_side_and_main_at_once_then_after_then_main_alone_when_done():
    log: list = []
    meet = threading.Barrier(2)  # passes only when the side and the main step run together
    side, main, after = Logged("side", log, meet), Logged("main", log), Logged("after", log)
    main.meet = meet
    rounds, times = [], OverlapTimes()

    def done() -> bool:
        if len(rounds) == 2:
            main.meet = None  # the last step of main runs alone
            return True
        return False

    ended = drive_overlapped([Slot(side)], [Slot(main)], [Slot(after)], before=lambda: log.append(("before",)),
                             done=done, on_round=lambda: rounds.append(1), times=times)
    assert ended == "done"
    names = [e[0] for e in log]
    # each round: before, then side and main (either order), then after; finally main alone
    assert names[0] == "before" and sorted(names[1:3]) == ["main", "side"] and names[3] == "after"
    assert names[4] == "before" and sorted(names[5:7]) == ["main", "side"] and names[7] == "after"
    assert names[8:] == ["main"] and (side.steps, main.steps, after.steps) == (2, 3, 2)
    threads = {e[0]: e[2] for e in log if len(e) == 3}
    assert threads["side"] != threads["main"] == threads["after"] == threading.current_thread().name
    assert times.rounds == 2


def test_drive_overlapped_joins_the_side_before_an_error_ends_it():
    log: list = []
    side, main = Logged("side", log, fail_at=2), Logged("main", log)
    with pytest.raises(RuntimeError, match="side failed"):
        drive_overlapped([Slot(side)], [Slot(main)])
    assert (side.steps, main.steps) == (2, 2)  # main's round 2 ran to its end; nothing after
    stop = threading.Event()
    stop.set()
    assert drive_overlapped([Slot(side)], [Slot(main)], stop=stop) == "stopped"


def test_summary_files_round_trip(tmp_path):
    write_summary(tmp_path, "learner", {"updates": 2})
    write_summary(tmp_path, "actor-0", {"steps": 64})
    assert read_summaries(tmp_path, ["learner", "actor-0", "streams"]) == {
        "learner": {"updates": 2}, "actor-0": {"steps": 64}}  # streams wrote none
    clear_summaries(tmp_path)
    assert not summary_path(tmp_path, "learner").exists() and read_summaries(tmp_path, ["learner"]) == {}


def test_colocated_run_writes_each_roles_summary(tmp_path):
    """A tiny co-located run: one driver loop over real roles, each role's summary in a file."""
    torch.set_num_threads(1)
    cfg = TrainConfig(env_id="CartPole-v1", total_steps=512, num_envs=4, train_batch_size=256, seed=1,
                      run_dir=tmp_path, log_every_s=1e9, plot=False, tensorboard=None,
                      bus=BusConfig(log_dir=str(tmp_path / "log")))
    s = run_colocated(cfg)
    roles = read_summaries(tmp_path, ["actor-0", "streams", "learner"])
    assert roles["learner"]["updates"] == s["updates"] == 2
    assert roles["learner"]["final_version"] == s["final_policy_version"]
    assert roles["actor-0"]["steps"] == s["steps"] and roles["actor-0"]["seq"] == s["events"]["rl.samples.raw"]
    assert roles["streams"]["emitted_batches"] == s["streams"]["emitted_batches"] == s["events"]["rl.samples.prepared"]
    assert json.loads((tmp_path / "summary.json").read_text())["updates"] == 2


def test_prepare_worker_run_is_the_driver_loop_and_ends_on_stop(tmp_path):
    """The in-process shell's own ``run`` goes through ``drive``: it returns once stop is set."""
    from rlstream import wiring

    cfg = TrainConfig(env_id="CartPole-v1", run_dir=tmp_path, bus=BusConfig())
    events = wiring.build_events(wiring.build_bus(cfg.bus), None)
    worker = wiring.build_prepare_worker(cfg, events, None)
    stop = threading.Event()
    t = threading.Thread(target=worker.run, args=(stop, 0.05, True))
    t.start()
    stop.set()
    t.join(30)
    assert not t.is_alive()
    assert worker.summary()["published"] == 0 and worker.summary()["role"] == "streams"
