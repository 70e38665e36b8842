"""The ``rlstream`` commands over run directories: ``validate`` (the go-live check of a finished
run), ``prune`` (remove old ones) and ``runs`` (list them)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from config.bus import RUNS_ROOT
from runtime.prune import DEFAULT_OLDER_THAN


def add_parsers(sub) -> None:
    """``validate``, ``prune`` and ``runs``."""
    p = sub.add_parser("validate", help="the deployment guide's go-live check of a finished run")
    p.add_argument("run", type=Path, nargs="?", default=Path("runs/latest"), help="run directory (default: runs/latest)")
    p.add_argument("--json", action="store_true", help="JSON instead of the table")
    p.add_argument("--no-plot", action="store_true", help="do not plot latency and freshness over time")
    p.add_argument("--report-only", action="store_true",
                   help="exit 0 whatever the verdicts (default: exit 1 when a threshold fails, to gate a pipeline; "
                        "2: not a usable run directory)")

    p = sub.add_parser("prune", help="remove run directories (logs, TensorBoard, event log) older than a bound")
    p.add_argument("runs_dir", type=Path, nargs="?", default=Path("runs"), metavar="RUNS_DIR",
                   help="directory of run directories (default: runs); runs/latest's target is never removed")
    p.add_argument("--older-than", default=DEFAULT_OLDER_THAN, metavar="AGE",
                   help=f"age of a run's newest file past which it goes: {DEFAULT_OLDER_THAN} (default), 12h, 90m, ...")
    p.add_argument("--yes", action="store_true", help="remove them (default: a dry run that only lists them)")

    p = sub.add_parser("runs", help="list the runs in a folder: id, mode, algorithm, env, steps, return, status")
    p.add_argument("runs_dir", type=Path, nargs="?", default=RUNS_ROOT, metavar="RUNS_DIR",
                   help="folder of run directories (default: runs)")
    p.add_argument("--json", action="store_true", help="one JSON object per run instead of the table")


def cmd_validate(a: argparse.Namespace) -> int:
    """Exit 0 when no threshold fails (absent figures do not), 1 when one does (0 with
    --report-only), 2 when the run directory is unusable."""
    from runtime import golive

    try:
        report = golive.check(a.run, plot=not a.no_plot)
    except golive.RunUnusable as e:
        print(f"validate: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if a.json else golive.render(report), flush=True)
    failed = golive.failed(report)
    if failed and not a.report_only:
        print(f"validate: {len(failed)} threshold(s) failed ({', '.join(failed)}): exit 1 "
              "(--report-only exits 0)", file=sys.stderr, flush=True)
        return 1
    return 0


def cmd_prune(a: argparse.Namespace) -> int:
    """List (dry run) or remove (--yes) the run directories older than --older-than."""
    from config.bus import parse_duration_ms
    from runtime.prune import prune

    try:
        older_s = parse_duration_ms(a.older_than) / 1000
        entries = prune(a.runs_dir, older_s, yes=a.yes)
    except (ValueError, FileNotFoundError) as e:  # NoRuns included: not a runs folder
        print(f"prune: {e}", file=sys.stderr)
        return 2
    verb = "removed" if a.yes else "would remove"
    for e in entries:
        print(f"{verb} {e.path}  ({e.age_s / 86400:.1f} days old, {e.bytes / 2**20:.1f} MiB)")
    total = sum(e.bytes for e in entries) / 2**20
    print(f"{verb} {len(entries)} entries older than {a.older_than}, {total:.1f} MiB"
          + ("" if a.yes else "; run again with --yes to remove them"), flush=True)
    return 0


def cmd_runs(a: argparse.Namespace) -> int:
    """The runs of a folder, newest first (``runtime.rundir``): a table, or JSON lines."""
    import time

    from runtime.rundir import LATEST, RunDir, find_runs

    if not a.runs_dir.is_dir():
        print(f"runs: no directory {a.runs_dir}", file=sys.stderr)
        return 2
    rows = sorted((RunDir(p).overview() for p in find_runs(a.runs_dir)), key=lambda r: -r["created"])
    latest = a.runs_dir / LATEST
    newest = latest.resolve() if latest.is_symlink() else None
    if a.json:
        for r in rows:
            print(json.dumps({**r, "latest": newest is not None and Path(r["path"]).resolve() == newest}))
        return 0
    if not rows:
        print(f"no runs in {a.runs_dir}")
        return 0

    def cell(v: Any, digits: int = 1) -> str:
        return "-" if v is None or v == "" else (f"{v:.{digits}f}" if isinstance(v, float) else str(v))

    header = ("run id", "mode", "algo", "env", "steps", "return", "status", "started")
    table = [header] + [(("* " if newest is not None and Path(r["path"]).resolve() == newest else "  ")
                         + r["run_id"], r["mode"], cell(r["algo"]), cell(r["env"]), cell(r["steps"]),
                         cell(r["return"]), r["status"],
                         time.strftime("%Y-%m-%d %H:%M", time.localtime(r["created"]))) for r in rows]
    table[0] = ("  " + header[0],) + header[1:]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    print(f"{len(rows)} run(s) in {a.runs_dir}; * is {latest}")
    return 0


HANDLERS = {"validate": cmd_validate, "prune": cmd_prune, "runs": cmd_runs}
