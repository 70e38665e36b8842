"""The actor's back-off while the broker does not acknowledge its batches.

A decoupled actor's process flushes its bus after every round (``RoleProcess.after_round``): the
flush returns once the broker has acknowledged every batch of the round (Kafka: ``acks=all``), and
the actor takes no step before it does. So at most one round of batches is ever unacknowledged
(``Acknowledgements.pending``), however long the broker refuses them: a broker down, or a partition
below ``min.insync.replicas`` whose leader answers NOT_ENOUGH_REPLICAS, which the producer retries
while the flush waits (``KafkaBus.flush``: its timeout, then its outage wait; past both it raises
and the actor exits, for its supervisor to restart). ``DeliveryBackoff`` counts those waits: a
flush that outlasts ``THRESHOLD_S`` is one back-off, and its seconds are added up
(``rlstream_actor_backoffs_total``, ``rlstream_actor_backoff_seconds_total``, the summary's
``backoff``)."""

from __future__ import annotations

from collections.abc import Callable

#: A round's flush at least this long is a back-off (an acknowledged round takes milliseconds).
THRESHOLD_S = 1.0


class DeliveryBackoff:
    """Back-offs of one actor: ``observe(seconds)`` with each round's flush time (the harness's
    ``on_flush``); ``on_backoff(seconds)`` is told of each back-off (``Metrics.observe_backoff``)."""

    def __init__(self, threshold_s: float = THRESHOLD_S,
                 on_backoff: Callable[[float], None] | None = None) -> None:
        self.threshold_s = threshold_s
        self.on_backoff = on_backoff
        self.waits = 0
        self.seconds = 0.0
        self.longest_s = 0.0

    def observe(self, seconds: float) -> None:
        if seconds < self.threshold_s:
            return
        self.waits += 1
        self.seconds += seconds
        self.longest_s = max(self.longest_s, seconds)
        if self.on_backoff is not None:
            self.on_backoff(seconds)

    def stats(self) -> dict:
        return {"waits": self.waits, "seconds": round(self.seconds, 3), "longest_s": round(self.longest_s, 3)}
