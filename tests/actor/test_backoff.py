"""The actor's back-off: a round's flush of 1 s or more is one, counted with its seconds."""

from __future__ import annotations

from actor.backoff import THRESHOLD_S, DeliveryBackoff
from runtime.metrics import Metrics


def test_long_flushes_are_backoffs_and_reach_the_metrics():
    m = Metrics(role="actor", gpu=False)
    b = DeliveryBackoff(on_backoff=m.observe_backoff)
    for seconds in (0.002, THRESHOLD_S / 2, 42.5, 3.0):
        b.observe(seconds)
    assert b.stats() == {"waits": 2, "seconds": 45.5, "longest_s": 42.5}
    text = m.render().decode()
    assert 'rlstream_actor_backoffs_total{role="actor"} 2.0' in text
    assert 'rlstream_actor_backoff_seconds_total{role="actor"} 45.5' in text
    pending = {1, 2}
    m.watch_unacknowledged(lambda: len(pending))
    assert 'rlstream_unacknowledged_batches{role="actor"} 2.0' in m.render().decode()
