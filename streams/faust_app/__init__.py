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
  decoded lazily, only for the version a batch needs; claim-checked ones are fetched from the
  Redis store ``REDIS_URL`` names (``streams.policies.open_blob_store``).
* agent ``prepare-samples`` on ``rl.samples.raw`` pushes each record through ``Prepare`` and
  sends PreparedBatch bytes to ``rl.samples.prepared`` (key actor_id) and DeadLetter bytes to
  ``rl.deadletter``, all encoded with ``schemas.codec``. Acks are manual: a record is acked
  once its output is delivered, so a batch held by the reorder buffer keeps the committed
  offset behind it (at least once; a crash redelivers it).
* timer ``reorder-tick`` releases batches whose reorder gap timed out.
* ``/metrics`` on the worker's web port (``RLSTREAM_METRICS_PORT``, default 9102) serves the
  processor metrics (``runtime.metrics.Metrics``, role ``streams``); ``/healthz`` the
  processor stats. On shutdown the stats are written to stdout as one ``{"summary": ...}`` line
  (``rlstream train --mode decoupled`` collects it).
* offsets of ``rl.samples.raw`` are committed every ``commit_interval_s`` (0.5 s), so the
  group's backlog there (``Bus.group_lag``), which actors' backpressure and the learner's
  circuit breaker watch, is current.

Exceptions while handling one record dead-letter it (``processor_error``); the agent goes on.
A bad record of rl.policy.versions is skipped and counted instead (``skipped``,
``rlstream_skipped_total``): the learner owns its dead letter (``streams.topics.DEAD_LETTER_OWNERS``).
Settings are ``streams.settings.StreamsSettings`` (from the run config ``RLSTREAM_CONFIG`` names,
or the environment), made once at the entry point; the app is assembled by
``rlstream.wiring.build_faust_app`` (processors, claim-check store, codec that resolves schemas
added after start, metrics). Importing this module builds nothing: ``faust -A streams worker``
reaches the app through ``streams.app``, which asks the composition root for it.

Several workers share ``rl.samples.raw`` by partition (the consumer group) and each follows
every PolicyVersion. Per-actor reorder/dedup state lives in the Faust table ``actor-state``
(``TableState``; its changelog has as many partitions as rl.samples.raw), so a rebalance moves
it with the partition; buffered batches are redelivered, uncommitted, to the new owner. The
record-level rules (decode, dead-letter, hold, emit) are ``streams.shell.ShellCore``'s.

On a replicated cluster the app follows the run's ``Replication`` setting
(``RLSTREAM_REPLICATION_FACTOR``, ``RLSTREAM_MIN_INSYNC_REPLICAS``; ``replication_settings``): its
changelogs and declared topics get that many copies and ``min.insync.replicas``, its producer
writes with ``acks=all``, and (factor above 1) its clients refresh metadata every ``METADATA_MAX_AGE_MS``.

Modules: ``streams_app`` (``StreamsApp``), ``clients`` (the Kafka clients' settings: replication,
broker URLs, security) and ``table`` (the per-actor state table).
"""

from streams.faust_app.clients import broker_urls, faust_credentials
from streams.faust_app.streams_app import StreamsApp
from streams.settings import StreamsSettings

__all__ = ["StreamsApp", "StreamsSettings", "broker_urls", "faust_credentials"]
