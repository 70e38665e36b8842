"""The one place that names the topics, their keys and their settings."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace


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

#: Consumer group of the stream processors on rl.samples.raw (the Faust app id): its backlog
#: there (``Bus.group_lag(STREAMS_GROUP, SAMPLES_RAW)``) is what actors' backpressure, the dynamic
#: fragment length and the learner's circuit breaker watch.
STREAMS_GROUP = "rlstream-streams"
#: Consumer group of the learner on rl.samples.prepared.
LEARNER_GROUP = "learner"

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


# --- run namespaces ---------------------------------------------------------------------------

_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_-]{1,100}")


@dataclass(frozen=True)
class Namespace:
    """A run namespace: scopes every topic and consumer group of one run, so runs can share a
    cluster. ``Namespace("exp1").topic(SAMPLES_RAW) == "exp1.rl.samples.raw"``, groups likewise
    (``exp1.learner``). The empty namespace is the legacy, unscoped layout (``rl.samples.raw``,
    group ``learner``): topics written before namespaces existed stay readable with it.
    Roles name topics by their logical names; ``streams.bus.namespaced`` maps them."""

    name: str = ""

    def __post_init__(self) -> None:
        if self.name and not _NAMESPACE_RE.fullmatch(self.name):
            raise ValueError(f"namespace {self.name!r}: use 1-100 of A-Z a-z 0-9 _ - (no dots)")

    def topic(self, logical: str) -> str:
        return f"{self.name}.{logical}" if self.name else logical

    group = topic  # groups are scoped the same way

    def logical(self, scoped: str) -> str:
        """The logical name of a scoped topic (or group) name."""
        prefix = f"{self.name}."
        return scoped[len(prefix):] if self.name and scoped.startswith(prefix) else scoped

    def topics(self, partitions: int | None = None) -> list[TopicSpec]:
        """``all_topics(partitions)`` under their scoped names."""
        return [replace(t, name=self.topic(t.name)) for t in all_topics(partitions)]

    def groups(self) -> list[str]:
        """The scoped consumer groups of the roles."""
        return [self.group(g) for g in (STREAMS_GROUP, LEARNER_GROUP)]

    @classmethod
    def derive(cls, value: str) -> "Namespace":
        """A valid namespace from free text (a run id): other characters become ``-``."""
        return cls(re.sub(r"[^A-Za-z0-9_-]", "-", value)[:100])


LEGACY = Namespace("")
