"""Follow PolicyVersion events from a chosen version: the API any consumer of policies uses
(an evaluator, a dashboard, the inference server, a notebook), and ``rlstream subscribe``.

    feed = PolicyFeed(events, policy_id="policy", from_version=3)   # or a Bus
    for update in feed:                       # 3, 4, 5 ... (replayed), then live ones
        act = update.policy.act(obs, deterministic=True)[0]        # module built on first use
        ...
    feed.close()

    # or, with a callback, until ``stop`` is set:
    feed.run(lambda u: evaluate(u.version, u.policy), stop=stop_event)

Where a feed starts:

* ``from_version=None``: at the newest version of ``policy_id`` now on the topic (found by
  reading back from the log end, not by replaying the history), then every later one;
* ``from_version=k``: every version >= k in order (replayed from the start of the topic),
  then live ones. A k newer than anything published waits for k to arrive;
* pinned, ``version=k`` or ``at_ms=t`` (point in time): exactly one update, version k or the
  newest version published at or before t ("the policy as it was at 14:02"), then nothing:
  a pinned feed does not follow. ``PinNotFound`` if there is no such version.

Versions are immutable and monotonic, so a feed never goes backwards: a version not newer
than the last one it handed out (a duplicate record, a second writer) is skipped and counted
in ``skipped``. ``group``: commit progress under this consumer group, so a restarted feed of
the same group resumes after the last update it handed out (at-least-once: an update counts
as handled when the next one is asked for, or when ``run``'s callback returns); a group with
no committed offset starts as ``from_version`` says.

Records that do not decode as a PolicyVersion are dead-lettered (reason and bytes kept) and
skipped, never silently. The weights are decoded only when ``update.policy`` (or
``update.load()``) is first used, so following versions without loading them is cheap.

``follow`` is the JSON-lines generator behind ``rlstream subscribe policies|steps|deadletters``.

From a notebook or script, ``PolicyFeed.from_environment(from_version=10)`` finds Kafka as the
command line does: ``KAFKA_BROKERS``, and the namespace from ``RLSTREAM_NAMESPACE`` or the run
directory (``runs/latest`` unless ``run_dir=`` names another). With no broker there it raises
``NoBrokerError`` naming the address; when the namespace has no such topic,
``TopicNotFoundError`` naming the namespaces the broker has.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from config import BusConfig
from config.bus import LATEST_RUN
from config.env import Environment
from schemas.errors import CodecError
from schemas.events import DeadLetter, GradientStep, PolicyVersion
from schemas.weights import sha256
from streams.bus.base import Bus, Consumer, Record
from streams.events import EventBus
from streams.policies import (
    Blobs as BlobStore,
    PolicyFollower,
    PolicyUpdate,
    StartRule,
    decodes_as as _decodes_as,
    newest_version,
    tail_offsets,
)
from streams.topics import DEADLETTER, LEARNER_STEPS, POLICY_VERSIONS

__all__ = ["PolicyFeed", "PolicyUpdate", "follow", "open_events", "tail_offsets", "newest_version", "FOLLOWABLE",
           "pinned_update", "parse_at", "PinNotFound"]

FOLLOWABLE = ("policies", "steps", "deadletters")


# -- plumbing shared by subscribe, serve, rollback and replay ---------------------------------

def open_events(source: BusConfig | Bus | EventBus, metrics: Any = None,
                need: tuple[str, ...] = ()) -> tuple[EventBus, Bus | None]:
    """``(events, owned_bus)`` for a BusConfig (a new bus, ``streams.bus.open_bus``; the
    caller closes ``owned_bus``), a Bus, or an EventBus (used as is; ``owned_bus`` is None).

    A memory BusConfig gives a new, empty in-process bus: in-process callers pass their Bus.
    ``need``: logical topics a Kafka BusConfig's namespace must already have (a tool reading a
    run): ``TopicNotFoundError``, naming the namespaces the broker has, when one is missing.
    """
    if isinstance(source, EventBus):
        return source, None
    from streams.bus import open_bus
    from streams.events import event_bus

    if isinstance(source, Bus):
        return event_bus(source, metrics), None
    if isinstance(source, BusConfig):
        bus = _open_reading(source, need) if need and source.kind == "kafka" else open_bus(source)
        return event_bus(bus, metrics), bus
    raise TypeError(f"expected a BusConfig, Bus or EventBus, not {type(source).__name__}")


def _open_reading(cfg: BusConfig, need: tuple[str, ...]) -> Bus:
    """``open_bus(cfg)``, once the topics of ``need`` are found in ``cfg.namespace`` (so a tool
    pointed at the wrong namespace says so instead of creating empty topics and waiting)."""
    from streams.bus import in_namespace, kafka_bus
    from streams.topics import Namespace, all_topics

    ns = Namespace(cfg.namespace)
    raw = kafka_bus(cfg)
    try:
        raw.require_topics([ns.topic(t) for t in need], ns.name)
        bus = in_namespace(raw, ns.name)
        bus.create_topics(all_topics(cfg.partitions, cfg.retention))
    except BaseException:
        raw.close()
        raise
    return bus


def _decode(events: EventBus, rec: Record, expect: type | tuple[type, ...]) -> Any:
    """The decoded, validated event; raises CodecError (a wrong type included)."""
    return events.codec.decode_valid(rec.value, expect, rec.topic)


# -- PolicyFeed --------------------------------------------------------------------------------

class PinNotFound(LookupError):
    """No version matches a pin (``version=`` / ``at_ms=``)."""


def parse_at(text: str) -> int:
    """A point in time as epoch ms: epoch ms digits, ISO 8601 (``2026-12-03T14:02:00+00:00``;
    no zone: local time), or ``HH:MM[:SS]`` today in local time."""
    import datetime as dt

    text = text.strip()
    if text.isdigit():
        return int(text)
    try:
        if len(text) <= 8 and ":" in text:
            t = dt.time.fromisoformat(text)
            when = dt.datetime.combine(dt.date.today(), t)
        else:
            when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a time: use epoch ms, ISO 8601 or HH:MM") from None
    if when.tzinfo is None:
        when = when.astimezone()
    return int(when.timestamp() * 1000)


def pinned_update(events: EventBus, policy_id: str | None, version: int | None = None,
                  at_ms: int | None = None, topic: str = POLICY_VERSIONS,
                  blob_store: BlobStore | None = None) -> PolicyUpdate:
    """Version ``version`` of ``policy_id``, or its newest published at or before ``at_ms``."""
    if (version is None) == (at_ms is None):
        raise ValueError("pin either a version or a time")
    best: tuple[Record, PolicyVersion] | None = None
    for rec in events.bus.read_all(topic):
        try:
            pv = _decode(events, rec, PolicyVersion)
        except CodecError:
            continue
        if policy_id is not None and pv.policy_id != policy_id:
            continue
        if version is not None and pv.version == version:
            best = (rec, pv)
            break
        if at_ms is not None and pv.created_at_ms <= at_ms and (best is None or pv.version > best[1].version):
            best = (rec, pv)
    if best is None:
        what = f"version {version}" if version is not None else f"version published at or before {at_ms} ms"
        raise PinNotFound(f"no {what} of policy {policy_id!r} on {topic}")
    return PolicyUpdate.of(best[0], best[1], blob_store)


class PolicyFeed:
    """Iterates PolicyVersion events of ``policy_id`` (None: every policy) as PolicyUpdates.

    Args:
        source: an EventBus or Bus (in-process), or a BusConfig (the feed opens and closes it).
        policy_id: which policy to follow; None follows all of them (each monotonic on its own).
        from_version: None: start at the newest; k: replay every version >= k, then follow.
        version / at_ms: pin one version, or the one current at that time (epoch ms); no follow.
        group: commit progress under this consumer group (see the module docstring).
        topic: the versions topic (tests use their own).
        blob_store: for claim-checked weights.
        dead_letter: dead-letter records that do not decode (False: only count them).
        stage: recorded on dead letters.
    """

    def __init__(self, source: BusConfig | Bus | EventBus, policy_id: str | None = "policy",
                 from_version: int | None = None, group: str | None = None, *,
                 topic: str = POLICY_VERSIONS, blob_store: BlobStore | None = None,
                 dead_letter: bool = True, stage: str = "policy-feed", join_timeout: float = 30.0,
                 version: int | None = None, at_ms: int | None = None) -> None:
        if from_version is not None and from_version < 0:
            raise ValueError(f"from_version must be >= 0, not {from_version}")
        pinned = version is not None or at_ms is not None
        if pinned and (group is not None or from_version is not None):
            raise ValueError("a pinned feed (version/at_ms) takes neither group nor from_version")
        self.events, self._owned = open_events(source, need=(topic,))
        self.policy_id = policy_id
        self.from_version = from_version
        self.group = group
        self.topic = topic
        self.blob_store = blob_store
        self.delivered = 0
        self._to_commit: Record | None = None
        self._closed = False
        self._pinned: list[PolicyUpdate] | None = None
        self.follower: PolicyFollower | None = None
        try:
            if pinned:
                self._pinned = [pinned_update(self.events, policy_id, version, at_ms, topic, blob_store)]
                return
            start = StartRule.newest() if from_version is None else StartRule.at_version(from_version)
            self.follower = PolicyFollower(self.events, policy_id, start, blobs=blob_store, topic=topic,
                                           stage=stage, dead_letter=dead_letter, group=group,
                                           join_timeout=join_timeout)
        except BaseException:
            self._close_bus()
            raise

    @classmethod
    def from_environment(cls, env: Environment | None = None, *, run_dir: str | Path | None = LATEST_RUN,
                         namespace: str | None = None, bootstrap: str | None = None, **kwargs: Any) -> "PolicyFeed":
        """A feed on Kafka as ``rlstream subscribe`` finds it: ``bootstrap``, else ``KAFKA_BROKERS``;
        ``namespace``, else ``RLSTREAM_NAMESPACE``, else the one ``run_dir`` records (its
        ``namespace`` file). ``env``: the environment (None: this process's, read now);
        ``kwargs`` as the constructor's (``policy_id``, ``from_version``...)."""
        cfg = BusConfig.from_environment(env if env is not None else Environment.read(), kind="kafka",
                                         bootstrap=bootstrap, namespace=namespace, run_dir=run_dir)
        return cls(cfg, **kwargs)

    @property
    def consumer(self) -> Consumer | None:
        return None if self.follower is None else self.follower.consumer

    # counters of the follower (0 for a pinned feed)
    skipped = property(lambda self: self.follower.skipped if self.follower else 0)
    undecodable = property(lambda self: self.follower.undecodable if self.follower else 0)
    last_error = property(lambda self: self.follower.last_error if self.follower else None)

    # -- reading -------------------------------------------------------------------------------
    def _items(self, timeout: float) -> list[tuple[Record, PolicyUpdate | CodecError]]:
        """Decoded updates and decode failures, in log order (monotonic filter applied)."""
        if self._closed:
            raise RuntimeError("feed is closed")
        if self._pinned is not None:
            if not self._pinned:
                time.sleep(min(timeout, 0.05))  # a pinned feed has nothing after its one update
            out, self._pinned = [(u.record, u) for u in self._pinned], []
            return out
        if self.group is not None and self._to_commit is not None:
            self.consumer.commit([self._to_commit])
            self._to_commit = None
        return self.follower.read(timeout)

    def poll(self, timeout: float = 0.0) -> list[PolicyUpdate]:
        """Updates that arrived within ``timeout`` s (possibly none), oldest first."""
        items = [(r, x) for r, x in self._items(timeout) if isinstance(x, PolicyUpdate)]
        if items:
            self.delivered += len(items)
            if self.group is not None:
                self._to_commit = items[-1][0]
        return [x for _, x in items]

    def updates(self, stop: threading.Event | None = None, idle_timeout: float | None = None,
                count: int | None = None, poll_interval: float = 0.2) -> Iterator[PolicyUpdate]:
        """Yield updates until ``stop`` is set, ``count`` were yielded, or ``idle_timeout`` s
        passed without one (None: no limit)."""
        yielded = 0
        last = time.monotonic()
        while not (stop is not None and stop.is_set()):
            if count is not None and yielded >= count:
                return
            for rec, item in self._items(poll_interval):
                if not isinstance(item, PolicyUpdate):
                    continue
                self.delivered += 1
                yielded += 1
                last = time.monotonic()
                if self.group is not None:
                    self._to_commit = rec
                yield item
                if count is not None and yielded >= count:
                    self.commit()
                    return
            if idle_timeout is not None and time.monotonic() - last > idle_timeout:
                return

    def __iter__(self) -> Iterator[PolicyUpdate]:
        return self.updates()

    def run(self, callback: Callable[[PolicyUpdate], Any], stop: threading.Event | None = None,
            idle_timeout: float | None = None, count: int | None = None) -> int:
        """Call ``callback(update)`` for each update (committing after it returns) until ``stop``
        / ``count`` / ``idle_timeout``; returns how many were handled."""
        n = 0
        for update in self.updates(stop=stop, idle_timeout=idle_timeout, count=count):
            callback(update)
            n += 1
            self.commit()
        return n

    def commit(self) -> None:
        """Commit past the last update handed out (group feeds; no-op otherwise)."""
        if self.group is not None and self._to_commit is not None and not self._closed:
            self.consumer.commit([self._to_commit])
            self._to_commit = None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.consumer is not None:
                self.consumer.close()
        finally:
            self._close_bus()

    def _close_bus(self) -> None:
        if self._owned is not None:
            self._owned.close()
            self._owned = None

    def __enter__(self) -> "PolicyFeed":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- follow: the `rlstream subscribe` generator ------------------------------------------------

def _payload(data: bytes | None) -> dict[str, Any]:
    data = data or b""
    return {"bytes": len(data), "sha256": sha256(data)}


def _key(key: bytes | None) -> str | None:
    if key is None:
        return None
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        return "0x" + key.hex()


def _describe_step(rec: Record, s: GradientStep) -> dict[str, Any]:
    return {"event": "gradient_step", "learner_id": s.learner_id, "step": s.step,
            "from_version": s.from_version, "to_version": s.to_version, "algo": s.algo,
            "losses": s.losses, "grad_norm": s.grad_norm, "num_samples": s.num_samples,
            "batches": len(s.batch_ids), "started_at_ms": s.started_at_ms,
            "finished_at_ms": s.finished_at_ms, "partition": rec.partition, "offset": rec.offset}


def _describe_dead_letter(rec: Record, d: DeadLetter) -> dict[str, Any]:
    return {"event": "dead_letter", "topic": d.topic, "partition": d.partition, "offset": d.offset,
            "reason": d.reason, "error_class": d.error_class, "stage": d.stage,
            "occurred_at_ms": d.occurred_at_ms, "key": _key(d.key), "detail": d.detail,
            "value": _payload(d.value), "headers": sorted(d.headers),
            "dead_letter_partition": rec.partition, "dead_letter_offset": rec.offset}


def _describe_error(rec: Record, e: CodecError) -> dict[str, Any]:
    return {"event": "undecodable", "topic": rec.topic, "partition": rec.partition, "offset": rec.offset,
            "reason": e.reason, "error": str(e), "value": _payload(rec.value)}


def follow(bus_config: BusConfig | Bus | EventBus, what: str, from_version: int | None = None,
           count: int | None = None, idle_timeout: float | None = None,
           stop: threading.Event | None = None, *, policy_id: str | None = None,
           topic: str | None = None) -> Iterator[dict[str, Any]]:
    """JSON-able dicts, one per event of ``what`` (policies | steps | deadletters), never weights.

    * policies: PolicyVersion summaries (weights by size and sha256), as ``PolicyFeed``
      starts them (newest, or every version >= ``from_version``); ``policy_id`` None: all.
    * steps: GradientStep events; None starts at the newest, k at ``to_version >= k``.
    * deadletters: every DeadLetter from the beginning (they are few and each matters);
      ``from_version`` does not apply.

    A record that does not decode gives an ``{"event": "undecodable", ...}`` line (this
    read-only tail does not dead-letter it: the consumers that own the topic do). Stops after
    ``count`` lines, ``idle_timeout`` s without one, or when ``stop`` is set.
    """
    if what not in FOLLOWABLE:
        raise ValueError(f"cannot follow {what!r}: choose from {', '.join(FOLLOWABLE)}")
    if what == "deadletters" and from_version is not None:
        raise ValueError("--from-version applies to policies and steps, not deadletters")
    name = topic or {"policies": POLICY_VERSIONS, "steps": LEARNER_STEPS, "deadletters": DEADLETTER}[what]
    events, owned = open_events(bus_config, need=(name,))
    try:
        if what == "policies":
            feed = PolicyFeed(events, policy_id=policy_id, from_version=from_version,
                              topic=name, dead_letter=False, stage="subscribe")

            def poll(t: float) -> list[tuple[Record, dict]]:
                return [(r, x.describe() if isinstance(x, PolicyUpdate) else _describe_error(r, x))
                        for r, x in feed._items(t)]

            closer = feed.close
        else:
            cls, describe = (GradientStep, _describe_step) if what == "steps" else (DeadLetter, _describe_dead_letter)
            if what == "steps" and from_version is None:
                start: Any = tail_offsets(events.bus, name, _decodes_as(events, GradientStep))
            else:
                start = "earliest"
            consumer = events.bus.consumer(None, [name], start=start)

            def poll(t: float) -> list[tuple[Record, dict]]:
                out = []
                for rec in consumer.poll(t, max_records=1000):
                    try:
                        ev = _decode(events, rec, cls)
                    except CodecError as e:
                        out.append((rec, _describe_error(rec, e)))
                        continue
                    if what == "steps" and from_version is not None and ev.to_version < from_version:
                        continue
                    out.append((rec, describe(rec, ev)))
                return out

            closer = consumer.close
        try:
            n = 0
            last = time.monotonic()
            while not (stop is not None and stop.is_set()):
                if count is not None and n >= count:
                    return
                for _, line in poll(0.2):
                    yield line
                    n += 1
                    last = time.monotonic()
                    if count is not None and n >= count:
                        return
                if idle_timeout is not None and time.monotonic() - last > idle_timeout:
                    return
        finally:
            closer()
    finally:
        if owned is not None:
            owned.close()
