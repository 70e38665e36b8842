"""The cost of the learner's transactional writes: one update's publish (its PolicyVersion and
its GradientStep, then one flush, as ``learner.Learner._train`` does) on Kafka with and without a
``transactional_id`` (``streams.bus.kafka.producer``), and on the memory bus, which has none.

Policies of a few sizes (inline weights, under the claim-check size); each case publishes
``--updates`` updates after ``--warmup``, the two Kafka cases interleaved update by update so
load drifts hit both alike. Prints one JSON document: per case and size, the milliseconds of
one update's publish (p50, p90, mean), and the transactional over plain ratio of the medians.

    python bench/txn_publish.py                      # a private broker of its own
    python bench/txn_publish.py --bootstrap 127.0.0.1:9092 --updates 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import host_info, load_1m, policy_of_size, private_broker  # noqa: E402
from schemas.codec import Codec  # noqa: E402
from schemas.events import GradientStep, now_ms  # noqa: E402
from streams.bus import make_bus  # noqa: E402
from streams.events import EventBus  # noqa: E402
from streams.policy.publish import make_policy_version, publish_policy_version  # noqa: E402
from streams.topics import LEARNER_STEPS, POLICY_VERSIONS, all_topics  # noqa: E402

SIZES = (10_000, 250_000)  # parameters: ~40 KB and ~1 MB of float32 weights


def _update(events: EventBus, policy, version: int) -> float:
    """One update's writes as the learner makes them; its seconds."""
    t0 = time.perf_counter()
    pv = make_policy_version(policy, policy_id="policy", version=version, parent_version=version - 1,
                             learner_id="bench", algo="ppo")
    publish_policy_version(events, pv, flush=False)  # one flush for both (one transaction)
    events.publish(LEARNER_STEPS, GradientStep("bench", version, version - 1, version, "ppo", {}, 0.0, [], 0,
                                               now_ms(), now_ms()), key="bench")
    events.flush()
    return time.perf_counter() - t0


def _stats(xs: list[float]) -> dict:
    ms = sorted(x * 1000 for x in xs)
    return {"p50_ms": round(statistics.median(ms), 2), "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 2),
            "mean_ms": round(statistics.fmean(ms), 2), "n": len(ms)}


def run(bootstrap: str, updates: int, warmup: int) -> dict:
    codec = Codec()
    out: dict = {}
    for params in SIZES:
        policy = policy_of_size(params)
        memory = EventBus(make_bus("memory"), codec)
        memory.bus.create_topics(all_topics())
        ns = f"bench-txn-{uuid.uuid4().hex[:8]}"
        kafka = {}
        for name, extra in (("plain", {}), ("transactional", {"transactional_id": f"{ns}.learner"})):
            bus = make_bus("kafka", bootstrap=bootstrap, client_id=f"{ns}-{name}", **extra)
            bus.create_topics([s for s in all_topics() if s.name in (POLICY_VERSIONS, LEARNER_STEPS)])
            kafka[name] = EventBus(bus, codec)
        times: dict[str, list[float]] = {"memory": [], "plain": [], "transactional": []}
        try:
            for v in range(warmup + updates):
                for name, events in (("memory", memory), *kafka.items()):
                    dt = _update(events, policy, v)
                    if v >= warmup:
                        times[name].append(dt)
        finally:
            for events in (memory, *kafka.values()):
                events.bus.close()
        row = {name: _stats(xs) for name, xs in times.items()}
        row["transactional_over_plain_p50"] = round(row["transactional"]["p50_ms"] / row["plain"]["p50_ms"], 2)
        row["weights_bytes"] = 4 * sum(p.numel() for p in policy.state_dict().values())
        out[f"{params}_params"] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bootstrap", help="an existing broker (default: a private one)")
    ap.add_argument("--updates", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    a = ap.parse_args(argv)
    load = load_1m()
    if a.bootstrap:
        result = run(a.bootstrap, a.updates, a.warmup)
    else:
        with private_broker() as bootstrap:
            result = run(bootstrap, a.updates, a.warmup)
    print(json.dumps({"bench": "txn_publish", "updates": a.updates, "results": result,
                      "host": host_info(load_1m_before=load, load_1m_after=load_1m())}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
