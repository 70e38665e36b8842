"""``StreamsApp``: the Faust app of the prepare pipeline, its agents, timers and pages around one
``Prepare`` (the package docstring says what each does), its policy reader, and the delivery of
what the shell core sends, acked in offset order."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

import faust

from config.limits import MAX_MESSAGE_BYTES
from schemas.codec import Codec
from streams.bus.base import Record
from streams.events import DeadLetters, EventBus
from streams.faust_app.clients import (
    METADATA_MAX_AGE_MS,
    aiokafka_security,
    broker_urls,
    faust_credentials,
    replication_settings,
)
from streams.faust_app.table import TableState, raw_partitions_of
from streams.policies import StartRule, start_offsets
from streams.processors.pipeline import Prepare
from streams.settings import StreamsSettings
from streams.shell import SEEK, TAKE, InOrderAcks, PolicyRecords, Send, ShellCore, policy_backlog, policy_starts
from streams.topics import (
    DEADLETTER,
    LEGACY,
    POLICY_VERSIONS,
    SAMPLES_PREPARED,
    SAMPLES_RAW,
    TOPICS,
    Namespace,
)

log = logging.getLogger("streams.faust_app")  # the whole Faust shell logs under one name

STAGE = "streams.faust"

#: ``send(topic, key, value, headers)`` -> awaitable that completes when the record is durable.
SendFn = Callable[[str, bytes | None, bytes, dict[str, bytes]], Awaitable[Any]]
#: ``make_prepare(actor_state)`` -> the worker's ``Prepare`` over the per-actor state table
#: (``rlstream.wiring.build_prepare``: the one place the processors are assembled).
PrepareFactory = Callable[[MutableMapping], Prepare]


def _headers(h: Any) -> dict[str, bytes]:
    if not h:
        return {}
    items = h.items() if isinstance(h, Mapping) else h
    out = {}
    for k, v in items:
        k = k.decode() if isinstance(k, bytes) else str(k)
        out[k] = v if isinstance(v, bytes) else str(v).encode()
    return out


def as_record(msg: Any, namespace: Namespace = LEGACY) -> Record:
    """A Kafka message (Faust's or aiokafka's) as a bus ``Record`` under its logical topic name."""
    key = msg.key if isinstance(msg.key, (bytes, type(None))) else str(msg.key).encode()
    value = msg.value if isinstance(msg.value, (bytes, bytearray)) else repr(msg.value).encode()
    return Record(namespace.logical(str(msg.topic)), int(msg.partition), int(msg.offset), key, bytes(value),
                  _headers(msg.headers))


class StreamsApp:
    """The Faust app with its agents around one ``Prepare``. ``app`` is what Faust runs.

    Built by the composition root (``rlstream.wiring.build_faust_app``), which gives it the
    ``Prepare`` (or ``make_prepare``, to build one over the app's per-actor state table), the codec
    and the metrics; constructing it touches neither the network nor the disk unless
    ``settings.raw_partitions`` is unknown (then the broker is asked)."""

    def __init__(self, settings: StreamsSettings, prepare: Prepare | None = None, metrics: Any = None,
                 codec: Codec | None = None, policy_records: PolicyRecords | None = None,
                 make_prepare: PrepareFactory | None = None) -> None:
        if prepare is None and make_prepare is None:
            raise ValueError("StreamsApp needs a Prepare or a make_prepare factory")
        self.settings = settings
        if settings.torch_threads > 0:
            import torch

            torch.set_num_threads(settings.torch_threads)
        self.codec = codec or Codec()
        self.metrics = metrics
        self.app = faust.App(
            settings.app_id,
            broker=broker_urls(settings.brokers),
            broker_credentials=faust_credentials(settings.client_config),
            store="memory://",
            topic_partitions=settings.topic_partitions,
            key_serializer="raw",
            value_serializer="raw",
            web_port=settings.web_port,
            web_enabled=True,
            # Held (reorder-buffered) records stay unacked on purpose: never wait for them
            # on rebalance/stop; they are redelivered, uncommitted.
            stream_wait_empty=False,
            producer_max_request_size=MAX_MESSAGE_BYTES,
            consumer_max_fetch_size=MAX_MESSAGE_BYTES,
            consumer_auto_offset_reset="earliest",
            broker_commit_interval=settings.commit_interval_s,
            # No standby copies of the actor-state table: its changelog is small (one record per
            # actor), and a standby turning active on a takeover could leave recovery waiting on
            # changelog records it never fetched (seen with faust-streaming 0.15.3).
            table_standby_replicas=0,
            **replication_settings(settings.replication),
        )
        self.topics = {name: self._topic(name) for name in (SAMPLES_RAW, SAMPLES_PREPARED, DEADLETTER)}
        self.actor_state: TableState | None = None
        if prepare is None:
            partitions = settings.raw_partitions or raw_partitions_of(settings)
            self.actor_state = TableState(self.app.Table(
                "actor-state", partitions=partitions, help="per-actor reorder and dedup state (JSON)"))
            prepare = make_prepare(self.actor_state)
        self.send: SendFn = self._kafka_send
        hooks = (self.metrics.count_dead_letter, self.metrics.count_skipped) if self.metrics is not None else (None, None)
        self.core = ShellCore(prepare, DeadLetters(None, self.codec, hooks[0], on_skip=hooks[1]), STAGE,
                              self.codec, policy_records)
        self._policies_ready: asyncio.Event | None = None  # set by follow-policies once caught up
        self.acks = InOrderAcks(lambda event: (event.message.partition, event.message.offset))
        self._unwritten: list[Any] = []  # records done whose per-actor state is not written yet
        self._arrived_at: dict[int, float] = {}  # partition -> monotonic time of its last record
        self.partitions: set[int] = set()  # of rl.samples.raw, assigned to this worker
        self._wire()

    prepare = property(lambda self: self.core.prepare, lambda self, p: setattr(self.core, "prepare", p))
    published = property(lambda self: self.core.published)
    dead_lettered = property(lambda self: self.core.dead_lettered)
    skipped = property(lambda self: self.core.skipped)

    def _topic(self, name: str) -> Any:
        spec = TOPICS[name]
        return self.app.topic(
            self.settings.namespace.topic(name), key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw",
            partitions=spec.partitions if name == DEADLETTER else None,
            config={**self.settings.replication.topic_config(), **spec.config}, internal=True,
        )

    def _wire(self) -> None:
        app = self.app

        @app.task
        async def follow_policies():
            await self.follow_policies()

        @app.agent(self.topics[SAMPLES_RAW], name="prepare-samples")
        async def prepare_samples(stream):
            async for event in stream.noack().events():
                yield await self.on_sample_event(event)

        @app.timer(self.settings.tick_interval_s, name="reorder-tick")
        async def reorder_tick():
            await self.tick()

        @app.timer(self.settings.gap_check_s, name="gap-watch")
        async def gap_watch():
            await self.watch_gaps()

        @app.timer(self.settings.state_interval_s, name="state-file")
        async def state_file():
            self.write_state()

        @app.timer(self.settings.stats_interval_s, name="stats-log")
        async def stats_log():
            log.info("prepare stats %s", json.dumps(self.prepare.stats.as_dict(), sort_keys=True))

        @app.task
        async def declare_outputs():
            for name in (SAMPLES_PREPARED, DEADLETTER):
                try:
                    await self.topics[name].maybe_declare()
                except Exception as e:
                    log.warning("could not declare %s: %r", name, e)

        @app.on_partitions_revoked.connect
        async def on_revoked(sender, revoked, **kwargs):
            raw = self.settings.namespace.topic(SAMPLES_RAW)
            self.on_revoked({tp.partition for tp in revoked if tp.topic == raw})

        @app.on_partitions_assigned.connect
        async def on_assigned(sender, assigned, **kwargs):
            raw = self.settings.namespace.topic(SAMPLES_RAW)
            self.partitions = {tp.partition for tp in assigned if tp.topic == raw}
            await self.on_assigned(self.partitions)

        @app.on_before_shutdown.connect
        async def write_summary(sender, **kwargs):
            self.write_summary()

        @app.page("/metrics")
        async def metrics_page(web, request):
            if self.metrics is None:
                return web.bytes(b"# metrics disabled (runtime.metrics not importable)\n",
                                 content_type="text/plain")
            return web.bytes(self.metrics.render(), content_type="text/plain; version=0.0.4")

        @app.page("/healthz")
        async def healthz(web, request):
            return web.json({"ok": True, "partitions": sorted(self.partitions), "stats": self.prepare.stats.as_dict()})

        @app.page("/readyz")
        async def readyz(web, request):
            # ready once the policy reader has caught up: before that, samples are held
            ready = self._policies_ready is not None and self._policies_ready.is_set()
            body = {"ok": ready, "checks": {"policies_caught_up": ready,
                                            "latest_version": self.prepare.stats.latest_version}}
            return web.json(body, status=200 if ready else 503)

        self.policies_task = follow_policies
        self.samples_agent = prepare_samples
        self.reorder_tick = reorder_tick

    # -- the policy stream -----------------------------------------------------------------
    def _policy_consumer(self) -> Any:
        from aiokafka import AIOKafkaConsumer

        return AIOKafkaConsumer(
            bootstrap_servers=[u.split("://", 1)[-1] for u in broker_urls(self.settings.brokers)],
            group_id=None, enable_auto_commit=False, auto_offset_reset="earliest",
            isolation_level="read_committed",  # aiokafka's default is read_uncommitted: a fenced learner's write
            client_id=f"{self.settings.app_id}-policies", max_partition_fetch_bytes=MAX_MESSAGE_BYTES,
            fetch_max_bytes=4 * MAX_MESSAGE_BYTES, fetch_max_wait_ms=100,
            **({"metadata_max_age_ms": METADATA_MAX_AGE_MS} if self.settings.replication.replicated else {}),
            **aiokafka_security(self.settings.client_config),
        )

    def _plain_bus(self, purpose: str) -> Any:
        """A ``KafkaBus`` on this worker's brokers (not namespaced), for one-off reads."""
        from streams.bus.kafka import KafkaBus

        hosts = ",".join(u.split("://", 1)[-1] for u in broker_urls(self.settings.brokers))
        return KafkaBus(hosts, config=dict(self.settings.client_config), auto_create=False,
                        **self.settings.replication.bus_options(), client_id=f"{self.settings.app_id}-{purpose}")

    def policy_start_offsets(self, topic: str, backlog: int) -> dict[int, int]:
        """Partition -> offset of the ``backlog``-th newest record of this shell's policy (the
        policy layer's ``StartRule.back``), read with a plain Kafka client."""
        bus = self._plain_bus("policy-start")
        try:
            starts = start_offsets(EventBus(bus, self.codec), self.prepare.policy_id, StartRule.back(backlog - 1),
                                   topic=topic)
            return {p: offset for (_, p), offset in starts.items()}
        finally:
            bus.close()

    async def follow_policies(self, consumer: Any = None) -> None:
        """Read every PolicyVersion from ``max_versions + 1`` records of this policy back from the
        end of each partition (``policy_start_offsets``; an injected ``consumer``: that many
        records of any policy), for as long as the app runs (see the module docstring)."""
        from aiokafka import TopicPartition

        ready = self._policies_ready = asyncio.Event()
        own_reader = consumer is None
        consumer = consumer if consumer is not None else self._policy_consumer()
        backlog = policy_backlog(self.prepare, self.settings.policy_backlog)
        topic = self.settings.namespace.topic(POLICY_VERSIONS)
        await consumer.start()
        try:
            while topic not in await consumer.topics():
                log.warning("%s does not exist yet; waiting for it", topic)
                await asyncio.sleep(1.0)
            tps = [TopicPartition(topic, p) for p in range(TOPICS[POLICY_VERSIONS].partitions)]
            consumer.assign(tps)
            await consumer.end_offsets(tps)  # the topic's metadata is known from here on
            parts = consumer.partitions_for_topic(topic) or set()
            if {tp.partition for tp in tps} != set(parts) and parts:
                tps = [TopicPartition(topic, p) for p in sorted(parts)]
                consumer.assign(tps)
            ends = await consumer.end_offsets(tps)
            starts = await consumer.beginning_offsets(tps)
            offsets = policy_starts(ends, backlog, starts)
            if own_reader:
                mine = await asyncio.get_running_loop().run_in_executor(
                    None, self.policy_start_offsets, topic, backlog)
                offsets = {tp: max(starts.get(tp, 0), mine.get(tp.partition, off)) for tp, off in offsets.items()}
            pending = {}
            for tp, offset in offsets.items():
                consumer.seek(tp, offset)
                if ends[tp] > starts.get(tp, 0):
                    pending[tp.partition] = ends[tp]
            while True:
                if not pending:
                    ready.set()
                batches = await consumer.getmany(timeout_ms=200, max_records=256)
                for tp, msgs in batches.items():
                    for msg in msgs:
                        await self.on_policy_message(msg)
                for p in list(pending):  # the position, which passes transaction markers too
                    if await consumer.position(TopicPartition(topic, p)) >= pending[p]:
                        del pending[p]
        finally:
            ready.set()
            await consumer.stop()

    async def wait_for_policies(self) -> None:
        """Until the policy reader has caught up on start, at most ``policy_catchup_s`` (no-op
        when it does not run)."""
        ready = self._policies_ready
        if ready is None or ready.is_set():
            return
        try:
            await asyncio.wait_for(ready.wait(), self.settings.policy_catchup_s)
        except asyncio.TimeoutError:
            log.warning("policy reader did not catch up within %.0fs; processing samples anyway",
                        self.settings.policy_catchup_s)
            ready.set()

    async def on_policy_message(self, msg: Any) -> bool:
        """One record of rl.policy.versions (anything with topic, partition, offset, key, value,
        headers); True if it is now the newest version of our policy."""
        before = self.prepare.stats.latest_version
        await self._deliver(self.core.on_policy(as_record(msg, self.settings.namespace)))
        return self.prepare.stats.latest_version != before

    # -- the sample stream ------------------------------------------------------------------
    async def on_sample_event(self, event: Any) -> int:
        await self.wait_for_policies()
        msg = event.message
        self._arrived_at[msg.partition] = time.monotonic()
        verdict = self.acks.arrived(event)
        if verdict == SEEK:
            back = self.acks.next(msg.partition)
            log.warning("rl.samples.raw partition %d: the consumer skipped offsets %d..%d; seeking back to %d",
                        msg.partition, back, msg.offset - 1, back)
            await self._rewind(msg.tp, back)
        if verdict != TAKE:
            return 0
        return await self._deliver(self.core.on_sample(as_record(event.message, self.settings.namespace), event))

    async def watch_gaps(self) -> int:
        """Seek back every owned partition of rl.samples.raw whose records stopped arriving
        although its end (the consumer's highwater) is past the next offset expected: records
        the consumer dropped with nothing after them to show the gap. Returns how many.

        Not while the app rebalances or recovers its table: Faust pauses the raw partitions
        then (nothing arrives on purpose), and a rewind stops the consumer's flow, which drops
        the changelog records recovery is waiting for, so recovery would wait forever. The
        stall clock starts again once the app is settled."""
        from faust.types import TP

        topic, now, n = self.settings.namespace.topic(SAMPLES_RAW), time.monotonic(), 0
        if self.app.rebalancing or self.app.in_recovery:
            self._arrived_at.update(dict.fromkeys(self.partitions, now))
            return 0
        for p in sorted(self.partitions):
            nxt = self.acks.next(p)
            if nxt is None or now - self._arrived_at.get(p, now) < self.settings.gap_stall_s:
                continue
            tp = TP(topic, p)
            try:
                end = self.app.consumer.highwater(tp)
            except Exception:
                continue
            if end is not None and end > nxt:
                log.warning("rl.samples.raw partition %d: nothing arrived for %.0f s, yet its end is %d; "
                            "seeking back to %d", p, now - self._arrived_at[p], end, nxt)
                self._arrived_at[p] = now
                await self._rewind(tp, self.acks.rewind(p))
                n += 1
        return n

    async def _rewind(self, tp: Any, offset: int) -> None:
        """Seek ``tp`` back to ``offset`` with the consumer's flow stopped, so no batch fetched
        before the seek moves the read position past it again."""
        consumer = self.app.consumer
        consumer.stop_flow()
        try:
            await consumer.seek_wait({tp: offset})
        finally:
            consumer.resume_flow()

    async def tick(self) -> int:
        return await self._deliver(self.core.tick())

    async def on_assigned(self, partitions: set[int]) -> None:
        """Where each assigned partition of rl.samples.raw starts (``InOrderAcks.expect``): the
        group's committed offset, or the log start. Unknown (the broker did not answer): the
        first record that arrives is the start, as before."""
        try:
            starts = await asyncio.get_running_loop().run_in_executor(None, self.start_offsets, sorted(partitions))
        except Exception as e:
            log.warning("could not read where partitions %s start: %r", sorted(partitions), e)
            return
        for p, offset in starts.items():
            self.acks.expect(p, offset)
            self._arrived_at[p] = time.monotonic()
        log.info("rl.samples.raw partitions start at %s", json.dumps(starts, sort_keys=True))

    def start_offsets(self, partitions: list[int]) -> dict[int, int]:
        """Partition -> this group's committed offset of rl.samples.raw, or the log start where
        there is none (``KafkaBus.group_positions``, which retries retriable errors)."""
        bus = self._plain_bus("raw-start")
        try:
            starts = bus.group_positions(self.settings.app_id, self.settings.namespace.topic(SAMPLES_RAW))
        finally:
            bus.close()
        return {p: starts[p] for p in partitions}

    def on_revoked(self, partitions: set[int]) -> None:
        self.partitions -= partitions
        self.acks.forget(partitions)
        dropped = self.core.revoke(partitions)  # not acked: the new owner gets them again
        if dropped:
            log.info("rebalance: released %d buffered batches of partitions %s", dropped, sorted(partitions))

    # -- output -----------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        return {**self.core.summary(), "consumer_rewinds": self.acks.rewinds}

    def write_state(self) -> None:
        """``<run-dir>/<process>.state.json``: the worker's freshness counts so far (the decoupled
        supervisor's progress lines and ``timeline.json`` take each window's freshness from them);
        nothing when the run directory is not set."""
        if not self.settings.run_dir:
            return
        from runtime.progress import write_state
        from runtime.rundir import RunDir

        st = self.prepare.stats.as_dict()
        try:
            write_state(RunDir(self.settings.run_dir).state_file(self.settings.process_name),
                        {k: st[k] for k in ("fresh_samples", "checked_samples")})
        except OSError as e:
            log.warning("could not write the state file: %r", e)

    def write_summary(self) -> None:
        """One ``{"summary": ...}`` line on the real stdout (the worker redirects ``sys.stdout``),
        and ``<run-dir>/<process>.summary.json`` when the run directory is set (``streams``
        unless the supervisor named this worker otherwise: ``ENV_PROCESS``)."""
        from runtime import roles

        out = sys.__stdout__ or sys.stdout
        try:
            if self.settings.run_dir:
                roles.write_summary(self.settings.run_dir, self.settings.process_name, self.summary())
            out.write(json.dumps({"summary": self.summary()}, sort_keys=True, default=str) + "\n")
            out.flush()
        except Exception:
            log.exception("could not write the summary")

    async def _kafka_send(self, topic: str, key: bytes | None, value: bytes, headers: dict[str, bytes]) -> Any:
        fut = await self.topics[topic].send(key=key, value=value, headers=list(headers.items()))
        return await fut

    async def _deliver(self, sends: list[Send]) -> int:
        """Write ``sends`` in order (a failed one is replaced by what the core says), then the
        per-actor state they changed, then ack the records they finish, in offset order
        (``InOrderAcks``); returns how many. Records whose state could not be written wait,
        unacked, for the next call to write it."""
        queue, done = list(sends), self._unwritten
        self._unwritten = []
        while queue:
            s = queue.pop(0)
            if s.topic is not None:
                try:
                    await self.send(s.topic, s.key, s.value, dict(s.headers or {}))
                except Exception as e:
                    queue[:0] = self.core.failed(s, e)
                    continue
                self.core.sent(s)
            if s.done is not None:
                done.append(s.done)
        if self.actor_state is not None and self.actor_state.pending:
            try:
                await self.actor_state.flush()
            except Exception:
                log.exception("could not write the per-actor state (retried)")
                self._unwritten = done + self._unwritten
                return len(sends)
        for handle in done:
            for event in self.acks.done(handle):
                event.ack()
        return len(sends)
