"""The GPU path, end to end, in one short run (under 8 minutes on one GPU); writes one JSON.

    python bench/gpu_check.py --out gpu_check.json            # on a CUDA machine
    python bench/gpu_check.py --dry-run --out /tmp/dry.json   # the same steps on CPU, tiny sizes

Steps (each with its own timeout; none starts past ``--deadline`` seconds; a failed step is
recorded with its error and the rest still run). The timeouts fit the GPU machine's budget; a dry
run checks that every step runs, not how fast, so on a loaded CPU its steps get five times as long
and no deadline:

1. ``update``: eager against captured update (``bench/update.py --compare``), PPO and AGRO at
   2,048 and 262,144 samples;
2. ``train``: ``rlstream train --device cuda``, co-located PPO on HalfCheetah-v5 for 100k steps:
   samples/s and GPU utilisation from its summary, and ``rlstream validate``'s GPU row;
3. ``learner_ranks``: one data-parallel rank over nccl (``bench/learner_ranks.py --ranks 1``);
4. ``decoupled``: ``rlstream train --mode decoupled --device cuda`` against a local broker
   (``rlstream broker start``; skipped with the reason when none can start);
5. ``gpu_metrics``: the NVML gauges scraped under load beside NVML (``bench/gpu_metrics.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: (full, dry-run) sizes of each step
SIZES = {
    "update_samples": ("2048,262144", "256"),
    "update_updates": ("3", "1"),
    "train_steps": ("100000", "1024"),
    "decoupled_steps": ("16384", "512"),
    "metrics_seconds": ("8", "2"),
}


#: a dry run's step timeouts, as a multiple of the GPU run's
DRY_SLACK = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Check:
    """Runs the steps against a deadline and collects one JSON document."""

    def __init__(self, dry: bool, deadline: float) -> None:
        self.dry, self.deadline, self.t0 = dry, deadline, time.monotonic()
        self.device = "cpu" if dry else "cuda"
        self.doc: dict = {"bench": "gpu_check", "dry_run": dry, "device": self.device, "steps": {}}

    def size(self, key: str) -> str:
        return SIZES[key][1 if self.dry else 0]

    def run(self, name: str, limit: float, fn) -> None:
        elapsed = time.monotonic() - self.t0
        if elapsed > self.deadline:
            self.doc["steps"][name] = {"ok": False, "skipped": f"past the {self.deadline:.0f}s deadline"}
            return
        t = time.monotonic()
        try:
            out = fn(min(limit * (DRY_SLACK if self.dry else 1), self.deadline + 60 - elapsed))
            self.doc["steps"][name] = {"ok": True, **out}
        except Exception as e:  # noqa: BLE001 - recorded, and the next step runs
            self.doc["steps"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[-2000:]}
        self.doc["steps"][name]["seconds"] = round(time.monotonic() - t, 1)
        print(f"## {name}: ok={self.doc['steps'][name]['ok']} in {self.doc['steps'][name]['seconds']}s", file=sys.stderr)


def cmd(args: list[str], timeout: float) -> str:
    p = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {p.returncode}: {p.stderr[-1500:]}")
    return p.stdout


def rlstream(*args: str) -> list[str]:
    exe = shutil.which("rlstream")
    return [exe, *args] if exe else [sys.executable, "-m", "rlstream.cli", *args]


def step_update(c: Check, limit: float) -> dict:
    out = cmd([sys.executable, "bench/update.py", "--compare", "--algos", "ppo,agro", "--sizes", c.size("update_samples"),
               "--updates", c.size("update_updates"), "--device", c.device], limit)
    return json.loads(out)


def validate_row(run_dir: Path, limit: float) -> dict:
    p = subprocess.run(rlstream("validate", "--json", "--no-plot", "--report-only", str(run_dir)), cwd=ROOT,
                       capture_output=True, text=True, timeout=limit)
    doc = json.loads(p.stdout) if p.stdout.strip().startswith(("{", "[")) else {"raw": p.stdout[-1000:]}
    rows = doc.get("rows", doc) if isinstance(doc, dict) else doc
    gpu = [r for r in rows if isinstance(r, dict) and "gpu" in json.dumps(r).lower()] if isinstance(rows, list) else rows
    return {"gpu_row": gpu, "validate_rc": p.returncode}


def step_train(c: Check, work: Path, limit: float) -> dict:
    run_dir = work / "train"
    t = time.monotonic()
    cmd(rlstream("train", "--env-id", "HalfCheetah-v5", "--algo", "ppo", "--total-steps", c.size("train_steps"),
                 "--learner.device", c.device, "--run-dir", str(run_dir), "--metrics-port", "-1", "--no-plot"), limit)
    wall = time.monotonic() - t
    summary = json.loads((run_dir / "summary.json").read_text())
    path = run_dir / "learner.summary.json"
    learner = json.loads(path.read_text()) if path.exists() else {}
    return {"wall_s": round(wall, 1), "steps": int(c.size("train_steps")), "sps": summary.get("sps"),
            "gpu": summary.get("gpu"),
            "learner_time_s": learner.get("time_s"), "capture": learner.get("capture"),
            **validate_row(run_dir, 60)}


def step_ranks(c: Check, limit: float) -> dict:
    device = "cpu" if c.dry else "cuda:0"
    return json.loads(cmd([sys.executable, "bench/learner_ranks.py", "--ranks", "1", "--device", device,
                           "--updates", "2"], limit))


def step_decoupled(c: Check, work: Path, limit: float) -> dict:
    from config.env import Environment

    brokers = Environment.read().kafka_brokers
    started = None
    if not brokers:
        port = free_port()
        cmd(rlstream("broker", "start", "--port", str(port), "--controller-port", str(free_port()),
                     "--data-dir", str(work / "kafka"), "--timeout", "90"), min(limit, 120))
        brokers, started = f"127.0.0.1:{port}", port
    try:
        run_dir = work / "decoupled"
        t = time.monotonic()
        cmd(rlstream("train", "--mode", "decoupled", "--env-id", "HalfCheetah-v5", "--algo", "ppo",
                     "--total-steps", c.size("decoupled_steps"), "--learner.device", c.device, "--learner.learners", "1",
                     "--bootstrap", brokers, "--run-dir", str(run_dir), "--metrics-port", "-1", "--no-plot"),
            limit)
        out = {"wall_s": round(time.monotonic() - t, 1), "bootstrap": brokers}
        learner = run_dir / "learner.summary.json"
        if learner.exists():
            s = json.loads(learner.read_text())
            out.update(samples_trained=s.get("samples_trained"), gpu=s.get("gpu"), time_s=s.get("time_s"))
        out.update(validate_row(run_dir, 60))
        return out
    finally:
        if started is not None:
            subprocess.run(rlstream("broker", "stop", "--port", str(started)), cwd=ROOT, capture_output=True, timeout=60)


def step_metrics(c: Check, limit: float) -> dict:
    return json.loads(cmd([sys.executable, "bench/gpu_metrics.py", "--device", c.device,
                           "--seconds", c.size("metrics_seconds")], limit))


def host() -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
           "cuda_available": torch.cuda.is_available(), "loadavg_1m": round(os.getloadavg()[0], 2)}
    if torch.cuda.is_available():
        out.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="the same steps on CPU at tiny sizes")
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--deadline", type=float, default=None,
                    help="no step starts after this many seconds (default: 420; none with --dry-run)")
    ap.add_argument("--only", default="", help="comma-separated step names (default: all)")
    args = ap.parse_args()
    deadline = args.deadline if args.deadline is not None else (float("inf") if args.dry_run else 420.0)
    c = Check(args.dry_run, deadline)
    c.doc["host"] = host()
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    steps = {
        "update": (240, lambda lim: step_update(c, lim)),
        "train": (200, lambda lim: step_train(c, work, lim)),
        "learner_ranks": (90, lambda lim: step_ranks(c, lim)),
        "decoupled": (150, lambda lim: step_decoupled(c, work, lim)),
        "gpu_metrics": (90, lambda lim: step_metrics(c, lim)),
    }
    only = [s for s in args.only.split(",") if s]
    for name, (limit, fn) in steps.items():
        if not only or name in only:
            c.run(name, limit, fn)
    c.doc["wall_s"] = round(time.monotonic() - c.t0, 1)
    Path(args.out).write_text(json.dumps(c.doc, indent=2))
    print(json.dumps({k: v.get("ok") for k, v in c.doc["steps"].items()}))


if __name__ == "__main__":
    main()
