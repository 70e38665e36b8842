"""``KafkaConsumer.commit``'s error paths on a real broker (``streams/bus/kafka/consumer.py``).

* fenced: a member the group timed out during a rebalance commits; the group refuses it, the
  commit is dropped and counted (``commit_failures``), and the records are redelivered to the
  member that owns the partition now, from the last commit that went through;
* timed retry: with the coordinator gone, a commit is retried for ``COMMIT_RETRY_S`` and then
  given up and counted; a broker back within that time takes the commit and nothing is counted;
* bounded: a broker that holds the connection and never answers (stopped) does not hold the
  caller past ``COMMIT_RETRY_S``; the commit stays in flight, and commits resume once it answers.

Nothing is patched but ``COMMIT_RETRY_S`` (how long the retry lasts)."""

from __future__ import annotations

import threading
import time

import pytest

import streams.bus.kafka.consumer as kafka_consumer
from streams.bus.kafka import KafkaBus
from streams.topics import TopicSpec
from tests.support import wait_for

pytestmark = [pytest.mark.kafka]

TOPIC = "t-commit-errors"
GROUP = "g-commit-errors"
# the private broker allows 1 s sessions; a member that does not poll for 1 s is out of the group
FAST = {"session.timeout.ms": 1000, "heartbeat.interval.ms": 100, "max.poll.interval.ms": 1000}


def _fill(bus: KafkaBus, n: int = 3) -> None:
    bus.create_topics([TopicSpec(TOPIC, key="test", partitions=1)])
    for i in range(n):
        bus.produce(TOPIC, b"%d" % i, key=b"k")
    bus.flush()


def _timed(call, limit: float, what: str) -> float:
    """Seconds ``call()`` took, run in a thread and waited for with a deadline: a call that never
    returns fails here after ``limit`` s (not at pytest's timeout); an exception it raised is re-raised."""
    done, out = threading.Event(), {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            call()
        except BaseException as e:  # re-raised below
            out["error"] = e
        finally:
            out["took"] = time.monotonic() - t0
            done.set()

    threading.Thread(target=run, daemon=True).start()
    wait_for(done.is_set, limit, what, every=0.05)
    if "error" in out:
        raise out["error"]
    return out["took"]


def _poll_all(consumer, n: int, timeout: float = 60.0) -> list:
    got: list = []
    wait_for(lambda: (got.extend(consumer.poll(0.2)), len(got) >= n)[1], timeout, f"{n} records")
    return got


def test_a_fenced_commit_is_dropped_counted_and_redelivered(private_kafka, caplog):
    with KafkaBus(private_kafka.bootstrap, client_id="member-a", consumer_config=FAST) as bus_a, \
            KafkaBus(private_kafka.bootstrap, client_id="member-b", consumer_config=FAST) as bus_b:
        _fill(bus_a)
        a = bus_a.consumer(GROUP, [TOPIC])
        got = _poll_all(a, 3)
        a.commit(got[:1])
        assert a.commit_failures == 0 and a.committed() == {(TOPIC, 0): 1}
        # b joins; a does not poll, so it never rejoins: the group times it out and gives b the
        # partition (a new generation), from a's last commit
        b = bus_b.consumer(GROUP, [TOPIC])
        redelivered = _poll_all(b, 2)
        assert [r.offset for r in redelivered] == [1, 2]
        a.commit(got)  # a's generation is over: refused, dropped without raising, counted
        assert a.commit_failures == 1
        assert any("refused" in r.getMessage() and "UNKNOWN_MEMBER_ID" in r.getMessage()
                   or "ILLEGAL_GENERATION" in r.getMessage() for r in caplog.records), caplog.text
        assert bus_b.group_positions(GROUP, TOPIC) == {0: 1}  # the refused commit did not land
        b.commit(redelivered)
        assert b.commit_failures == 0 and bus_b.group_positions(GROUP, TOPIC) == {0: 3}
        a.close()
        b.close()


def test_a_commit_without_a_coordinator_is_retried_then_given_up(private_kafka, monkeypatch, caplog):
    monkeypatch.setattr(kafka_consumer, "COMMIT_RETRY_S", 3.0)
    with KafkaBus(private_kafka.bootstrap, client_id="member-a", consumer_config=FAST) as bus:
        _fill(bus)
        c = bus.consumer(GROUP, [TOPIC])
        got = _poll_all(c, 3)
        private_kafka.kafka.kill()
        # no raise: the records would be redelivered; it gives up, by a deadline, not before its retry time
        took = _timed(lambda: c.commit(got), 60, "the commit to give up")
        assert c.commit_failures == 1
        assert took >= 3.0, f"gave up after {took:.1f}s, before COMMIT_RETRY_S"
        # librdkafka either answers _WAIT_COORD (retried until the deadline) or holds the commit
        # unanswered until the coordinator is back (left in flight at the deadline)
        assert any("failed for 3s" in r.getMessage() or "unanswered" in r.getMessage()
                   for r in caplog.records), caplog.text
        c.close()


@pytest.mark.slow
def test_a_commit_rides_out_a_broker_restart(private_kafka, monkeypatch):
    """The member's session outlasts the outage (a short one would be fenced on the restarted
    coordinator: the first test's path). librdkafka may hold a commit sent just as the broker
    went away until the coordinator is back, or answer ``_WAIT_COORD`` (which ``commit`` retries): either
    way the commit blocks, then lands, and nothing is counted."""
    monkeypatch.setattr(kafka_consumer, "COMMIT_RETRY_S", 150.0)
    long_session = {"session.timeout.ms": 120_000, "heartbeat.interval.ms": 1000, "max.poll.interval.ms": 300_000}
    with KafkaBus(private_kafka.bootstrap, client_id="member-a", consumer_config=long_session) as bus:
        _fill(bus)
        c = bus.consumer(GROUP, [TOPIC])
        got = _poll_all(c, 3)
        private_kafka.kafka.kill()
        done = threading.Event()
        errors: list[BaseException] = []

        def commit() -> None:
            try:
                c.commit(got)
            except Exception as e:  # reported below
                errors.append(e)
            finally:
                done.set()

        worker = threading.Thread(target=commit, daemon=True)
        worker.start()
        assert not done.wait(1.0), "the commit returned while the broker was down"
        private_kafka.kafka.start(timeout=120)
        assert done.wait(150), "the commit did not finish once the broker was back"
        worker.join(5)
        assert errors == [] and c.commit_failures == 0
        assert bus.group_positions(GROUP, TOPIC) == {0: 3}
        c.close()


def test_a_commit_to_a_broker_that_does_not_answer_returns_by_its_deadline(private_kafka, monkeypatch, caplog):
    """A stopped broker (as behind a network partition) holds the connection and never answers:
    librdkafka's synchronous commit would wait for ever. ``commit`` returns by ``COMMIT_RETRY_S``,
    counts the commit, skips later ones at once while it is in flight, and commits again (the
    later offsets) once the broker answers; ``close`` is bounded too."""
    import os
    import signal

    monkeypatch.setattr(kafka_consumer, "COMMIT_RETRY_S", 3.0)
    with KafkaBus(private_kafka.bootstrap, client_id="member-a") as bus:
        _fill(bus)
        c = bus.consumer(GROUP, [TOPIC])
        got = _poll_all(c, 3)
        c.commit(got[:1])
        pid = private_kafka.kafka.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            assert _timed(lambda: c.commit(got[:2]), 60, "the commit to return by its deadline") >= 3.0
            assert c.commit_failures == 1
            assert any("unanswered" in r.getMessage() for r in caplog.records), caplog.text
            # the first is still in flight (the broker never answers it): skipped, not queued behind
            # it, which would take its whole retry time
            took = _timed(lambda: c.commit(got), 60, "the second commit to return")
            assert took < kafka_consumer.COMMIT_RETRY_S and c.commit_failures == 2, took
        finally:
            os.kill(pid, signal.SIGCONT)

        def landed() -> bool:
            c.poll(0.2)
            c.commit(got)
            return bus.group_positions(GROUP, TOPIC) == {0: 3}

        wait_for(landed, 120, "the commit after the broker answers again")
        os.kill(pid, signal.SIGSTOP)
        try:
            c.commit(got[:1] + got)  # nothing new to commit: no request, no wait
            assert c.commit_failures == 2
        finally:
            os.kill(pid, signal.SIGCONT)
        c.close()
