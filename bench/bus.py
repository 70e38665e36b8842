"""Bus throughput: produce + consume of real encoded SampleBatch events, memory vs Kafka.

Two event sizes, ~4 KiB (T x 4 envs, HalfCheetah dims) and ~256 KiB (T x 16 envs). The codec
(Avro encode/decode) is timed apart from the bus: the bus cases move pre-encoded payloads,
so ``bus`` numbers are the transport alone. Each case produces for ``--seconds`` (or
``--count`` events), flushes (every record durable), then one fresh reader consumes them all
from offset 0; events/s = n / (produce + flush + consume time).

Prints one JSON document: both backends side by side and the targets
(memory >= 200k small events/s; Kafka >= 50 MB/s for 256 KiB events). ``disk`` reports the
bytes on disk per 1M samples (env steps): Kafka's log (DescribeLogDirs, through Kafka's own
``kafka-log-dirs`` tool) beside the file log of co-located runs (``MemoryBus(path=...)``) and the
encoded payload itself, all for the same events.

    python bench/bus.py --bootstrap 127.0.0.1:9092 --seconds 2
    python bench/bus.py --count 20000 --backends memory
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from config.env import Environment  # noqa: E402
from config.limits import DEFAULT_BOOTSTRAP  # noqa: E402

from schemas.codec import Codec  # noqa: E402
from schemas.examples import sample_batch, sample_batch_of_size  # noqa: E402
from streams.bus.base import Bus  # noqa: E402
from streams.topics import TopicSpec  # noqa: E402

TARGETS = {"memory_small_events_per_s": 200_000, "kafka_large_MB_per_s": 50.0}
SIZES = {"small": (4 * 1024, 4), "large": (256 * 1024, 16)}  # target bytes, envs
POOL = 32  # distinct events per size (payloads cycle; the bus never sees a repeated record)
KEYS = [f"actor-{i}".encode() for i in range(8)]
MiB = 1024 * 1024


def make_events(codec: Codec) -> dict[str, dict]:
    out = {}
    for name, (target, n_envs) in SIZES.items():
        first = sample_batch_of_size(target, N=n_envs, codec=codec)
        t, n, obs_dim = first.obs.shape
        act_dim = first.actions.shape[2]
        events = [sample_batch(t, n, obs_dim, act_dim, seed=i, seq=i) for i in range(POOL)]
        payloads = [codec.encode(e) for e in events]
        out[name] = {"events": events, "payloads": payloads, "shape": [t, n, obs_dim, act_dim],
                     "bytes": len(payloads[0])}
    return out


def time_codec(codec: Codec, events: list, payloads: list[bytes], budget: float = 0.5) -> dict:
    def rate(fn, items) -> float:
        n, t0 = 0, time.perf_counter()
        while True:
            for x in items:
                fn(x)
            n += len(items)
            dt = time.perf_counter() - t0
            if dt > budget:
                return dt / n

    enc = rate(codec.encode, events)
    dec = rate(codec.decode, payloads)
    size = len(payloads[0])
    return {"encode_us": round(enc * 1e6, 1), "decode_us": round(dec * 1e6, 1),
            "encode_MB_per_s": round(size / enc / MiB, 1), "decode_MB_per_s": round(size / dec / MiB, 1)}


def run_case(bus: Bus, payloads: list[bytes], seconds: float | None, count: int | None,
             max_count: int, partitions: int, disk=None) -> dict:
    """``disk(topic) -> bytes``, when given, measures the topic's size on disk after the flush."""
    topic = f"bench-bus-{uuid.uuid4().hex[:10]}"
    bus.create_topics([TopicSpec(topic, key="actor_id", partitions=partitions,
                                 config={"max.message.bytes": str(16 * MiB), "retention.ms": "600000"})])
    size = len(payloads[0])
    pool, keys = len(payloads), len(KEYS)
    produce = bus.produce
    try:
        # produce
        n = 0
        t0 = time.perf_counter()
        if count is not None:
            for i in range(count):
                produce(topic, payloads[i % pool], key=KEYS[i % keys])
            n = count
        else:
            deadline = t0 + seconds
            while n < max_count:
                for _ in range(64):
                    produce(topic, payloads[n % pool], key=KEYS[n % keys])
                    n += 1
                if time.perf_counter() > deadline:
                    break
        t_send = time.perf_counter() - t0
        bus.flush(120)
        t_produce = time.perf_counter() - t0
        ends = bus.end_offsets(topic)
        assert sum(ends.values()) == n, f"{sum(ends.values())} records in the log, {n} produced"
        on_disk = disk(topic) if disk is not None else None

        # consume (a fresh reader from offset 0)
        c = bus.consumer(None, [topic], start="earliest")
        got, nbytes = 0, 0
        t1 = time.perf_counter()
        deadline = t1 + 120
        while got < n:
            recs = c.poll(0.5, max_records=1000)
            got += len(recs)
            for r in recs:
                nbytes += len(r.value)
            if time.perf_counter() > deadline:
                raise RuntimeError(f"consumed {got} of {n} in 120 s")
        t_consume = time.perf_counter() - t1
        c.close()
        assert got == n and nbytes == n * size
    finally:
        delete = getattr(bus, "delete_topics", None)
        if delete is not None:
            delete([topic])
    total = t_produce + t_consume
    return {
        "events": n,
        "event_bytes": size,
        "produce_s": round(t_produce, 3),
        "produce_enqueue_s": round(t_send, 3),
        "consume_s": round(t_consume, 3),
        "produce_events_per_s": round(n / t_produce),
        "consume_events_per_s": round(n / t_consume),
        "events_per_s": round(n / total),
        "MB_per_s": round(n * size / total / MiB, 1),
        "produce_MB_per_s": round(n * size / t_produce / MiB, 1),
        "consume_MB_per_s": round(n * size / t_consume / MiB, 1),
        **({"disk_bytes": on_disk} if on_disk is not None else {}),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bootstrap", default=Environment.read().kafka_brokers or DEFAULT_BOOTSTRAP)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--seconds", type=float, default=None, help="produce for this long per case (default 2)")
    g.add_argument("--count", type=int, default=None, help="events per case")
    ap.add_argument("--max-count", type=int, default=400_000, help="cap on events per case with --seconds")
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--backends", default="memory,kafka,memory-files",
                    help="memory-files: the in-memory bus with its file log (co-located runs), for disk use")
    ap.add_argument("--producer-config", type=json.loads, default=None, help="JSON librdkafka overrides")
    ap.add_argument("--consumer-config", type=json.loads, default=None, help="JSON librdkafka overrides")
    args = ap.parse_args(argv)
    seconds = args.seconds if args.seconds is not None or args.count is not None else 2.0

    codec = Codec()
    data = make_events(codec)
    doc: dict = {
        "bench": "bus",
        "host": {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()},
        "params": {"seconds": seconds, "count": args.count, "partitions": args.partitions,
                   "bootstrap": args.bootstrap},
        "events": {k: {"type": "SampleBatch", "T_N_obs_act": v["shape"], "encoded_bytes": v["bytes"]}
                   for k, v in data.items()},
        "codec": {k: time_codec(codec, v["events"], v["payloads"]) for k, v in data.items()},
        "backends": {},
        "targets": TARGETS,
        "notes": [
            "bus cases move pre-encoded payloads: codec cost is the 'codec' section, per event",
            "memory hands records over by reference (zero-copy): its MB/s is not a copy rate",
            "kafka: broker on the same host; produce_s includes flush (acks=all, every record durable)",
        ],
    }
    tmp = tempfile.TemporaryDirectory(prefix="bench-bus-")
    for backend in args.backends.split(","):
        disk = None
        try:
            if backend == "memory":
                from streams.bus.memory import MemoryBus

                bus: Bus = MemoryBus()
            elif backend == "memory-files":
                from streams.bus.memory import MemoryBus

                bus = MemoryBus(path=Path(tmp.name) / "log")
                disk = lambda topic: dir_bytes(Path(tmp.name) / "log" / topic)  # noqa: E731
            elif backend == "kafka":
                from streams.bus.kafka import KafkaBus

                bus = KafkaBus(args.bootstrap, client_id="rlstream-bench",
                               producer_config=args.producer_config, consumer_config=args.consumer_config)
                doc["params"]["kafka_producer"] = bus_config(bus, "producer")
                doc["params"]["kafka_consumer"] = bus_config(bus, "consumer")
                disk = kafka_disk(args.bootstrap)
            else:
                raise ValueError(f"unknown backend {backend}")
            with bus:
                doc["backends"][backend] = {
                    k: run_case(bus, v["payloads"], seconds, args.count, args.max_count, args.partitions, disk)
                    for k, v in data.items()
                }
        except Exception as e:  # report a backend that cannot run, keep the other
            doc["backends"][backend] = {"error": f"{type(e).__name__}: {e}"}
    tmp.cleanup()
    doc["disk"] = disk_report(doc["backends"], data)

    b = doc["backends"]
    doc["met"] = {
        "memory_small_events_per_s": b.get("memory", {}).get("small", {}).get("events_per_s", 0)
        >= TARGETS["memory_small_events_per_s"],
        "kafka_large_MB_per_s": b.get("kafka", {}).get("large", {}).get("MB_per_s", 0)
        >= TARGETS["kafka_large_MB_per_s"],
    }
    print(json.dumps(doc, indent=1))
    return 0


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def kafka_disk(bootstrap: str):
    """``topic -> bytes`` on the brokers' disks (Kafka's own kafka-log-dirs tool)."""
    from localkafka.kafka_tools import log_dir_bytes

    return lambda topic: log_dir_bytes(bootstrap, [topic])[topic]


def disk_report(backends: dict, data: dict) -> dict:
    """Bytes on disk per 1M samples (env steps) per backend and event size, with the encoded
    payload per 1M samples as the floor every backend is compared to."""
    out: dict = {}
    for size, d in data.items():
        t, n = d["shape"][:2]
        row = {"payload": round(d["bytes"] / (t * n) * 1e6)}
        for backend, cases in backends.items():
            case = cases.get(size, {})
            if "disk_bytes" in case:
                row[backend] = round(case["disk_bytes"] / (case["events"] * t * n) * 1e6)
        out[f"{size}_bytes_per_1M_samples"] = row
    return out


def bus_config(bus, role: str) -> dict:
    conf = bus.consumer_config if role == "consumer" else bus.producer_config
    keep = ("linger.ms", "batch.size", "batch.num.messages", "queue.buffering.max.kbytes", "compression.type",
            "acks", "enable.idempotence", "fetch.max.bytes", "max.partition.fetch.bytes",
            "queued.max.messages.kbytes", "fetch.wait.max.ms")
    return {k: conf[k] for k in keep if k in conf}


if __name__ == "__main__":
    sys.exit(main())
