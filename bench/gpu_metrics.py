"""rlstream's GPU metrics (``runtime.metrics``) read on a real GPU while PPO updates run; prints JSON.

    python bench/gpu_metrics.py [--device cuda] [--seconds 8] [--num-envs 32]

Builds ``Metrics(role="learner")`` as every role does (GPU found through ``torch.cuda``) and
scrapes its Prometheus text every ``--interval`` s: idle, while a thread runs PPO updates, and
after. Beside each scrape it reads NVML directly (the peer figure: what the gauge should say).
A child process with ``pynvml`` hidden shows the fallback: memory gauges kept, utilisation absent.
With ``--device cpu`` (no GPU) it reports the GPU families absent.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from agents.ppo import PPO, PPOConfig  # noqa: E402
from bench.update import synthetic_batch  # noqa: E402
from runtime.metrics import Metrics  # noqa: E402

GPU_PREFIX = "rlstream_gpu_"

_NO_PYNVML = """
import json, sys
sys.modules["pynvml"] = None  # as if nvidia-ml-py were not installed
from runtime.metrics import Metrics
m = Metrics(role="learner")
names = sorted({s.name for f in __import__("prometheus_client.parser", fromlist=["x"]).text_string_to_metric_families(
    m.render().decode()) for s in f.samples if s.name.startswith("rlstream_gpu_") and s.name != "rlstream_gpu_available"})
print(json.dumps({"gpu_enabled": m.gpu_enabled, "gpu_utilization_enabled": m.gpu_utilization_enabled,
                  "gpu_series": names}))
"""


def scrape(metrics: Metrics) -> dict[str, float]:
    """``{name: value}`` of the ``rlstream_gpu_*`` series of device 0 in one scrape."""
    out = {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        for s in fam.samples:
            if s.name.startswith(GPU_PREFIX) and s.labels.get("device") == "0":
                out[s.name[len(GPU_PREFIX):]] = s.value
    return out


def nvml_reader():
    """A function reading NVML's utilisation (percent) of device 0 directly, or None with the reason."""
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        return (lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)), None
    except Exception as e:  # no pynvml, no driver
        return None, f"{type(e).__name__}: {e}"


def summarise(rows: list[dict]) -> dict:
    out: dict = {"scrapes": len(rows)}
    for key in ("utilization_ratio", "nvml_percent", "memory_allocated_bytes", "memory_reserved_bytes",
                "memory_total_bytes"):
        vals = [r[key] for r in rows if key in r]
        if vals:
            out[key] = {"mean": round(float(np.mean(vals)), 4), "max": round(float(np.max(vals)), 4)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seconds", type=float, default=8.0, help="scrape time under load")
    ap.add_argument("--idle", type=float, default=2.0, help="scrape time before and after the load")
    ap.add_argument("--interval", type=float, default=0.25)
    ap.add_argument("--num-envs", type=int, default=32, help="batch = 2048 x num-envs")
    args = ap.parse_args()

    metrics = Metrics(role="learner")
    nvml, nvml_error = nvml_reader()
    algo = PPO(PPOConfig(), obs_dim=17, act_dim=6, device=args.device)
    batch = synthetic_batch(2048, args.num_envs, 17, 6)
    algo.update(batch)  # warm-up: allocator and kernels ready before the idle phase

    stop = threading.Event()
    updates = [0]

    def load() -> None:
        while not stop.is_set():
            algo.update(batch)
            updates[0] += 1

    def phase(seconds: float) -> list[dict]:
        rows, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            row = scrape(metrics)
            if nvml is not None:
                row["nvml_percent"] = nvml()
            rows.append(row)
            time.sleep(args.interval)
        return rows

    idle = phase(args.idle)
    worker = threading.Thread(target=load, daemon=True)
    t0 = time.perf_counter()
    worker.start()
    busy = phase(args.seconds)
    stop.set()
    worker.join()
    busy_s = time.perf_counter() - t0
    after = phase(args.idle)

    child = subprocess.run([sys.executable, "-c", _NO_PYNVML], capture_output=True, text=True, timeout=120,
                           cwd=str(Path(__file__).resolve().parents[1]))
    try:
        no_pynvml = json.loads(child.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        no_pynvml = {"error": (child.stderr or child.stdout)[-2000:]}

    print(json.dumps({
        "bench": "gpu_metrics",
        "device": args.device,
        "gpu_enabled": metrics.gpu_enabled,
        "gpu_utilization_enabled": metrics.gpu_utilization_enabled,
        "gpu_series": sorted({k for r in busy for k in r if k != "nvml_percent"}),
        "nvml_direct_error": nvml_error,
        "load": {"algo": "ppo", "batch": 2048 * args.num_envs, "updates": updates[0],
                 "update_s_mean": round(busy_s / max(1, updates[0]), 4)},
        "idle_before": summarise(idle), "under_load": summarise(busy), "idle_after": summarise(after),
        "without_pynvml": no_pynvml,
        "host": {"torch": torch.__version__, "cuda": torch.version.cuda,
                 "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
    }, indent=2))


if __name__ == "__main__":
    main()
