"""The dynamic minibatch's default start, beside tests/learner/test_minibatch.py: without an
``initial`` the controller starts on the lower middle rung of its ladder (64 of 32..256), so it
can move either way at once, and the ladder is the guide's 32..256."""

from __future__ import annotations

from learner.minibatch import MINIBATCH_SIZES, MinibatchController


def test_without_initial_the_controller_starts_on_the_lower_middle_rung():
    assert MINIBATCH_SIZES[0] == 32 and MINIBATCH_SIZES[-1] == 256
    assert MinibatchController().size == 64
    assert MinibatchController(sizes=(8, 16, 32)).size == 8  # 3 rungs: the lower middle is the first
    assert MinibatchController(sizes=(8, 16, 32, 64, 128, 256)).size == 32
    grow = MinibatchController(patience=1)
    assert grow.update(0.9, 1.0) == 128  # one rung up from the start
    shrink = MinibatchController(patience=1)
    assert shrink.update(0.01, 1.0) == 32  # one rung down from the start
