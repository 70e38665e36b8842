"""``rlstream lag``: consumer lag per group and partition, as Kafka's own
``kafka-consumer-groups --describe`` reports it.

    report = lag_report(BusConfig.from_environment(env, kind="kafka", namespace="exp1"))
    print(format_table(report))

Which groups: those named (``groups``: as Kafka names them, or by their name in the namespace,
``learner`` -> ``exp1.learner``), else every group of the namespace (``every``), else the run's
own: the stream processors' ``<ns>.rlstream-streams`` and the learner's ``<ns>.learner``.

The rows are Kafka's: each partition a member of the group is assigned now, and each partition
the group has committed an offset on. ``current_offset`` is the committed offset (None where the
group has none: Kafka's ``-``), ``log_end_offset`` the partition's high watermark, ``lag`` their
difference (None without a committed offset).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from config import BusConfig
from streams.topics import LEARNER_GROUP, STREAMS_GROUP, Namespace, describe_namespaces

__all__ = ["LagError", "lag_report", "format_table", "COLUMNS"]

#: Table columns, named as ``kafka-consumer-groups --describe`` names them.
COLUMNS = (("GROUP", "group"), ("TOPIC", "topic"), ("PARTITION", "partition"), ("CURRENT-OFFSET", "current_offset"),
           ("LOG-END-OFFSET", "log_end_offset"), ("LAG", "lag"), ("CONSUMER-ID", "consumer_id"),
           ("HOST", "host"), ("CLIENT-ID", "client_id"))
_ROLE_GROUPS = (STREAMS_GROUP, LEARNER_GROUP)


class LagError(ValueError):
    """A group asked for is not on the broker (the message names the ones there)."""


def _namespaces_of(groups: Sequence[str], learner_group: str) -> list[str]:
    """Namespaces that have a role's group among ``groups`` ("": the legacy names)."""
    out = set()
    for g in groups:
        for role in {*_ROLE_GROUPS, learner_group}:
            if g == role:
                out.add("")
            elif g.endswith("." + role):
                out.add(g[: -len(role) - 1])
    return sorted(out)


def _choose(cfg: BusConfig, known: dict[str, str], groups: Sequence[str], every: bool, bootstrap: str) -> list[str]:
    ns = Namespace(cfg.namespace)
    where = f"namespace {ns.name!r}" if ns.name else "the legacy unscoped names"
    if groups:
        out = []
        for g in groups:
            name = g if g in known else ns.group(g)
            if name not in known:
                mine = sorted(k for k in known if not ns.name or k.startswith(ns.name + "."))
                raise LagError(f"no consumer group {g!r} on the Kafka broker at {bootstrap} (nor {name!r}); groups "
                               f"there{' in ' + where if ns.name else ''}: {', '.join(mine[:30]) or 'none'}")
            out.append(name)
        return out
    if every:
        out = sorted(k for k in known if not ns.name or k.startswith(ns.name + "."))
    else:
        out = [g for g in (ns.group(STREAMS_GROUP), ns.group(cfg.learner_group)) if g in known]
    if not out:
        looked = "any" if every else " or ".join(ns.group(g) for g in (STREAMS_GROUP, cfg.learner_group))
        others = describe_namespaces(_namespaces_of(list(known), cfg.learner_group))
        raise LagError(f"no consumer group of {where} on the Kafka broker at {bootstrap} (looked for {looked}); "
                       f"namespaces with groups there: {others}; choose one with --namespace NS or --run-dir RUN, "
                       "or name a group with --group")
    return out


def lag_report(cfg: BusConfig, groups: Sequence[str] = (), every: bool = False) -> dict[str, Any]:
    """``{bootstrap, namespace, groups: [{group, state, members, lag, partitions: [row]}]}``
    (module docstring); ``LagError`` when a group asked for (or every group looked for) is absent.
    Raises ``NoBrokerError`` when nothing answers at ``cfg.bootstrap``."""
    from streams.bus import kafka_bus

    bus = kafka_bus(cfg, client_id="rlstream-lag")
    try:
        known = bus.consumer_groups()
        chosen = _choose(cfg, known, groups, every, bus.bootstrap)
        out = []
        for group in chosen:
            state, owners = bus.describe_group(group)
            committed = bus.group_offsets(group)
            rows = []
            for topic, partition in sorted(set(owners) | set(committed)):
                current = committed.get((topic, partition))
                end = bus.log_end(topic, partition)
                owner = owners.get((topic, partition), {})
                rows.append({"group": group, "topic": topic, "partition": partition, "current_offset": current,
                             "log_end_offset": end, "lag": None if current is None else end - current,
                             "consumer_id": owner.get("consumer_id"), "host": owner.get("host"),
                             "client_id": owner.get("client_id")})
            out.append({"group": group, "state": state,
                        "members": len({o["consumer_id"] for o in owners.values()}),
                        "lag": sum(r["lag"] for r in rows if r["lag"] is not None), "partitions": rows})
        return {"bootstrap": bus.bootstrap, "namespace": cfg.namespace, "groups": out}
    finally:
        bus.close()


def format_table(report: dict[str, Any]) -> str:
    """The report as ``kafka-consumer-groups --describe`` lays it out (``-`` for none), with a
    line per group: its state, members and total lag."""
    lines = []
    for g in report["groups"]:
        lines.append(f"{g['group']}: {g['state']}, {g['members']} member(s), lag {g['lag']}")
    cells = [[h for h, _ in COLUMNS]] + [["-" if r[k] is None else str(r[k]) for _, k in COLUMNS]
                                         for g in report["groups"] for r in g["partitions"]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines.append("")
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)
