"""The documentation's code blocks, executed or checked as their markers say (tests/docs/blocks.py).

- Every fenced block of README.md and docs/ carries a marker; no command hides in an indented
  block; every relative link points at a file that exists.
- ``run`` scenarios execute as written in a temporary directory, with the venv's ``bin`` first
  on PATH, ``RLSTREAM_METRICS_PORT=0`` (a free metrics port) and no inherited ``RLSTREAM_*`` or
  ``KAFKA_BROKERS``. A scenario that starts a broker with ``rlstream broker start`` gets free
  ports: every ``rlstream broker start|stop|status`` line of it gets ``--port P --data-dir D``
  appended after the subcommand, and ``KAFKA_BROKERS=127.0.0.1:P`` is exported before its first
  block; at its end, pass or fail, the broker is stopped and every process the scenario started
  is killed with its process group.
- ``parse`` blocks: each ``rlstream train|actor|learner`` line is parsed by ``rlstream.cli`` and
  turned into its validated ``TrainConfig`` (the env id made once) without training; every
  other ``rlstream`` line is parsed; every block passes ``bash -n``.
- The generated reference pages equal what ``python -m tests.docs.reference`` writes.
"""

from __future__ import annotations

import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.docs import blocks as B

BIN = Path(sys.executable).parent
BLOCK_TIMEOUT_S = 300
SLOW_BLOCK_TIMEOUT_S = 600
_BROKER = re.compile(r"\brlstream broker (start|stop|status)\b")


# --- markers, links ---------------------------------------------------------------------------

def test_every_block_has_a_known_marker():
    bad = []
    for b in B.all_blocks():
        if b.kind is None:
            bad.append(f"{b.where}: no <!-- doctest: ... --> marker on the line before the fence")
        elif b.kind not in B.KINDS:
            bad.append(f"{b.where}: unknown doctest kind {b.kind!r} (one of {B.KINDS})")
        elif b.kind == "skip" and not b.arg:
            bad.append(f"{b.where}: a skip needs its reason")
        elif b.kind == "output" and b.arg:
            bad.append(f"{b.where}: an output block takes no arguments")
    assert not bad, "\n".join(bad)


def test_no_command_in_an_indented_block():
    found = [w for f in B.doc_files() for w in B.indented_commands(f)]
    assert not found, "commands in indented code blocks escape the doc test; fence them:\n" + "\n".join(found)


def test_skipped_blocks_are_listed(capsys):
    skips = [f"{b.where}: {b.arg}" for b in B.all_blocks() if b.kind == "skip"]
    with capsys.disabled():
        print("\ndoc blocks skipped:\n  " + "\n  ".join(skips or ["none"]))


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_relative_links_resolve():
    bad = []
    for f in B.doc_files() + [B.ROOT / "docs" / "deploy.md", B.ROOT / "CHANGELOG.md"]:
        text = re.sub(r"```.*?```", "", f.read_text(), flags=re.S)
        for target in _LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = target.split("#", 1)[0]
            if path and not (f.parent / path).exists():
                bad.append(f"{f.relative_to(B.ROOT)}: {target}")
    assert not bad, "broken links:\n" + "\n".join(bad)


# --- parse blocks -----------------------------------------------------------------------------

def _logical_lines(text: str) -> list[str]:
    return [ln for ln in re.sub(r"\\\n", " ", text).splitlines() if ln.strip()]


def _check_rlstream(argv: list[str]) -> None:
    from rlstream import cli

    if argv and argv[0] == "broker":
        from localkafka.cli import _build_parser

        _build_parser().parse_args(argv[1:])
        return
    try:
        a = cli.build_parser().parse_args(argv)
    except SystemExit as e:
        if e.code in (0, None) and ("--help" in argv or "-h" in argv):
            return
        raise AssertionError(f"rlstream {shlex.join(argv)}: refused by the parser ({e.code})") from None
    # --resume needs the run it resumes: parsed only (the resume how-to runs one for real)
    if a.command in cli.TRAINING_COMMANDS and getattr(a, "config", None) is None and not a.train.resume:
        try:
            cli.train_config(a, default_bus="kafka" if a.command != "train" or a.mode == "decoupled" else "memory")
        except SystemExit as e:
            raise AssertionError(f"rlstream {shlex.join(argv)}: refused: {e.code}") from None


PARSE_BLOCKS = [b for b in B.all_blocks() if b.kind == "parse"]


@pytest.mark.parametrize("block", PARSE_BLOCKS, ids=[b.where for b in PARSE_BLOCKS])
def test_parse_block(block, tmp_path, monkeypatch):
    if block.lang != "python":
        r = subprocess.run(["bash", "-n"], input=block.text, text=True, capture_output=True)
        assert r.returncode == 0, f"{block.where}: bash -n: {r.stderr}"
    else:
        compile(block.text, block.where, "exec")
        return
    monkeypatch.chdir(tmp_path)
    for var in list(os.environ):
        if var.startswith("RLSTREAM_") and var != "RLSTREAM_TEST_PROCS" or var == "KAFKA_BROKERS":
            monkeypatch.delenv(var)
    for line in _logical_lines(block.text):
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        for words in _commands(list(lex)):
            _check_command(words, monkeypatch)


def _commands(words: list[str]) -> list[list[str]]:
    """The simple commands of a list (``a && b; c | d``)."""
    out, cur = [], []
    for w in words:
        if w and set(w) <= set("&|;"):
            out.append(cur)
            cur = []
        else:
            cur.append(w)
    return [c for c in out + [cur] if c]


def _check_command(words: list[str], monkeypatch) -> None:
    if words[:1] == ["export"]:
        for w in words[1:]:
            if "=" in w:
                monkeypatch.setenv(*w.split("=", 1))
        return
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        monkeypatch.setenv(*words.pop(0).split("=", 1))
    if "rlstream.cli" in words:  # torchrun ... -m rlstream.cli learner ...
        words = ["rlstream", *words[words.index("rlstream.cli") + 1:]]
    if words[:1] == ["rlstream"]:
        _check_rlstream(words[1:])


# --- run scenarios ----------------------------------------------------------------------------

def _free_block(n: int) -> int:
    """A port P with P..P+n-1 all free on 127.0.0.1 (a cluster's node i uses P+2i and P+2i+1)."""
    from localkafka.probe import port_is_free

    rng = random.Random()
    for _ in range(200):  # below Linux's ephemeral range, where outgoing connections take ports
        base = rng.randrange(20000, 32000 - n)
        if all(port_is_free(base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports")


def _scenario_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("RLSTREAM_") and k not in ("RLSTREAM_TEST_PROCS", "RLSTREAM_CACHE"))
           and k not in ("KAFKA_BROKERS", "REDIS_URL", "VIRTUAL_ENV")}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", RLSTREAM_METRICS_PORT="0", MPLBACKEND="Agg",
               PYTHONUNBUFFERED="1", HOME=env.get("HOME", str(tmp)))
    return env


def _run_block(block: B.Block, work: Path, state: Path, env: dict[str, str], timeout: float,
               n: int) -> tuple[int, str]:
    log = work.parent / f"block-{n}.log"
    if block.lang == "python":
        src = work.parent / f"block-{n}.py"
        src.write_text(block.text)
        body = f"python {shlex.quote(str(src))}\n"
    else:
        body = block.text
    script = (f"set -eo pipefail\nsource {shlex.quote(str(state))}\ncd \"$DOCTEST_CWD\"\n{body}\n"
              f"DOCTEST_CWD=$(pwd); export DOCTEST_CWD; export -p > {shlex.quote(str(state))}\n")
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", "-c", script], cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = -1
        finally:
            _kill_group(proc.pid)
    return code, log.read_text()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


SCENARIOS = B.scenarios()


def _params():
    for name, blocks in SCENARIOS.items():
        marks = [pytest.mark.slow] if any(b.slow for b in blocks) else []
        yield pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", list(_params()))
def test_run_scenario(name, tmp_path):
    blocks = SCENARIOS[name]
    slow = any(b.slow for b in blocks)
    work = tmp_path / "work"
    work.mkdir()
    env = _scenario_env(tmp_path)
    kafka = any(_BROKER.search(b.text) for b in blocks)
    port = data = None
    if kafka:
        nodes = max([int(m) for b in blocks for m in re.findall(r"--nodes (\d+)", b.text)] or [1])
        port, data = _free_block(2 * nodes), tmp_path / "kafka-data"
        env["KAFKA_BROKERS"] = f"127.0.0.1:{port}"
    env["DOCTEST_CWD"] = str(work)
    state = tmp_path / "state.sh"
    state.write_text("")
    started = time.monotonic()
    timings = []
    try:
        for n, block in enumerate(blocks):
            if kafka:
                block = B.Block(block.path, block.line, block.lang,
                                _BROKER.sub(lambda m: f"{m.group(0)} --port {port} --data-dir {data}", block.text),
                                block.kind, block.arg)
            t0 = time.monotonic()
            code, out = _run_block(block, work, state, env, SLOW_BLOCK_TIMEOUT_S if slow else BLOCK_TIMEOUT_S, n)
            timings.append(f"{block.where} {time.monotonic() - t0:.0f}s")
            assert code == 0, (f"{block.where}: exit {code}" + (" (timed out)" if code == -1 else "")
                               + f"\n--- block ---\n{block.text}--- output (tail) ---\n{out[-6000:]}")
    finally:
        if kafka:
            subprocess.run([str(BIN / "rlstream"), "broker", "stop", "--port", str(port), "--data-dir", str(data),
                            "--timeout", "20"], env=env, capture_output=True, timeout=120)
        print(f"{name}: {time.monotonic() - started:.0f}s ({'; '.join(timings)})")


# --- generated reference ----------------------------------------------------------------------

def test_reference_pages_are_current():
    from tests.docs import reference

    stale = [str(p.relative_to(B.ROOT)) for p, text in reference.pages().items()
             if not p.exists() or p.read_text() != text]
    assert not stale, f"out of date: {stale}; regenerate with: python -m tests.docs.reference"
