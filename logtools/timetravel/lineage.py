"""``rlstream lineage RUN --version V``: what produced version V, from the log alone.

Walks the GradientSteps back from V to the run's first version (and, for a fork whose parent
log is readable, on into the parent), collecting the sample batches each step trained on, the
actors and behaviour versions that collected them, the actors' seeds, and what was dropped or
dead-lettered on the way (before V was published), with the reasons.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from logtools.timetravel.record import Recorded, RunNotFound, dead_letter_batch_id, load
from actor.identity import actor_seed


class LineageError(ValueError):
    """The version is not one of the run's."""


def _actor_index(actor_id: str) -> int | None:
    tail = actor_id.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


def lineage(run: Recorded, version: int, follow_forks: bool = True) -> dict[str, Any]:
    if version not in run.versions:
        raise LineageError(f"version {version} is not a version of run {run.run_id!r} "
                           f"({run.first_version}..{run.last_version})")
    by_to = {s.to_version: s for _, s in run.steps}
    chain = []
    v = version
    while v in by_to and by_to[v].from_version < v:
        chain.append(by_to[v])
        v = by_to[v].from_version
    chain.reverse()
    origin = v
    prov = run.provenance(origin)
    seed = prov.get("config", {}).get("seed")
    batches, missing = [], []
    for s in chain:
        for bid in s.batch_ids:
            found = run.prepared_batch(bid)
            if found is None:
                missing.append(bid)
                continue
            rec, pb = found
            sb = pb.sample
            idx = _actor_index(sb.actor_id)
            batches.append({
                "batch_id": bid, "step": s.step, "to_version": s.to_version, "actor_id": sb.actor_id,
                "seq": sb.seq, "behaviour_version": sb.policy_version, "env_id": sb.env_id,
                "transitions": sb.size, "episodes": len(sb.episode_returns),
                "staleness_versions": pb.staleness_versions, "sample_weight": pb.sample_weight,
                "actor_seed": actor_seed(seed, idx) if seed is not None and idx is not None else None,
                "record": f"{rec.topic}[{rec.partition}]@{rec.offset}",
            })
    published = run.versions[version][1].created_at_ms
    since = run.versions[origin][1].created_at_ms
    dropped = []
    for rec, dl in run.dead_letters:
        if since <= dl.occurred_at_ms <= published:
            dropped.append({"batch_id": dead_letter_batch_id(run, dl), "reason": dl.reason, "stage": dl.stage,
                            "topic": dl.topic, "offset": dl.offset, "error_class": dl.error_class,
                            "detail": dl.detail})
    lettered = {d["batch_id"] for d in dropped}
    for bid, rec in run.raw.items():  # collected, never prepared, never dead-lettered: dropped in the processors
        if since <= rec.timestamp_ms <= published and bid not in run.prepared and bid not in lettered:
            dropped.append({"batch_id": bid, "reason": "dropped by the stream processors (not dead-lettered)",
                            "stage": "streams", "topic": rec.topic, "offset": rec.offset, "error_class": "",
                            "detail": ""})
    actors = Counter(b["actor_id"] for b in batches)
    out: dict[str, Any] = {
        "run_id": run.run_id, "source": run.source, "policy_id": run.policy_id, "version": version,
        "origin_version": origin, "gradient_steps": [s.step for s in chain],
        "num_gradient_steps": len(chain), "num_batches": len(batches),
        "transitions": sum(b["transitions"] for b in batches),
        "actors": {a: {"batches": n, "actor_seed": next(b["actor_seed"] for b in batches if b["actor_id"] == a)}
                   for a, n in sorted(actors.items())},
        "behaviour_versions": dict(sorted(Counter(b["behaviour_version"] for b in batches).items())),
        "env_ids": sorted({b["env_id"] for b in batches}),
        "batches": batches, "missing_batches": missing,
        "dropped": dropped, "dropped_by_reason": dict(Counter(d["reason"] for d in dropped)),
    }
    fork = prov.get("fork_of")
    if fork:
        out["fork_of"] = fork
        if follow_forks and fork.get("source") and Path(str(fork["source"])).exists():
            try:
                parent = load(fork["source"], run_id=fork.get("run_id"), policy_id=run.policy_id)
                out["parent"] = lineage(parent, int(fork["version"]), follow_forks)
            except (RunNotFound, LineageError) as e:
                out["parent_error"] = str(e)
    return out


def format_table(lin: dict[str, Any]) -> str:
    """The human view of ``lineage``: a summary, then one row per batch, then the drops."""
    lines = [f"version {lin['version']} of {lin['policy_id']} (run {lin['run_id']}, {lin['source']}): "
             f"{lin['num_gradient_steps']} gradient steps from version {lin['origin_version']}, "
             f"{lin['num_batches']} batches, {lin['transitions']} transitions",
             "actors: " + ", ".join(f"{a} ({v['batches']} batches, seed {v['actor_seed']})"
                                    for a, v in lin["actors"].items()),
             "behaviour versions: " + ", ".join(f"v{k} x{n}" for k, n in lin["behaviour_versions"].items()),
             "", f"{'step':>5} {'->ver':>5}  {'batch':<32} {'actor':<10} {'seq':>5} {'beh':>4} {'trans':>6}"]
    lines += [f"{b['step']:>5} {b['to_version']:>5}  {b['batch_id']:<32} {b['actor_id']:<10} {b['seq']:>5} "
              f"{b['behaviour_version']:>4} {b['transitions']:>6}" for b in lin["batches"]]
    if lin["missing_batches"]:
        lines.append(f"missing from the log: {', '.join(lin['missing_batches'])}")
    lines.append("")
    lines.append(f"dropped / dead-lettered on the way: {len(lin['dropped'])}" +
                 "".join(f"\n  {r}: {n}" for r, n in lin["dropped_by_reason"].items()))
    if "fork_of" in lin:
        f = lin["fork_of"]
        lines.append(f"forked from run {f.get('run_id')} at version {f.get('version')} ({f.get('source')})")
        if "parent" in lin:
            lines += ["", "-- parent --", format_table(lin["parent"])]
    return "\n".join(lines)
