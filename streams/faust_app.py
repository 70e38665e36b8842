"""Faust shell of the prepare pipeline: ``faust -A streams worker -l info``.

The same ``Prepare`` (reorder -> staleness -> importance) as the in-process ``PrepareWorker``,
driven by Faust over Kafka:

* task ``follow-policies`` reads ``rl.policy.versions`` with a group-less aiokafka consumer
  (every worker sees every version: the staleness window and the IS weights need the newest
  one everywhere) starting ``max_versions + 1`` records back from the end of each partition
  (what the staleness window needs; a start does not replay the whole history), and feeds
  ``prepare.on_policy`` -- only versions of ``prepare.policy_id`` count. Until it has read up
  to the end offsets it found on start (at most ``policy_catchup_s``), ``prepare-samples``
  waits, so no batch is judged against a policy older than the newest published. Weights are
  decoded lazily, only for the version a batch needs.
* agent ``prepare-samples`` on ``rl.samples.raw`` pushes each record through ``Prepare`` and
  sends PreparedBatch bytes to ``rl.samples.prepared`` (key actor_id) and DeadLetter bytes to
  ``rl.deadletter``, all encoded with ``schemas.codec``. Acks are manual: a record is acked
  once its output is delivered, so a batch held by the reorder buffer keeps the committed
  offset behind it (at least once; a crash redelivers it).
* timer ``reorder-tick`` releases batches whose reorder gap timed out.
* ``/metrics`` on the worker's web port (``RLSTREAM_METRICS_PORT``, default 9102) serves the
  processor metrics (``rlstream.obs.metrics.Metrics``, role ``streams``); ``/healthz`` the
  processor stats. On shutdown the stats are written to stdout as one ``{"summary": ...}`` line
  (``rlstream train --mode decoupled`` collects it).
* offsets of ``rl.samples.raw`` are committed every ``commit_interval_s`` (0.5 s), so the
  group's backlog there (``Bus.group_lag``), which actors' backpressure and the learner's
  circuit breaker watch, is current.

Exceptions while handling one record dead-letter it (``processor_error``); the agent goes on.
A bad record of rl.policy.versions is skipped and counted instead (``skipped``,
``rlstream_skipped_total``): the learner owns its dead letter (``streams.topics.DEAD_LETTER_OWNERS``).
Settings come from the environment once, here (``StreamsSettings.from_env``): ``KAFKA_BROKERS``
(comma separated host:port), the Kafka security settings the bus reads
(``streams.bus.kafka.kafka_client_config``), mapped to Faust credentials and aiokafka
arguments, and the pipeline settings (``prepare_config_from_env``: ``RLSTREAM_ALGO``,
``RLSTREAM_STALENESS_*``, ``RLSTREAM_POLICY_ID``) and the run namespace (``RLSTREAM_NAMESPACE``:
its topics, and its ``STREAMS_GROUP`` as the app id; unset: the legacy unscoped names). With
``RLSTREAM_CONFIG`` (set by ``rlstream train --mode decoupled``) they all come from that run
config file instead (``StreamsSettings.from_run_config``).

Several workers share ``rl.samples.raw`` by partition (the consumer group) and each follows
every PolicyVersion. Limit: per-actor reorder state lives in the worker that owns the actor's
partition; a rebalance moves it (held batches are redelivered, uncommitted, to the new owner).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import ssl
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faust

from schemas.codec import Codec
from schemas.errors import CodecError
from schemas.events import DeadLetter, PolicyVersion, PreparedBatch, SampleBatch, now_ms
from streams.events import MAX_DEADLETTER_PAYLOAD
from streams.processors.importance import PolicyLogpFn
from streams.processors.pipeline import REASON_PROCESSOR_ERROR, Output, Prepare, PrepareConfig
from streams.runconfig import read_run_config, write_run_config
from streams.topics import (
    DEADLETTER,
    LEGACY,
    POLICY_VERSIONS,
    SAMPLES_PREPARED,
    SAMPLES_RAW,
    STREAMS_GROUP,
    TOPICS,
    Namespace,
    dead_letters_here,
)

log = logging.getLogger(__name__)

STAGE = "streams.faust"
APP_ID = STREAMS_GROUP
ENV_KAFKA_BROKERS = "KAFKA_BROKERS"
ENV_NAMESPACE = "RLSTREAM_NAMESPACE"
ENV_CONFIG = "RLSTREAM_CONFIG"
#: The file in the run directory where a worker started from a run config records its settings.
EFFECTIVE_CONFIG_FILE = "streams.config.json"
DEFAULT_BROKERS = "127.0.0.1:9092"
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

#: ``send(topic, key, value, headers)`` -> awaitable that completes when the record is durable.
SendFn = Callable[[str, bytes | None, bytes, dict[str, bytes]], Awaitable[Any]]


# --- settings -------------------------------------------------------------------------------

@dataclass(frozen=True)
class StreamsSettings:
    """Settings of the Faust streams worker (parsed once, from the environment)."""

    brokers: str = DEFAULT_BROKERS
    """Kafka bootstrap servers, comma separated host:port."""
    app_id: str = APP_ID
    """Faust app id (= consumer group): the namespace's ``STREAMS_GROUP``."""
    namespace: Namespace = LEGACY
    """Run namespace of the topics read and written (``RLSTREAM_NAMESPACE``)."""
    topic_partitions: int = 1
    """Partitions of topics Faust creates when they do not exist."""
    web_port: int = 9102
    """Port of the worker's web server (``/metrics``); ``faust worker --web-port`` overrides."""
    tick_interval_s: float = 0.1
    """How often reorder timeouts are checked."""
    stats_interval_s: float = 30.0
    """How often the processor stats are logged."""
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    """The pipeline settings."""
    client_config: Mapping[str, str] = field(default_factory=dict)
    """librdkafka-style security settings (security.protocol, sasl.*, ssl.*)."""
    torch_threads: int = 1
    """Intra-op threads for the IS forward pass (small MLPs are fastest on one; 0: torch's default)."""
    commit_interval_s: float = 0.5
    """How often acked offsets of rl.samples.raw are committed (the backlog others watch)."""
    policy_backlog: int | None = None
    """PolicyVersion records read back from the end of each partition on start (None: the
    staleness window's K + 1)."""
    policy_catchup_s: float = 30.0
    """Most seconds sample processing waits on start for the policy reader to catch up."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "StreamsSettings":
        """From the run config file named by ``RLSTREAM_CONFIG`` if set (``from_run_config``), else
        from ``KAFKA_BROKERS``, ``RLSTREAM_NAMESPACE`` and ``prepare_config_from_env``."""
        env = os.environ if env is None else env
        try:
            from rlstream.obs.ports import metrics_port

            port = metrics_port("streams", env)
        except ImportError:
            port = 9102
        if env.get(ENV_CONFIG, "").strip():
            return cls.from_run_config(env[ENV_CONFIG].strip(), web_port=port)
        brokers = env.get(ENV_KAFKA_BROKERS, "").strip() or DEFAULT_BROKERS
        ns = Namespace(env.get(ENV_NAMESPACE, "").strip())
        return cls(brokers=brokers, app_id=ns.group(APP_ID), namespace=ns, web_port=port,
                   client_config=_bus_client_config(), prepare=prepare_config_from_env(env))

    @classmethod
    def from_run_config(cls, path: str, web_port: int = 9102) -> "StreamsSettings":
        """The settings of a run config file (``streams.runconfig``): its bus, stream-processor
        settings and torch threads. Records them in ``<run_dir>/streams.config.json``."""
        cfg = read_run_config(path)
        bus = cfg["bus"]
        ns = Namespace(bus["namespace"])
        prepare = (PrepareConfig(**cfg["streams"]) if cfg["streams"] is not None
                   else PrepareConfig.for_algo(cfg["algo"], policy_id=cfg["policy_id"]))
        settings = cls(brokers=bus["bootstrap"], app_id=ns.group(APP_ID), namespace=ns, web_port=web_port,
                       topic_partitions=bus["partitions"], client_config=_bus_client_config(), prepare=prepare,
                       torch_threads=cfg["torch_threads"] or 1)
        effective = {k: v for k, v in dataclasses.asdict(settings).items() if k != "client_config"}  # secrets
        write_run_config(json.loads(json.dumps(effective, default=str)), Path(cfg["run_dir"]) / EFFECTIVE_CONFIG_FILE)
        return settings


def prepare_config_from_env(env: Mapping[str, str]) -> PrepareConfig:
    """``RLSTREAM_ALGO`` picks the algorithm's defaults; ``RLSTREAM_STALENESS_K`` / ``_MS`` /
    ``_MODE`` override the window and ``RLSTREAM_POLICY_ID`` the policy followed (default
    ``policy``; ``rlstream train --mode decoupled`` sets them all)."""
    overrides: dict[str, Any] = {}
    try:
        if env.get("RLSTREAM_STALENESS_K", "").strip():
            overrides["max_versions"] = int(env["RLSTREAM_STALENESS_K"])
        if env.get("RLSTREAM_STALENESS_MS", "").strip():
            ms = env["RLSTREAM_STALENESS_MS"].strip()
            overrides["max_ms"] = None if ms.lower() in ("none", "-1") else int(ms)
    except ValueError as e:
        raise ValueError(f"bad staleness setting in the environment: {e}") from e
    mode = env.get("RLSTREAM_STALENESS_MODE", "").strip()
    if mode:
        if mode not in ("drop", "downweight"):
            raise ValueError(f"RLSTREAM_STALENESS_MODE must be drop or downweight, not {mode!r}")
        overrides["staleness_mode"] = mode
    policy_id = env.get("RLSTREAM_POLICY_ID", "").strip()
    if policy_id:
        overrides["policy_id"] = policy_id
    return PrepareConfig.for_algo(env.get("RLSTREAM_ALGO", "ppo").strip() or "ppo", **overrides)


def _bus_client_config() -> dict[str, str]:
    """The Kafka bus's security settings (``streams.bus.kafka.kafka_client_config``: the
    ``RLSTREAM_KAFKA_*`` variables of the process environment), if the bus module is there."""
    try:
        from streams.bus.kafka import kafka_client_config
    except ImportError:
        return {}
    try:
        conf = dict(kafka_client_config())
    except Exception as e:  # a bad security setting must be loud, not silently plaintext
        raise RuntimeError(f"cannot read the Kafka client settings: {e}") from e
    return {k: str(v) for k, v in conf.items() if k == "security.protocol" or k.startswith(("sasl.", "ssl."))}


def broker_urls(brokers: str) -> list[str]:
    hosts = [h.strip() for h in brokers.split(",") if h.strip()]
    if not hosts:
        raise ValueError("no Kafka brokers given")
    return [h if "://" in h else f"kafka://{h}" for h in hosts]


def faust_credentials(conf: Mapping[str, str]) -> Any:
    """librdkafka security settings -> Faust broker_credentials (None for plaintext)."""
    protocol = conf.get("security.protocol", "PLAINTEXT").upper()
    if protocol == "PLAINTEXT":
        return None
    ctx = None
    if protocol in ("SSL", "SASL_SSL"):
        ctx = ssl.create_default_context(cafile=conf.get("ssl.ca.location") or None)
        if conf.get("ssl.certificate.location"):
            ctx.load_cert_chain(conf["ssl.certificate.location"], conf.get("ssl.key.location") or None,
                                conf.get("ssl.key.password") or None)
        if conf.get("ssl.endpoint.identification.algorithm", "https").lower() == "none":
            ctx.check_hostname = False
    if protocol == "SSL":
        return faust.SSLCredentials(ctx)
    if protocol in ("SASL_PLAINTEXT", "SASL_SSL"):
        mech = conf.get("sasl.mechanism", conf.get("sasl.mechanisms", "PLAIN")).upper()
        return faust.SASLCredentials(username=conf.get("sasl.username"), password=conf.get("sasl.password"),
                                     ssl_context=ctx, mechanism=mech)
    raise ValueError(f"unsupported security.protocol {protocol!r}")


def aiokafka_security(conf: Mapping[str, str]) -> dict[str, Any]:
    """librdkafka security settings -> aiokafka client arguments (the policy reader's)."""
    creds = faust_credentials(conf)
    if creds is None:
        return {}
    if isinstance(creds, faust.SSLCredentials):
        return {"security_protocol": "SSL", "ssl_context": creds.context}
    protocol = conf.get("security.protocol", "").upper()
    return {"security_protocol": protocol, "ssl_context": creds.ssl_context,
            "sasl_mechanism": creds.mechanism.value if hasattr(creds.mechanism, "value") else str(creds.mechanism),
            "sasl_plain_username": creds.username, "sasl_plain_password": creds.password}


# --- the app --------------------------------------------------------------------------------

def _headers(h: Any) -> dict[str, bytes]:
    if not h:
        return {}
    items = h.items() if isinstance(h, Mapping) else h
    out = {}
    for k, v in items:
        k = k.decode() if isinstance(k, bytes) else str(k)
        out[k] = v if isinstance(v, bytes) else str(v).encode()
    return out


class StreamsApp:
    """The Faust app with its agents around one ``Prepare``. ``app`` is what Faust runs."""

    def __init__(self, settings: StreamsSettings, prepare: Prepare | None = None, metrics: Any = None,
                 codec: Codec | None = None) -> None:
        self.settings = settings
        if settings.torch_threads > 0:
            import torch

            torch.set_num_threads(settings.torch_threads)
        self.codec = codec or Codec()
        self.metrics = metrics if metrics is not None else _make_metrics()
        self.prepare = prepare or Prepare.from_config(
            settings.prepare, PolicyLogpFn.from_policy_version, metrics=self.metrics)
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
        )
        self.topics = {name: self._topic(name) for name in (SAMPLES_RAW, SAMPLES_PREPARED, DEADLETTER)}
        self.send: SendFn = self._kafka_send
        self._held: dict[tuple[int, int], Any] = {}  # (partition, offset) -> faust event not acked yet
        self._policy_msgs: dict[int, Any] = {}  # newest versions' records, to dead-letter a bad one
        self._policies_ready: asyncio.Event | None = None  # set by follow-policies once caught up
        self.published = 0
        self.dead_lettered = 0
        self.skipped = 0  # bad records of a topic whose dead letters another role owns
        self._wire()

    def _topic(self, name: str) -> Any:
        spec = TOPICS[name]
        return self.app.topic(
            self.settings.namespace.topic(name), key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw",
            partitions=spec.partitions if name == DEADLETTER else None,
            config={k: v for k, v in spec.config.items()}, internal=True,
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

        @app.on_before_shutdown.connect
        async def write_summary(sender, **kwargs):
            self.write_summary()

        @app.page("/metrics")
        async def metrics_page(web, request):
            if self.metrics is None:
                return web.bytes(b"# metrics disabled (rlstream.obs.metrics not importable)\n",
                                 content_type="text/plain")
            return web.bytes(self.metrics.render(), content_type="text/plain; version=0.0.4")

        @app.page("/healthz")
        async def healthz(web, request):
            return web.json({"ok": True, "stats": self.prepare.stats.as_dict()})

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

    # -- handlers (each catches per-record errors) ------------------------------------------
    def _decode(self, value: Any, expect: type) -> Any:
        return self.codec.decode_valid(value, expect)

    # -- the policy stream -----------------------------------------------------------------
    def _policy_consumer(self) -> Any:
        from aiokafka import AIOKafkaConsumer

        return AIOKafkaConsumer(
            bootstrap_servers=[u.split("://", 1)[-1] for u in broker_urls(self.settings.brokers)],
            group_id=None, enable_auto_commit=False, auto_offset_reset="earliest",
            client_id=f"{self.settings.app_id}-policies", max_partition_fetch_bytes=MAX_MESSAGE_BYTES,
            fetch_max_bytes=4 * MAX_MESSAGE_BYTES, fetch_max_wait_ms=100,
            **aiokafka_security(self.settings.client_config),
        )

    async def follow_policies(self, consumer: Any = None) -> None:
        """Read every PolicyVersion from ``max_versions + 1`` back from the end of each partition,
        for as long as the app runs (see the module docstring)."""
        from aiokafka import TopicPartition

        ready = self._policies_ready = asyncio.Event()
        consumer = consumer if consumer is not None else self._policy_consumer()
        backlog = self.settings.policy_backlog
        if backlog is None:
            backlog = self.prepare.staleness.max_versions + 1
        backlog = max(1, min(int(backlog), 1 << 20))
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
            pending = {}
            for tp in tps:
                consumer.seek(tp, max(starts.get(tp, 0), ends[tp] - backlog))
                if ends[tp] > starts.get(tp, 0):
                    pending[tp.partition] = ends[tp]
            while True:
                if not pending:
                    ready.set()
                batches = await consumer.getmany(timeout_ms=200, max_records=256)
                for tp, msgs in batches.items():
                    for msg in msgs:
                        await self.on_policy_message(msg)
                        if tp.partition in pending and msg.offset + 1 >= pending[tp.partition]:
                            del pending[tp.partition]
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
        headers); True if it is the newest version of our policy."""
        try:
            pv = self._decode(msg.value, PolicyVersion)
            newest = self.prepare.on_policy(pv)
            if newest:
                self._policy_msgs[pv.version] = msg
                while len(self._policy_msgs) > 16:
                    self._policy_msgs.pop(next(iter(self._policy_msgs)))
            return newest
        except Exception as e:
            self.prepare.stats.policy_errors += 1
            reason = e.reason if isinstance(e, CodecError) else REASON_PROCESSOR_ERROR
            await self._dead_letter(msg, reason, e)
            return False

    # -- the sample stream ------------------------------------------------------------------
    async def on_sample_event(self, event: Any) -> int:
        await self.wait_for_policies()
        msg = event.message
        key = (msg.partition, msg.offset)
        try:
            batch = self._decode(event.value, SampleBatch)
        except CodecError as e:
            self.prepare.reject_record(e.reason, e, msg.partition, msg.offset)
            await self._dead_letter(msg, e.reason, e)
            event.ack()
            return 1
        except Exception as e:
            self.prepare.reject_record(REASON_PROCESSOR_ERROR, e, msg.partition, msg.offset)
            await self._dead_letter(msg, REASON_PROCESSOR_ERROR, e)
            event.ack()
            return 1
        self._held[key] = event
        try:
            outs = self.prepare.push(batch, msg.partition, msg.offset)
        except Exception as e:
            self._held.pop(key, None)
            self.prepare.reject_record(REASON_PROCESSOR_ERROR, e, msg.partition, msg.offset)
            await self._dead_letter(msg, REASON_PROCESSOR_ERROR, e)
            event.ack()
            return 1
        await self._emit(outs)
        return len(outs)

    async def tick(self) -> int:
        try:
            outs = self.prepare.tick()
        except Exception:
            log.exception("reorder tick failed")
            return 0
        await self._emit(outs)
        return len(outs)

    def on_revoked(self, partitions: set[int]) -> None:
        if not partitions:
            return
        dropped = self.prepare.revoke(partitions)
        for k in [k for k in self._held if k[0] in partitions]:
            self._held.pop(k)  # not acked: the new owner gets them again
        if dropped:
            log.info("rebalance: released %d buffered batches of partitions %s", dropped, sorted(partitions))

    # -- output -----------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        return {"role": "streams", "policy_id": self.prepare.policy_id, "published": self.published,
                "dead_lettered": self.dead_lettered, "skipped": self.skipped, **self.prepare.stats.as_dict()}

    def write_summary(self) -> None:
        """One ``{"summary": ...}`` line on the real stdout (the worker redirects ``sys.stdout``)."""
        out = sys.__stdout__ or sys.stdout
        try:
            out.write(json.dumps({"summary": self.summary()}, sort_keys=True, default=str) + "\n")
            out.flush()
        except Exception:
            log.exception("could not write the summary")

    async def _kafka_send(self, topic: str, key: bytes | None, value: bytes, headers: dict[str, bytes]) -> Any:
        fut = await self.topics[topic].send(key=key, value=value, headers=list(headers.items()))
        return await fut

    async def _emit(self, outs: list[Output]) -> None:
        for version, error in self.prepare.take_policy_failures():
            bad = self._policy_msgs.pop(version, None)
            if bad is not None:  # its weights do not build a policy: IS goes on with the last good one
                await self._dead_letter(bad, getattr(error, "reason", "policy_unusable"), error)
        for out in outs:
            if isinstance(out, PreparedBatch):
                event = self._held.pop((out.source_partition, out.source_offset), None)
                try:
                    await self.send(SAMPLES_PREPARED, out.sample.actor_id.encode(), self.codec.encode(out),
                                    self.codec.headers_for(out))
                    self.published += 1
                except Exception as e:
                    if event is None:
                        log.exception("could not publish a prepared batch")
                        continue
                    self.prepare.reject_record(REASON_PROCESSOR_ERROR, e, out.source_partition, out.source_offset)
                    await self._dead_letter(event.message, REASON_PROCESSOR_ERROR, e)
            else:
                event = self._held.pop((out.partition, out.offset), None)
                if out.dead_letter and event is not None:
                    await self._dead_letter(event.message, out.reason, out.error or out.reason, out.detail)
            if event is not None:
                event.ack()

    async def _dead_letter(self, msg: Any, reason: str, error: BaseException | str, detail: str = "") -> None:
        if not dead_letters_here(str(msg.topic), STAGE):  # the learner dead-letters policy records
            self.skipped += 1
            if self.metrics is not None:
                self.metrics.count_skipped(str(msg.topic), reason)
            return
        value = msg.value if isinstance(msg.value, (bytes, bytearray)) else repr(msg.value).encode()
        if len(value) > MAX_DEADLETTER_PAYLOAD:
            detail = f"{detail} (payload of {len(value)} bytes cut to {MAX_DEADLETTER_PAYLOAD})".strip()
            value = value[:MAX_DEADLETTER_PAYLOAD]
        if isinstance(error, BaseException):
            err_class = type(error).__name__
            detail = detail or f"{err_class}: {error}"[:2000]
        else:
            err_class = str(error)
        key = msg.key if isinstance(msg.key, (bytes, type(None))) else str(msg.key).encode()
        dl = DeadLetter(
            topic=str(msg.topic), partition=int(msg.partition), offset=int(msg.offset), value=bytes(value),
            reason=reason, error_class=err_class, stage=STAGE, occurred_at_ms=now_ms(), key=key,
            headers=_headers(msg.headers), detail=detail,
        )
        try:
            await self.send(DEADLETTER, key, self.codec.encode(dl), self.codec.headers_for(dl))
            self.dead_lettered += 1
        except Exception:
            log.exception("could not dead-letter %s[%s]@%s (%s)", msg.topic, msg.partition, msg.offset, reason)
            return
        if self.metrics is not None:
            try:
                self.metrics.count_dead_letter(str(msg.topic), reason)
            except Exception:
                pass


def _make_metrics() -> Any:
    """The role's Prometheus metrics, if ``rlstream.obs.metrics`` is available (else None)."""
    try:
        from rlstream.obs.metrics import Metrics
    except ImportError:
        return None
    return Metrics(role="streams", gpu=False)


def build_app(settings: StreamsSettings | None = None, **kwargs: Any) -> StreamsApp:
    return StreamsApp(settings or StreamsSettings.from_env(), **kwargs)


streams_app = build_app()
app = streams_app.app

__all__ = ["StreamsApp", "StreamsSettings", "app", "broker_urls", "build_app", "faust_credentials",
           "streams_app"]
