"""The one place that names the topics, their keys and their settings."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from config.bus import DAY_MS, DEFAULT_LEARNER_GROUP, Retention
from config.limits import MAX_MESSAGE_BYTES


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
#: Actor registrations (``actor.identity``): one partition, so offsets number the generations.
ACTORS = "rl.actors"

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
#: Default consumer group of the learner on rl.samples.prepared; a run may name another
#: (``BusConfig.learner_group``: ``--learner-group``, ``RLSTREAM_LEARNER_GROUP``).
LEARNER_GROUP = DEFAULT_LEARNER_GROUP

#: Retention by topic when this process creates it (``retention.ms``; -1 keeps forever).
#: Policy versions, gradient steps, preferences and dead letters are the run's record (replay,
#: rollback, offline DPO, audits): kept. Samples are bulk and re-derivable: 30 days, as the
#: deployment guide keeps training logs. Overrides: ``RLSTREAM_RETENTION`` (``config.bus.parse_retention``).
RETENTION_MS: dict[str, int] = {
    POLICY_VERSIONS: -1,
    SAMPLES_RAW: 30 * DAY_MS,
    SAMPLES_PREPARED: 30 * DAY_MS,
    LEARNER_STEPS: -1,
    PREFERENCES: -1,
    DEADLETTER: -1,
}


def _spec(name: str, key: str) -> TopicSpec:
    return TopicSpec(name, key=key, config={"max.message.bytes": str(MAX_MESSAGE_BYTES),
                                            **Retention(RETENTION_MS[name]).config()})


TOPICS: dict[str, TopicSpec] = {
    t.name: t
    for t in (
        _spec(POLICY_VERSIONS, "policy_id"),
        _spec(SAMPLES_RAW, "actor_id"),
        _spec(SAMPLES_PREPARED, "actor_id"),
        _spec(LEARNER_STEPS, "learner_id"),
        _spec(PREFERENCES, "env_id"),
        _spec(DEADLETTER, "original key"),
        TopicSpec(SCHEMAS, key="schema fingerprint", compacted=True,
                  config={"cleanup.policy": "compact", "max.message.bytes": "1048576"}),
        TopicSpec(ACTORS, key="host or pod name", compacted=True,
                  config={"cleanup.policy": "compact", "max.message.bytes": "1048576"}),
    )
}

def all_topics(partitions: int | None = None, retention: dict[str, Retention] | None = None) -> list[TopicSpec]:
    """Every topic; ``partitions`` overrides the count of the keyed data topics, ``retention``
    the retention of the topics it names (applied when the topics are created)."""
    unknown = sorted(set(retention or ()) - set(RETENTION_MS))
    if unknown:
        raise ValueError(f"retention of {unknown}: only these topics take one: {sorted(RETENTION_MS)}")
    specs = []
    for t in TOPICS.values():
        if partitions is not None and t.name in (SAMPLES_RAW, SAMPLES_PREPARED):
            t = replace(t, partitions=partitions)
        if retention and t.name in retention:
            t = replace(t, config={**t.config, **retention[t.name].config()})
        specs.append(t)
    return specs


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

    def topics(self, partitions: int | None = None,
               retention: dict[str, Retention] | None = None) -> list[TopicSpec]:
        """``all_topics(partitions, retention)`` under their scoped names."""
        return [replace(t, name=self.topic(t.name)) for t in all_topics(partitions, retention)]

    def groups(self) -> list[str]:
        """The scoped consumer groups of the roles."""
        return [self.group(g) for g in (STREAMS_GROUP, LEARNER_GROUP)]

    @classmethod
    def derive(cls, value: str) -> "Namespace":
        """A valid namespace from free text (a run id): other characters become ``-``."""
        return cls(re.sub(r"[^A-Za-z0-9_-]", "-", value)[:100])


LEGACY = Namespace("")


def namespaces_in(topics: Iterable[str]) -> list[str]:
    """The run namespaces that own rlstream topics among ``topics`` (a broker's topic names),
    sorted; "" stands for the legacy unscoped names (``rl.samples.raw``)."""
    found: set[str] = set()
    for name in topics:
        for base in TOPICS:
            if name == base:
                found.add("")
            elif name.endswith("." + base) and _NAMESPACE_RE.fullmatch(name[: -len(base) - 1]):
                found.add(name[: -len(base) - 1])
    return sorted(found)


def describe_namespaces(namespaces: Iterable[str]) -> str:
    """``"exp1, run-7, (legacy, unscoped)"`` for messages; "none" when there are none."""
    names = [n or "(legacy, unscoped)" for n in namespaces]
    return ", ".join(names) if names else "none"
