"""The one place that names the topics, their keys and their settings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TopicSpec:
    name: str
    key: str  # what the record key is, for humans and for partitioning
    partitions: int = 1
    compacted: bool = False
    config: dict[str, str] = field(default_factory=dict)


POLICY_VERSIONS = "rl.policy.versions"
SAMPLES_RAW = "rl.samples.raw"
SAMPLES_PREPARED = "rl.samples.prepared"
LEARNER_STEPS = "rl.learner.steps"
PREFERENCES = "rl.preferences"
DEADLETTER = "rl.deadletter"
SCHEMAS = "rl.schemas"

# Header of a PolicyVersion record: time.time_ns() when it was published; followers measure
# policy latency (publish -> adoption) from it.
PUBLISHED_NS_HEADER = "rl-published-ns"

#: Who dead-letters a bad record of a topic that every reader reads in full (no consumer group):
#: the owner's stage, alone, so one bad record makes one dead letter. Other readers skip the
#: record and count it (``rlstream_skipped_total{topic,reason}``). rl.policy.versions belongs to
#: the learner: one per run in both modes (Faust workers and actors scale out), and the writer.
DEAD_LETTER_OWNERS: dict[str, str] = {POLICY_VERSIONS: "learner"}


def dead_letters_here(topic: str, stage: str) -> bool:
    """Does a reader of ``topic`` at ``stage`` dead-letter its bad records (else: skip and count)?
    A topic name with a prefix (``<namespace>.rl.policy.versions``) has its base name's owner."""
    owner = next((o for t, o in DEAD_LETTER_OWNERS.items() if topic == t or topic.endswith("." + t)), None)
    return owner is None or owner == stage


#: Consumer group of the stream processors on rl.samples.raw (the Faust app id): its backlog
#: there (``Bus.group_lag(STREAMS_GROUP, SAMPLES_RAW)``) is what actors' backpressure, the dynamic
#: fragment length and the learner's circuit breaker watch.
STREAMS_GROUP = "rlstream-streams"

# Retention -1: topics are the training record and must stay replayable (offline DPO, audits).
_KEEP = {"retention.ms": "-1", "max.message.bytes": "16777216"}

TOPICS: dict[str, TopicSpec] = {
    t.name: t
    for t in (
        TopicSpec(POLICY_VERSIONS, key="policy_id", config=_KEEP),
        TopicSpec(SAMPLES_RAW, key="actor_id", config=_KEEP),
        TopicSpec(SAMPLES_PREPARED, key="actor_id", config=_KEEP),
        TopicSpec(LEARNER_STEPS, key="learner_id", config=_KEEP),
        TopicSpec(PREFERENCES, key="env_id", config=_KEEP),
        TopicSpec(DEADLETTER, key="original key", config=_KEEP),
        TopicSpec(SCHEMAS, key="schema fingerprint", compacted=True,
                  config={"cleanup.policy": "compact", "max.message.bytes": "1048576"}),
    )
}


def all_topics(partitions: int | None = None) -> list[TopicSpec]:
    """Every topic; ``partitions`` overrides the count of the keyed data topics."""
    if partitions is None:
        return list(TOPICS.values())
    return [
        TopicSpec(t.name, t.key, partitions if t.name in (SAMPLES_RAW, SAMPLES_PREPARED) else t.partitions,
                  t.compacted, t.config)
        for t in TOPICS.values()
    ]
