"""The offset ledger (streams.offsets): commit nothing past the lowest record still held."""

from __future__ import annotations

from streams.bus.base import Record
from streams.offsets import OffsetLedger, next_offsets


def test_out_of_order_releases_commit_only_up_to_the_lowest_record_still_held():
    led: OffsetLedger[int] = OffsetLedger()
    for o in (10, 11, 12):
        led.read(0, o)
        led.hold(0, o, f"r{o}")
    assert led.upto(0) == 13 and led.safe(0) == 10
    assert led.release(0, 12) == "r12" and led.safe(0) == 10  # 10 and 11 still held
    assert led.release(0, 11) == "r11" and led.safe(0) == 10
    assert led.commit_due() == {0: 10}
    assert led.release(0, 10) == "r10" and led.safe(0) == 13  # nothing held: everything read
    assert led.commit_due() == {0: 13} and led.commit_due() == {}  # only what moved
    assert led.release(0, 10, "gone") == "gone" and len(led) == 0


def test_partitions_are_independent_and_a_record_read_unheld_is_done():
    led: OffsetLedger[tuple[str, int]] = OffsetLedger()
    a, b, c = ("t", 0), ("t", 1), ("t", 2)
    for o in range(5):
        led.read(a, o)
    led.read(b, 7)
    led.hold(b, 7)
    led.read(b, 8)  # dead-lettered at once: read, never held
    led.hold(c, 3)  # held, never read here (the learner's fragments are read by its consumer)
    assert led.offsets() == {a: 5, b: 7, c: 3}
    assert led.held() == [(b, 7), (c, 3)] and led.lowest_held(b) == 7 and led.holds(c, 3)
    led.release(b, 7)
    assert led.offsets() == {a: 5, b: 9, c: 3}


def test_a_revoked_partition_is_forgotten_and_never_committed_here_again():
    led: OffsetLedger[int] = OffsetLedger()
    for p in (0, 1):
        led.read(p, 4)
        led.hold(p, 4)
    assert led.commit_due() == {0: 4, 1: 4}
    led.forget([1])  # a rebalance took partition 1: its held record goes to the new owner
    assert led.offsets() == {0: 4} and led.held() == [(0, 4)] and led.upto(1) is None
    led.release(1, 4)  # a late release of a record no longer ours changes nothing
    assert led.commit_due() == {}
    led.start(1, 2)  # assigned again, from the group's commit
    assert led.safe(1) == 2 and led.commit_due() == {1: 2}


def test_reading_again_after_a_rewind_does_not_move_back_only_start_does():
    led: OffsetLedger[int] = OffsetLedger()
    for o in range(10):
        led.read(0, o)
    led.read(0, 3)  # redelivered after a seek back
    assert led.upto(0) == 10
    led.hold(0, 3)
    led.start(0, 3)  # set back: reading starts here, nothing held
    assert led.upto(0) == 3 and led.held() == []


def test_next_offsets_of_records():
    recs = [Record("t", p, o, None, b"") for p, o in [(0, 4), (1, 2), (0, 9), (0, 7)]]
    assert next_offsets(recs) == {("t", 0): 10, ("t", 1): 3}
    assert next_offsets(recs, key=lambda r: r.partition) == {0: 10, 1: 3}
