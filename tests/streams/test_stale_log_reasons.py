"""The ``PolicyStalenessError`` log line beside tests/streams/test_stale_log.py: each reason has
its own rate-limit window, a batch too old in milliseconds shows its age and the window's
millisecond bound (also as the record's fields), and the shell's default limiter lets one line
per reason through in ``STALE_LOG_EVERY_S`` (10 s)."""

from __future__ import annotations

import logging

from config import PrepareConfig
from runtime.logging import RateLimiter
from schemas.codec import Codec
from streams.events import DeadLetters
from streams.processors.pipeline import Prepare
from streams.shell import STALE_LOG_EVERY_S, ShellCore
from streams.topics import DEADLETTER
from tests.streams.test_shell import Clock, policy, raw
from tests.streams.test_shell_scenarios import make_batch
from tests.streams.test_stale_log import Seconds, stale_lines

CODEC = Codec()


def core(clock, stale_log: RateLimiter | None = None) -> ShellCore:
    prepare = Prepare.from_config(PrepareConfig(max_versions=2, max_ms=500, importance=False), clock=clock)
    c = ShellCore(prepare, DeadLetters(None, CODEC), "streams.prepare", CODEC, stale_log=stale_log)
    c.deliver(c.on_policy(policy(0, 7)), lambda s: None)
    return c


def records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith("PolicyStalenessError")]


def test_each_reason_is_rate_limited_on_its_own_and_the_ms_window_is_logged(caplog):
    clock = Clock()
    c = core(clock, RateLimiter(10.0, clock=Seconds()))
    caplog.set_level(logging.WARNING, logger="streams.shell")
    sends = c.on_sample(raw(0, make_batch("a", 0, 2, clock.t)), handle=0)  # 5 versions behind
    sends += c.on_sample(raw(1, make_batch("a", 1, 7, clock.t - 800)), handle=1)  # current, but 800 ms old
    sends += c.on_sample(raw(2, make_batch("a", 2, 7, clock.t - 900)), handle=2)  # same reason, same window
    assert [s.reason for s in sends if s.topic == DEADLETTER] == ["stale_versions", "stale_ms", "stale_ms"]
    recs = records(caplog)
    assert [r.reason for r in recs] == ["stale_versions", "stale_ms"]  # one line per reason
    line = recs[1].getMessage()
    assert "batch a-1" in line and "0 versions behind and 800 ms old" in line
    assert "window: at most 2 versions, 500 ms" in line
    assert (recs[1].lag_versions, recs[1].lag_ms, recs[1].max_versions, recs[1].max_ms) == (0, 800, 2, 500)
    assert recs[0].lag_ms == 0 and recs[0].max_ms == 500


def test_the_default_limiter_lets_one_line_per_reason_through_in_ten_seconds(caplog):
    assert STALE_LOG_EVERY_S == 10.0
    clock = Clock()
    c = core(clock)  # the shell's own limiter, on the real monotonic clock
    assert c.stale_log.every_s == STALE_LOG_EVERY_S
    caplog.set_level(logging.WARNING, logger="streams.shell")
    for seq in range(3):  # well within 10 s of each other
        c.on_sample(raw(seq, make_batch("a", seq, 1, clock.t)), handle=seq)
    assert len(stale_lines(caplog)) == 1
