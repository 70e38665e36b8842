"""The README's two set-up commands work on a fresh Debian/Ubuntu machine with only Python
(PEP 668: each makes and uses a virtual environment), and .ci/run runs the test command exactly
as the README writes it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = "python3 -m venv .venv && . .venv/bin/activate && "


def readme_command(lead: str) -> str:
    """The one-line fenced block right after the README paragraph that starts with ``lead``."""
    text = (ROOT / "README.md").read_text()
    m = re.search(re.escape(lead) + r".*?\n```\n(.+?)\n```", text, re.S)
    assert m, f"README has no command block after {lead!r}"
    assert "\n" not in m.group(1), "a set-up command must be one line"
    return m.group(1)


def test_both_commands_create_and_use_a_venv_before_pip():
    main, tests = readme_command("Run the main job"), readme_command("Run the tests")
    for cmd in (main, tests):
        assert cmd.startswith(VENV), cmd
        assert "sudo" not in cmd and "--break-system-packages" not in cmd
    assert main == VENV + "pip install -e . && rlstream train --mode colocated --algo ppo --env HalfCheetah-v5"
    assert tests == VENV + "pip install -e '.[test]' && python -m pytest"


def test_ci_extracts_exactly_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    lines = [ln for ln in ci.splitlines() if ln.startswith("TEST_CMD=$(")]
    assert len(lines) == 1, lines
    assert re.search(r'^bash -c "\$TEST_CMD"$', ci, re.M), "CI must run the extracted line itself"
    out = subprocess.run(["bash", "-c", lines[0] + '\nprintf "%s" "$TEST_CMD"'], cwd=str(ROOT),
                         capture_output=True, text=True, check=True).stdout
    assert out == readme_command("Run the tests")


def test_readme_documents_the_cuda_size_and_the_cpu_only_install():
    text = (ROOT / "README.md").read_text()
    assert "3 GB" in text and "--index-url https://download.pytorch.org/whl/cpu" in text
