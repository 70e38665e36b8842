from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actor.fragment_size import DEFAULT_SIZES, FragmentSizeController


def test_defaults_are_bounded_powers_of_two() -> None:
    ctl = FragmentSizeController()
    assert ctl.sizes == DEFAULT_SIZES == (32, 64, 128, 256)
    assert ctl.size == 32


def test_growing_backlog_grows_to_256_and_stays_bounded() -> None:
    ctl = FragmentSizeController()
    seen = []
    for i in range(200):
        seen.append(ctl.update(backlog=100 * i))  # backlog keeps growing
    assert ctl.size == 256
    assert set(seen) <= set(DEFAULT_SIZES)
    assert seen == sorted(seen)  # only ever grew
    assert ctl.changes == 3


def test_idle_shrinks_to_32() -> None:
    ctl = FragmentSizeController(initial=256)
    for _ in range(100):
        ctl.update(backlog=0)
    assert ctl.size == 32
    for _ in range(20):
        assert ctl.update(backlog=0) == 32  # lower bound holds


def test_patience_ignores_a_single_spike() -> None:
    ctl = FragmentSizeController(patience=3)
    ctl.update(0)
    ctl.update(600)  # one reading of ~19 batches waiting, then gone: EWMA + patience absorb it
    for _ in range(30):
        ctl.update(0)
    assert ctl.changes == 0 and ctl.size == 32


def test_queue_simulation_drains_backlog() -> None:
    """Arrivals of 150 samples per step: 32 or 64 per step cannot keep up, 256 can."""
    ctl = FragmentSizeController()
    backlog = 0
    for _ in range(300):
        size = ctl.update(backlog)
        backlog = max(0, backlog + 150 - size)
    assert ctl.size in (128, 256) and backlog < 4 * 256
    # arrivals stop: the queue drains and the batch comes back down
    for _ in range(200):
        size = ctl.update(backlog)
        backlog = max(0, backlog - size)
    assert ctl.size == 32 and backlog == 0


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=0, max_value=1e6, allow_nan=False), st.sampled_from(DEFAULT_SIZES))
def test_no_oscillation_with_a_steady_signal(backlog: float, initial: int) -> None:
    ctl = FragmentSizeController(initial=initial)
    sizes = [ctl.update(backlog) for _ in range(200)]
    # moves monotonically in one direction, then settles
    assert sizes == sorted(sizes) or sizes == sorted(sizes, reverse=True)
    assert len(set(sizes[-100:])) == 1
    assert all(32 <= s <= 256 for s in sizes)


def test_step_time_budget_blocks_growth() -> None:
    ctl = FragmentSizeController(max_step_s=0.1)
    for _ in range(100):
        # 1.5 ms per sample: 64 -> 0.096 s fits, 128 -> 0.192 s would not
        ctl.update(backlog=1e6, step_time_s=0.0015 * ctl.size)
    assert ctl.size == 64


def test_step_time_over_budget_shrinks_without_oscillating() -> None:
    ctl = FragmentSizeController(initial=256, max_step_s=0.1, cooldown=2)
    sizes = []
    for _ in range(200):
        # superlinear step time: 256 -> 0.4 s, 128 -> 0.2 s, 64 -> 0.08 s
        step = {32: 0.03, 64: 0.08, 128: 0.2, 256: 0.4}[ctl.size]
        sizes.append(ctl.update(backlog=1e6, step_time_s=step))
    assert ctl.size == 64
    assert sizes == sorted(sizes, reverse=True)


def test_multiples_of_32_ladder_and_validation() -> None:
    ladder = tuple(range(32, 257, 32))
    ctl = FragmentSizeController(sizes=ladder, grow_at=4.0, shrink_at=0.5)
    for _ in range(400):
        ctl.update(1e6)
    assert ctl.size == 256
    with pytest.raises(ValueError, match="oscillate"):
        FragmentSizeController(grow_at=1.0, shrink_at=0.6)  # 0.6 * 2 >= 1.0
    with pytest.raises(ValueError):
        FragmentSizeController(sizes=(64, 32))
    with pytest.raises(ValueError):
        FragmentSizeController(initial=48)
    with pytest.raises(ValueError):
        FragmentSizeController().update(-1)
