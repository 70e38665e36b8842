"""The /act latency check at its edges (beside tests/rlstream/test_serve_health.py): a p99 equal
to the bound does not exceed it, the p99 is the nearest-rank one (of 100 requests, the 99th
slowest), and ``rlstream serve``'s defaults are the guide's (100 ms over the last 60 s, judged
from 20 requests), the same as the library's."""

from __future__ import annotations

import inspect

from logtools.serve import MAX_ACT_P99_MS, serve
from rlstream.cli import build_parser
from runtime.http import LatencyWindow
from tests.rlstream.test_serve_health import Clock


def test_a_p99_equal_to_the_bound_is_healthy_and_one_over_it_is_not() -> None:
    w = LatencyWindow(0.5, window_s=60.0, min_count=5, clock=Clock())
    for _ in range(5):
        w.observe(0.5)
    ok, detail = w.check()
    assert ok is True and detail["p99_ms"] == 500.0 == detail["max_p99_ms"]
    w.observe(0.75)
    w.observe(0.75)  # 2 of 7 over the bound: the p99 is 750 ms
    assert w.check()[0] is False


def test_the_p99_is_the_nearest_rank_one() -> None:
    w = LatencyWindow(0.1, window_s=60.0, min_count=5, clock=Clock())
    for _ in range(99):
        w.observe(0.01)
    w.observe(1.0)  # 1 slow in 100: the 99th of 100 sorted is still fast
    assert w.p99() == 0.01 and w.check()[0] is True
    w.observe(1.0)  # 2 in 101: rank ceil(99.99) = 100 is slow
    assert w.p99() == 1.0 and w.check()[0] is False


def test_the_serve_commands_defaults_are_the_guides_and_the_librarys() -> None:
    a = build_parser().parse_args(["serve"])
    assert (a.max_act_p99_ms, a.act_window_s, a.act_min_requests) == (100.0, 60.0, 20)
    defaults = {k: p.default for k, p in inspect.signature(serve).parameters.items()}
    assert MAX_ACT_P99_MS == 100.0
    assert (defaults["max_act_p99_ms"], defaults["act_window_s"], defaults["act_min_requests"]) == \
        (a.max_act_p99_ms, a.act_window_s, a.act_min_requests)
