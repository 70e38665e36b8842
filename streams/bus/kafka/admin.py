"""What the Kafka bus asks of the cluster (``KafkaAdmin``): topics (create, grow, delete, reset,
wait for leaders, partition counts), the topics and consumer groups it holds, and offsets
(watermarks, end offsets, a group's committed positions and lag)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable
from typing import Any

from confluent_kafka import Consumer as _RdConsumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import NewTopic

from streams.bus.base import TP, BusError, ReplicationError
from streams.bus.kafka.clients import KafkaClients
from streams.bus.kafka.errors import (
    ATTEMPT_S,
    REQUEST_TIMEOUT,
    FewerPartitionsError,
    TopicNotFoundError,
    first_error,
    is_retriable,
    kafka_error,
    retrying,
)
from streams.topics import TOPICS, TopicSpec, namespaces_in

log = logging.getLogger("streams.bus.kafka")  # the whole Kafka bus logs under one name

#: How long topic creation asks again when the cluster lists fewer brokers than the replication
#: factor before refusing (``KafkaBus._check_replication``; CI once saw 2 of 3 just after start).
REGISTRATION_GRACE_S = 5.0


class KafkaAdmin(KafkaClients):
    """The cluster side of ``KafkaBus``: topics, metadata, consumer groups and offsets."""

    # -- topics -----------------------------------------------------------------------------
    def create_topics(self, specs: Iterable[TopicSpec], timeout: float = 30.0) -> None:
        specs = list(specs)
        if not specs:
            return
        new = []
        for s in specs:
            config = {k: str(v) for k, v in s.config.items()}
            if s.compacted:
                config.setdefault("cleanup.policy", "compact")
            if self.min_insync_replicas is not None:
                config.setdefault("min.insync.replicas", str(self.min_insync_replicas))
            new.append(NewTopic(s.name, num_partitions=max(1, s.partitions),
                                replication_factor=self.replication_factor, config=config))
        pending = {t.topic: t for t in new}
        if self.replication_factor > 1:
            self._check_replication([s.name for s in specs], timeout)

        def attempt(left: float) -> KafkaError | None:
            retry = None
            futures = self._admin.create_topics(list(pending.values()), request_timeout=left,
                                                operation_timeout=left)
            for name, fut in futures.items():
                try:
                    self._wait(fut, left + 5)
                except KafkaException as e:
                    err = kafka_error(e)
                    if is_retriable(err):
                        retry = err
                        continue
                    if err is None or err.code() != KafkaError.TOPIC_ALREADY_EXISTS:
                        self.check_auth()
                        raise BusError(f"cannot create topic {name}: {e}") from e
                del pending[name]
            return retry

        retrying(f"cannot create topics {sorted(pending)}", attempt, timeout, on_retry=self.check_auth)
        self._auth_ok()
        self._wait_topics({s.name: max(1, s.partitions) for s in specs}, timeout)

    def _check_replication(self, names: list[str], timeout: float) -> None:
        """Raise ``ReplicationError`` if a topic of ``names`` does not exist yet and the cluster
        has fewer brokers alive than ``replication_factor`` (topics that exist are left alone: a
        role restarting while one broker is down carries on). Too few brokers are asked about
        again for ``REGISTRATION_GRACE_S``: each broker learns of the others on its own time, so
        one asked just after ``rlstream broker start`` may not list them all yet."""
        grace = time.monotonic() + min(REGISTRATION_GRACE_S, timeout)
        while True:
            md = retrying("cannot read the cluster's metadata",
                          lambda left: self._admin.list_topics(timeout=max(left, 1.0)), timeout,
                          on_retry=self.check_auth)
            missing = [n for n in names if n not in md.topics or md.topics[n].error is not None]
            if not missing or len(md.brokers) >= self.replication_factor:
                return
            if time.monotonic() >= grace:
                raise ReplicationError(self.replication_factor, len(md.brokers), self.bootstrap, missing)
            time.sleep(0.25)

    def add_partitions(self, topic: str, total: int, timeout: float = 30.0) -> None:
        """Grow ``topic`` to ``total`` partitions (Kafka cannot shrink one). Keys hash to new
        partitions afterwards: run it between runs, when no actor is producing."""
        from confluent_kafka.admin import NewPartitions

        if self._partitions(topic, create=False) < total:
            for fut in self._admin.create_partitions([NewPartitions(topic, total)],
                                                     request_timeout=timeout).values():
                self._wait(fut, timeout + 5)
            self._known.pop(topic, None)
        self._wait_topics({topic: total}, timeout, growing=True)

    def delete_topics(self, names: Iterable[str], timeout: float = 30.0) -> None:
        """Delete topics (benchmarks and tests clean up after themselves); missing ones are fine."""
        names = list(names)
        if not names:
            return
        for name, fut in self._admin.delete_topics(names, operation_timeout=timeout,
                                                   request_timeout=timeout).items():
            try:
                fut.result()
            except KafkaException as e:
                err = kafka_error(e)
                if err is None or err.code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                    raise BusError(f"cannot delete topic {name}: {e}") from e
            self._known.pop(name, None)

    def reset_topics(self, specs: Iterable[TopicSpec], groups: Iterable[str] = (), timeout: float = 60.0) -> None:
        """Delete the topics of ``specs`` and the consumer ``groups`` (their committed offsets),
        wait until the broker has forgotten them, and create the topics afresh: a clean slate for
        a test or benchmark that uses the fixed ``streams.topics`` names on a shared broker.
        Destructive: whatever those topics held is gone. Groups with live members are left as
        they are (a warning is logged)."""
        specs = list(specs)
        names = [s.name for s in specs]
        self.delete_topics(names, timeout=timeout)
        deadline = time.monotonic() + timeout
        while True:  # deletion is asynchronous: a name is reusable once metadata no longer has it
            try:
                present = set(self._admin.list_topics(timeout=min(5.0, timeout)).topics)
            except KafkaException:
                present = set(names)
            left = present & set(names)
            if not left:
                break
            if time.monotonic() > deadline:
                raise BusError(f"topics {sorted(left)} still exist {timeout:.0f}s after deletion")
            time.sleep(0.1)
        groups = list(groups)
        if groups:
            for group, fut in self._admin.delete_consumer_groups(groups, request_timeout=timeout).items():
                try:
                    fut.result()
                except KafkaException as e:
                    err = kafka_error(e)
                    if err is None or err.code() not in (KafkaError.GROUP_ID_NOT_FOUND, KafkaError.NOT_COORDINATOR):
                        log.warning("consumer group %s not deleted: %s", group, e)
        while True:
            try:
                self.create_topics(specs, timeout=timeout)
                return
            except BusError as e:  # the controller may still be finishing the deletion
                if "TOPIC_ALREADY_EXISTS" not in str(e) and "marked for deletion" not in str(e) \
                        or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _wait_topics(self, want: dict[str, int], timeout: float, growing: bool = False) -> None:
        """Poll metadata until every topic has a leader for each of (at least) its partitions:
        ``create_topics`` returns only then, so the first produce or offset read finds them. An
        existing topic with fewer partitions raises ``FewerPartitionsError`` (``growing``: waits
        for the ones being added)."""
        deadline = time.monotonic() + timeout
        pending = dict(want)
        while True:
            for name in list(pending):
                try:
                    md = self._admin.list_topics(topic=name, timeout=min(5.0, timeout)).topics.get(name)
                except KafkaException:
                    md = None
                if md is not None and md.error is None and md.partitions and all(
                    p.leader >= 0 and p.error is None for p in md.partitions.values()
                ):
                    if len(md.partitions) < pending[name]:
                        if growing:
                            continue
                        raise FewerPartitionsError(name, len(md.partitions), pending[name])
                    self._known[name] = len(md.partitions)
                    del pending[name]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise BusError(f"topics {sorted(pending)} have no leader after {timeout:.0f}s")
            time.sleep(0.05)

    def _partitions(self, topic: str, create: bool | None = None) -> int:
        """Partition count of ``topic``; creates it (auto_create) when missing."""
        n = self._known.get(topic)
        if n is not None:
            return n
        try:
            md = retrying(f"cannot read metadata of {topic} from {self.bootstrap}",
                          lambda t: self._admin.list_topics(topic=topic, timeout=t).topics.get(topic),
                          on_retry=self.check_auth, attempt=ATTEMPT_S)
        except BusError:
            self.check_auth()
            raise
        if md is not None and md.error is None and md.partitions:
            self._known[topic] = len(md.partitions)
            return self._known[topic]
        if md is not None and md.error is not None and md.error.code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
            raise BusError(f"metadata of {topic}: {md.error}")
        if not (self.auto_create if create is None else create):
            raise BusError(f"unknown topic {topic!r}")
        spec = TOPICS.get(topic) or TopicSpec(topic, key="", partitions=1)
        self.create_topics([spec])
        return self._known[topic]

    def partitions(self, topic: str) -> int:
        return self._partitions(topic)

    # -- what the cluster holds (the tools: ``rlstream lag``, the namespace checks) --------------
    def topic_names(self, timeout: float = REQUEST_TIMEOUT) -> set[str]:
        """Every topic on the cluster."""
        md = retrying(f"cannot list the topics at {self.bootstrap}", lambda t: self._admin.list_topics(timeout=t),
                      timeout, on_retry=self.check_auth, attempt=ATTEMPT_S)
        return {name for name, t in md.topics.items() if t.error is None}

    def require_topics(self, names: Iterable[str], namespace: str = "") -> None:
        """Raise ``TopicNotFoundError`` (naming the namespaces the cluster has) unless every topic
        of ``names`` (full names, in ``namespace``) exists; creates nothing."""
        have = self.topic_names()
        missing = [n for n in names if n not in have]
        if missing:
            raise TopicNotFoundError(missing, self.bootstrap, namespace, namespaces_in(have))

    def _admin_call(self, what: str, request: Any, timeout: float = REQUEST_TIMEOUT) -> Any:
        """The result of the admin future ``request(seconds)`` returns, retried as ``retrying`` does.
        Admin group requests are for tools run while a broker answers (``group_positions``, which
        the roles use during outages, avoids them: confluentinc/librdkafka#4605)."""
        try:
            return retrying(what, lambda t: self._wait(request(t), t + 5), timeout, on_retry=self.check_auth,
                            attempt=ATTEMPT_S)
        except BusError:
            self.settle_auth()  # a refused login or TLS handshake is the reason, not the timeout
            raise

    def consumer_groups(self) -> dict[str, str]:
        """Group id -> state (``stable``, ``empty``...) of every consumer group on the cluster."""
        def request(t: float) -> Any:
            return self._admin.list_consumer_groups(request_timeout=t)

        res = self._admin_call(f"cannot list the consumer groups at {self.bootstrap}", request)
        if res.errors:
            self.settle_auth()  # a refused login or TLS handshake is the reason, not the timeout
            raise BusError(f"cannot list every consumer group at {self.bootstrap}: {res.errors[0]}")
        return {g.group_id: g.state.name.lower() for g in res.valid}

    def describe_group(self, group: str) -> tuple[str, dict[TP, dict[str, str]]]:
        """``(state, {(topic, partition): {consumer_id, host, client_id}})``: the partitions the
        group's members are assigned now, and who has each."""
        desc = self._admin_call(f"cannot describe consumer group {group}",
                                lambda t: self._admin.describe_consumer_groups([group], request_timeout=t)[group])
        owners: dict[TP, dict[str, str]] = {}
        for m in desc.members:
            for tp in (m.assignment.topic_partitions if m.assignment is not None else []):
                owners[(tp.topic, tp.partition)] = {"consumer_id": m.member_id, "host": m.host,
                                                    "client_id": m.client_id}
        return desc.state.name.lower(), owners

    def group_offsets(self, group: str) -> dict[TP, int]:
        """``(topic, partition) -> offset`` committed by ``group``, on every topic it committed on."""
        from confluent_kafka import ConsumerGroupTopicPartitions

        res = self._admin_call(
            f"cannot read committed offsets of group {group}",
            lambda t: self._admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)],
                                                              request_timeout=t)[group])
        return {(tp.topic, tp.partition): tp.offset for tp in res.topic_partitions or []
                if tp.error is None and tp.offset >= 0}

    def log_end(self, topic: str, partition: int) -> int:
        """The partition's high watermark: the offset the next record will get."""
        return self._watermarks(topic, partition)[1]

    def log_start(self, topic: str, partition: int) -> int:
        """The partition's low watermark: its oldest offset still held (retention moves it up)."""
        return self._watermarks(topic, partition)[0]

    def _watermarks(self, topic: str, partition: int) -> tuple[int, int]:
        if self._meta is None:
            self._reach()
            with self._lock:
                if self._meta is None:
                    self._meta = _RdConsumer({**self.consumer_config, "group.id": f"rlstream-meta-{uuid.uuid4().hex}"})
        tp = TopicPartition(topic, partition)

        def refresh() -> None:
            """Before asking again: fresh metadata. The request goes to the leader librdkafka has
            cached, which a timeout does not refresh; a SIGKILLed leader kept the learner's lag
            reading waiting 15 s after leadership had moved."""
            self.check_auth()
            try:
                self._meta.list_topics(topic=topic, timeout=ATTEMPT_S)
            except KafkaException:
                pass  # the next attempt retries, or fails with the reason

        try:
            return retrying(f"cannot read offsets of {topic}[{partition}]",
                            lambda t: self._meta.get_watermark_offsets(tp, timeout=t, cached=False),
                            on_retry=refresh, attempt=ATTEMPT_S)
        except BusError:
            self.check_auth()
            raise

    def end_offsets(self, topic: str) -> dict[int, int]:
        return {p: self._watermarks(topic, p)[1] for p in range(self._partitions(topic))}

    def group_lag(self, group: str, topic: str) -> int:
        """End offsets minus the group's positions (``group_positions``)."""
        ends = self.end_offsets(topic)
        return sum(ends[p] - pos for p, pos in self.group_positions(group, topic).items())

    def group_positions(self, group: str, topic: str) -> dict[int, int]:
        """Partition -> where ``group`` resumes reading ``topic``: its committed offset, or the
        log start where it has none.

        The committed offsets come from a consumer of that ``group.id`` that never subscribes
        (an OffsetFetch; it does not join the group), not from the admin API: admin group
        requests that time out while the broker is down abort the process in librdkafka
        (confluentinc/librdkafka#4605), and the lag is read while the broker may be down."""
        parts = range(self._partitions(topic))
        self._reach()
        with self._lock:
            reader = self._group_readers.get(group)
            if reader is None:
                reader = self._group_readers[group] = _RdConsumer(
                    {**self.consumer_config, "group.id": group, "error_cb": self._on_client_error})
        res = retrying(f"cannot read committed offsets of group {group} on {topic}",
                       lambda t: first_error(reader.committed([TopicPartition(topic, p) for p in parts], timeout=t)),
                       attempt=ATTEMPT_S)
        committed = {tp.partition: tp.offset for tp in res if tp.error is None}
        return {p: committed[p] if committed.get(p, -1) >= 0 else self._watermarks(topic, p)[0] for p in parts}
