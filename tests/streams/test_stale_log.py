"""A stale batch is a ``PolicyStalenessError`` line in the processors' log (the deployment guide
tells operators to look there), rate-limited per reason, with the batch's lag and the window,
besides its dead letter and counters."""

from __future__ import annotations

import logging

from config import PrepareConfig
from runtime.logging import RateLimiter
from schemas.codec import Codec
from streams.events import DeadLetters
from streams.processors.pipeline import Prepare
from streams.shell import ShellCore
from streams.topics import DEADLETTER
from tests.streams.test_shell import Clock, policy, raw
from tests.streams.test_shell_scenarios import make_batch

CODEC = Codec()


class Seconds:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def stale_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("PolicyStalenessError")]


def test_stale_batches_are_logged_once_per_window_per_reason_with_lag_window_and_suppressed_count(caplog):
    clock, secs = Clock(), Seconds()
    prepare = Prepare.from_config(PrepareConfig(max_versions=2, max_ms=None, importance=False), clock=clock)
    core = ShellCore(prepare, DeadLetters(None, CODEC), "streams.prepare", CODEC,
                     stale_log=RateLimiter(10.0, clock=secs))
    core.deliver(core.on_policy(policy(0, 7)), lambda s: None)
    caplog.set_level(logging.WARNING, logger="streams.shell")
    sends = []
    for seq in range(3):  # three batches 5 versions behind, in one window: one line
        sends += core.on_sample(raw(seq, make_batch("a", seq, 2, clock.t)), handle=seq)
    assert [s.reason for s in sends if s.topic == DEADLETTER] == ["stale_versions"] * 3  # dead letters as before
    lines = stale_lines(caplog)
    assert len(lines) == 1
    assert "stale_versions" in lines[0] and "batch a-0" in lines[0] and "behaviour version 2" in lines[0]
    assert "5 versions behind" in lines[0] and "at most 2 versions" in lines[0]
    rec = next(r for r in caplog.records if r.getMessage() == lines[0])
    assert (rec.lag_versions, rec.max_versions, rec.suppressed) == (5, 2, 0)
    fresh = core.on_sample(raw(3, make_batch("a", 3, 7, clock.t)), handle=3)  # a fresh one: no line
    assert [s.topic for s in fresh] != [DEADLETTER] and len(stale_lines(caplog)) == 1
    secs.t += 10.0  # the window has passed: the next stale batch is logged, with the two suppressed
    core.on_sample(raw(4, make_batch("a", 4, 1, clock.t)), handle=4)
    lines = stale_lines(caplog)
    assert len(lines) == 2 and "6 versions behind" in lines[1] and "(2 more since the last such line)" in lines[1]


def test_rate_limiter_counts_suppressed_lines_per_key():
    secs = Seconds()
    limiter = RateLimiter(5.0, clock=secs)
    assert limiter.allow("x") == (True, 0)
    assert limiter.allow("x") == (False, 0) and limiter.allow("x") == (False, 0)
    assert limiter.allow("y") == (True, 0)  # its own window
    secs.t += 4.9
    assert limiter.allow("x") == (False, 0)
    secs.t += 0.1
    assert limiter.allow("x") == (True, 3)
    assert limiter.allow("x") == (False, 0)
    secs.t += 5.0
    assert limiter.allow("x") == (True, 1)  # counted afresh after each reported line
