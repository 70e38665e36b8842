"""The fenced code blocks of the user documentation, each with its doctest marker.

Every fenced block of README.md and docs/**/*.md (docs/deploy.md aside: its owner tests its
blocks) carries an HTML comment on the line just before its fence saying what the doc test does
with it:

- ``<!-- doctest: run [SCENARIO] [slow] -->``: executed as written (bash; ``python`` blocks with
  the venv's python) in a temporary directory; the run blocks of one scenario of one file run in
  document order and share that directory and their exported environment. ``slow``: the
  scenario is marked ``slow`` (CI's second stage).
- ``<!-- doctest: parse -->``: too long to run; each command is parsed and validated as written.
- ``<!-- doctest: output -->``: shows output, not commands.
- ``<!-- doctest: skip REASON -->``: not checked, for the stated reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Blocks tested elsewhere: docs/deploy.md belongs to the deployment guide's owner.
EXCLUDED = {ROOT / "docs" / "deploy.md"}
KINDS = ("run", "parse", "output", "skip")

_MARKER = re.compile(r"^\s*<!--\s*doctest:\s*(\S+)\s*(.*?)\s*-->\s*$")
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^`\s]*)")
#: An indented code block that holds a command: the doc test would not see it, so it is refused.
_INDENTED_COMMAND = re.compile(r"^ {4,}(\$ |rlstream |python|pip |export |kubectl |docker |faust |curl |"
                               r"nice |sudo |torchrun |[A-Z_]+=\S+ )")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    kind: str | None  # None: no marker
    arg: str  # the marker's words after the kind

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def scenario(self) -> str:
        words = self.arg.split()
        name = next((w for w in words if w != "slow"), "default")
        return f"{self.path.relative_to(ROOT)}::{name}"

    @property
    def slow(self) -> bool:
        return "slow" in self.arg.split()


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [f for f in files if f not in EXCLUDED]


def blocks_of(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m.group(1)), m.group(2), m.group(3)
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not re.match(r"^\s*" + re.escape(fence[0]) + "{" + str(len(fence)) + r",}\s*$",
                                              lines[i]):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1  # the closing fence
        marker = _MARKER.match(lines[start - 1]) if start > 0 else None
        out.append(Block(path, start + 1, lang, "\n".join(body) + "\n",
                         marker.group(1) if marker else None, marker.group(2) if marker else ""))
    return out


def indented_commands(path: Path) -> list[str]:
    """``path:line`` of commands in indented code blocks (outside fences)."""
    found, in_fence, prev_blank = [], False, True
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if _FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and prev_blank and _INDENTED_COMMAND.match(line):
            found.append(f"{path.relative_to(ROOT)}:{n}")
        prev_blank = line.strip() == ""
    return found


def all_blocks() -> list[Block]:
    return [b for f in doc_files() for b in blocks_of(f)]


def scenarios() -> dict[str, list[Block]]:
    """Run blocks by scenario, in document order."""
    out: dict[str, list[Block]] = {}
    for b in all_blocks():
        if b.kind == "run":
            out.setdefault(b.scenario, []).append(b)
    return out
