#!/usr/bin/env bash
# GPU learner benchmarks in one go, for a machine with one CUDA GPU; writes $OUT/gpu_bench.json.
#
#   OUT=/tmp/gpu PY=python3 bash bench/gpu.sh            # DEVICE=cpu to dry-run it without a GPU
#   ONLY='gpu_metrics|learner_ranks' ENVS= bash bench/gpu.sh   # a subset
#
# 1. bench/update.py, PPO (CleanRL settings) and AGRO, batch 2048 x N for N in $ENVS, on the GPU and
#    on the CPU with every core (the peer figure; 1 thread too for the small batches);
# 2. bench/learner_ranks.py, one rank over nccl against plain algo.update;
# 3. bench/gpu_metrics.py, runtime.metrics' GPU gauges scraped under load beside NVML;
# 4. nvidia-smi's header, torch and CUDA versions.
# Each run has its own timeout; no run starts after $DEADLINE s or runs past $HARD s.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)          # update.py and gpu_metrics.py (bench/ or a copy of it)
ROOT=${ROOT:-$(cd "$HERE/.." && pwd)}        # the repository (its packages and bench/learner_ranks.py)
OUT=${OUT:-/tmp/gpu_bench}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
ENVS=${ENVS-"1 8 32 128"}                 # ENVS="" skips the update matrix
ONLY=${ONLY:-.}                              # an extended regex: only runs whose name matches it run
DEADLINE=${DEADLINE:-300}                    # no run starts after this many seconds
HARD=${HARD:-370}                            # and none runs past this
THREADS=${THREADS:-$(nproc)}
RUNS=$(mktemp -d)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
cd "$ROOT" || exit 1

run() {  # run NAME TIMEOUT CMD...: its JSON to $RUNS/NAME.json, its output to the log
    local name=$1 limit=$2; shift 2
    echo "$name" | grep -Eq -- "$ONLY" || return 0
    if (( SECONDS > DEADLINE )); then echo "## skip $name (past ${DEADLINE}s)"; return; fi
    (( HARD - SECONDS < limit )) && limit=$((HARD - SECONDS))
    echo "## $name: $* (t=${SECONDS}s)"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$RUNS/$name.json" 2>"$RUNS/$name.err"
    local rc=$?
    tail -n 5 "$RUNS/$name.err"
    echo "## $name rc=$rc in $((SECONDS - t0))s"
    if (( rc != 0 )); then mv "$RUNS/$name.json" "$RUNS/$name.failed"; fi
}

updates_for() { case $1 in 1|8) echo 10;; 32) echo 5;; *) echo 3;; esac; }

{
    nvidia-smi -q 2>&1 | head -n 40 >"$OUT/nvidia-smi.txt"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader \
        >"$RUNS/smi.csv" 2>&1
    "$PY" -c 'import json, os, platform, torch; print(json.dumps({"python": platform.python_version(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cpus": os.cpu_count(), "cudnn": torch.backends.cudnn.version()}))' >"$RUNS/versions.json"
    cat "$RUNS/smi.csv" "$RUNS/versions.json"

    # the short runs first, then the matrix; a 1-thread CPU peer beside the small batches
    run gpu_metrics 90 "$PY" "$HERE/gpu_metrics.py" --device "$DEVICE" --seconds 8
    rdev=$([ "$DEVICE" = cuda ] && echo cuda:0 || echo "$DEVICE")
    run learner_ranks_default 120 "$PY" bench/learner_ranks.py --ranks 1 --device "$rdev"
    run learner_ranks_16k 120 "$PY" bench/learner_ranks.py --ranks 1 --device "$rdev" --fragments 16 --n 16
    for n in $ENVS; do
        u=$(updates_for "$n")
        for algo in ppo agro; do
            run "update_${algo}_n${n}_${DEVICE}" 120 "$PY" "$HERE/update.py" --algo "$algo" --num-envs "$n" \
                --updates 10 --device "$DEVICE"
            run "update_${algo}_n${n}_cpu_t${THREADS}" 120 "$PY" "$HERE/update.py" --algo "$algo" --num-envs "$n" \
                --updates "$u" --threads "$THREADS"
            if (( n <= 8 )); then
                run "update_${algo}_n${n}_cpu_t1" 120 "$PY" "$HERE/update.py" --algo "$algo" --num-envs "$n" --updates 5
            fi
        done
    done

    "$PY" - "$RUNS" "$OUT/gpu_bench.json" "$DEVICE" "$THREADS" <<'EOF'
import json, sys, datetime
from pathlib import Path
runs, dest, dev, threads = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
res = {p.stem: json.loads(p.read_text()) for p in sorted(runs.glob("*.json")) if p.read_text().strip()}
out = {"bench": "gpu", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
       "nvidia_smi": (runs / "smi.csv").read_text().strip(), "versions": res.pop("versions", None),
       "failed": sorted(p.stem for p in runs.glob("*.failed")), "update": [], "runs": res}
for name, r in res.items():
    if not name.startswith("update_") or not name.endswith("_" + dev):
        continue
    algo, n = name.split("_")[1], name.split("_")[2]
    row = {"algo": algo, "batch": r["batch"], f"{dev}_update_s": r["update_s_median"],
           f"{dev}_samples_per_s": r["samples_per_s"]}
    for t in (threads, "1"):
        c = res.get(f"update_{algo}_{n}_cpu_t{t}")
        if c:
            row[f"cpu_t{t}_update_s"] = c["update_s_median"]
            row[f"{dev}_speedup_vs_cpu_t{t}"] = round(c["update_s_median"] / r["update_s_median"], 2)
    out["update"].append(row)
out["update"].sort(key=lambda r: (r["algo"], r["batch"]))
dest.write_text(json.dumps(out, indent=2))
print(json.dumps(out["update"], indent=1))
print("failed:", out["failed"])
EOF
    echo "## done in ${SECONDS}s"
} 2>&1 | tee "$OUT/run.log"
