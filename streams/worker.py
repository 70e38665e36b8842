"""In-process shell of the prepare pipeline (co-located mode, or any bus backend).

    worker = PrepareWorker(events, Prepare.from_config(cfg, PolicyLogpFn.factory(blob_store)))
    stop = threading.Event()
    worker.run(stop)                 # or: while ...: worker.step(0.1)

Each ``step``: read new PolicyVersions (an ephemeral reader: every worker sees every version,
starting K + 1 records of its policy back from the end, ``streams.policies.StartRule.back``),
poll raw SampleBatches (not before the policy reader has reached the end offsets it found on
start, for at most ``policy_catchup_s``, as the Faust shell waits: no batch is judged against
a policy older than the newest published), hand each to the shell core (``streams.shell.ShellCore``: decode,
dead-letter, hold, prepare, emit), write what it returns through the ``EventBus``'s bus, flush, then commit.

Commits never pass a batch still held in the reorder buffer: the committed offset of a
partition stops at the lowest held offset (the core's ``streams.offsets.OffsetLedger``), so a crash redelivers held batches (at least once;
the learner's batch_id dedup or ours drops the copies). The consumer group defaults to
``STREAMS_GROUP`` (the Faust app's; a namespaced bus scopes it), so either shell continues
where the other stopped. A bad record of rl.policy.versions is skipped and counted
(``skipped``): the learner owns its dead letter (``streams.topics.DEAD_LETTER_OWNERS``).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from schemas.events import PolicyVersion, SampleBatch
from streams.events import EventBus, EventConsumer
from streams.processors.pipeline import Prepare
from streams.policies import StartRule, start_offsets
from streams.shell import PolicyRecords, Send, ShellCore
from streams.shell import policy_backlog as backlog_of
from streams.topics import POLICY_VERSIONS, SAMPLES_RAW, STREAMS_GROUP

STAGE = "streams.prepare"


class PrepareWorker:
    """Drives a ``Prepare`` from the bus. See the module docstring.

    Args:
        events: the typed bus.
        prepare: the pipeline (owned by this worker; not thread-safe).
        group: consumer group of the raw-sample reader (default ``STREAMS_GROUP``).
        max_records: most raw records per poll.
        metrics: optional ``runtime.metrics.Metrics`` (consumer lag).
        policy_backlog: how many PolicyVersions back from the end to start reading
            (default: the staleness window's K + 1).
        policy_records: the policy-record map of the core (default ``PolicyRecords()``).
        policy_catchup_s: most seconds raw samples wait on start for the policy reader to reach
            the end offsets of rl.policy.versions it found.
    """

    def __init__(self, events: EventBus, prepare: Prepare, group: str = STREAMS_GROUP, *,
                 max_records: int = 256, metrics: Any = None, policy_backlog: int | None = None,
                 policy_records: PolicyRecords | None = None, policy_catchup_s: float = 30.0) -> None:
        self.events = events
        self.prepare = prepare
        self.group = group
        self.max_records = max_records
        self.metrics = metrics
        self.core = ShellCore(prepare, events.dead_letters, STAGE, events.codec, policy_records)
        self.samples: EventConsumer = events.consumer(group, [SAMPLES_RAW], stage=STAGE, expect=SampleBatch)
        # K + 1 records of this policy back from the end (the policy layer's start rule)
        rule = StartRule.back(backlog_of(prepare, policy_backlog) - 1)
        start = start_offsets(events, prepare.policy_id, rule)
        self.policies: EventConsumer = events.consumer(None, [POLICY_VERSIONS], stage=STAGE,
                                                       expect=PolicyVersion, start=start or "earliest")
        begin = {p: o for (_, p), o in (start or {}).items()}
        self._catchup = {p: end for p, end in events.bus.end_offsets(POLICY_VERSIONS).items()
                         if end > begin.get(p, 0)}  # partition -> end offset still to be read
        self._catchup_until = time.monotonic() + policy_catchup_s

    published = property(lambda self: self.core.published)
    dead_lettered = property(lambda self: self.core.dead_lettered)
    skipped = property(lambda self: self.core.skipped)
    errors = property(lambda self: self.core.errors)

    # -- one step ---------------------------------------------------------------------------
    def step(self, timeout: float = 0.1) -> int:
        """One round; returns how much work it did (records read + outputs), 0 when idle."""
        work = self._read_policies()
        if self._catchup:
            if time.monotonic() < self._catchup_until:
                return work + self._read_policies(timeout)
            self._catchup = {}  # waited long enough: samples go on against what is known
        records = self.samples.raw.poll(timeout if not work else 0.0, self.max_records)
        for rec in records:
            work += 1
            work += self._deliver(self.core.on_sample(rec))
        work += self._deliver(self.core.tick())
        self.events.flush()
        self._commit()
        if self.metrics is not None:
            try:
                self.metrics.set_consumer_lag(self.group, SAMPLES_RAW, sum(self.samples.lag().values()))
            except Exception:
                pass
        return work

    def _read_policies(self, timeout: float = 0.0) -> int:
        n = 0
        while recs := self.policies.raw.poll(timeout, 64):
            timeout = 0.0
            for rec in recs:
                n += 1
                self._deliver(self.core.on_policy(rec))
        for p in list(self._catchup):  # the read position, which also passes transaction markers
            if self._catchup[p] <= (self.policies.raw.position(POLICY_VERSIONS, p) or 0):
                self._catchup.pop(p)
        return n

    def _deliver(self, sends: list[Send]) -> int:
        self.core.deliver(sends, self._produce)
        return len(sends)

    def _produce(self, s: Send) -> None:
        self.events.bus.produce(s.topic, s.value, key=s.key, headers=dict(s.headers or {}))

    def _commit(self) -> None:
        due = self.core.ledger.commit_due()  # read, and not past a record still held
        if due:
            self.samples.commit(offsets={(SAMPLES_RAW, p): o for p, o in due.items()})

    # -- loop -------------------------------------------------------------------------------
    def run(self, stop: threading.Event, timeout: float = 0.1, drain: bool = False) -> None:
        """``step`` until ``stop`` is set. ``drain`` releases the reorder buffer at the end
        (co-located runs); otherwise held batches stay uncommitted for the next worker."""
        from runtime.roles import Slot, drive

        try:
            drive([Slot(self, timeout)], stop=stop)
            if drain:
                self.drain()
        finally:
            self.close()

    def drain(self) -> None:
        self._deliver(self.core.drain())
        self.events.flush()
        self._commit()

    def summary(self) -> dict[str, Any]:
        """What this shell did (the role protocol's summary): the processors' stats."""
        return {"role": "streams", "published": self.published, "dead_lettered": self.dead_lettered,
                "skipped": self.skipped, **self.prepare.stats.as_dict()}

    def close(self) -> None:
        for c in (self.samples, self.policies):
            try:
                c.close()
            except Exception:
                pass


if __name__ == "__main__":  # moved up, to the composition root (no import reaches up from here)
    print("python -m streams.worker moved: run python -m rlstream.entry worker", file=sys.stderr)
    raise SystemExit(2)
