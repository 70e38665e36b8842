"""bench/ stands on the project and ``bench/common.py`` (read with ast, nothing imported): no
script imports ``tests``, none takes another script's private (``_name``) names, and a sibling
script is imported as ``bench.<name>``, never by its bare name (which works only when bench/ is
the running script's directory)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def bench_import_faults(bench: Path) -> list[str]:
    """``file:line what`` for each import in ``bench/*.py`` that breaks the rules above."""
    scripts = {p.stem for p in bench.glob("*.py")}
    out = []
    for path in sorted(bench.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        siblings: set[str] = set()  # local names bound to a bench module
        for node in ast.walk(tree):
            where = f"{path.name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                for a in node.names:
                    top = a.name.split(".")[0]
                    if top == "tests":
                        out.append(f"{where} imports {a.name}")
                    elif top in scripts:
                        out.append(f"{where} imports the script {a.name} by its bare name")
                    elif a.name.startswith("bench.") and a.asname:
                        siblings.add(a.asname)
            elif isinstance(node, ast.ImportFrom) and not node.level:
                mod = node.module or ""
                top = mod.split(".")[0]
                names = [a.name for a in node.names]
                if top == "tests":
                    out.append(f"{where} imports from {mod}")
                elif top in scripts:
                    out.append(f"{where} imports from the script {mod} by its bare name")
                    out += [f"{where} imports {mod}.{n}, a private name" for n in names if _private(n)]
                elif mod.startswith("bench."):
                    out += [f"{where} imports {mod}.{n}, a private name" for n in names if _private(n)]
                elif mod == "bench":
                    out += [f"{where} imports bench.{n}, a private module" for n in names if _private(n)]
                    siblings |= {a.asname or a.name for a in node.names}
        for node in ast.walk(tree):  # weightsync._pcts through ``from bench import weightsync``
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in siblings and _private(node.attr)):
                out.append(f"{path.name}:{node.lineno} uses {node.value.id}.{node.attr}, a private name")
    return out


def test_bench_imports_neither_tests_nor_private_names():
    assert (ROOT / "bench" / "common.py").exists()
    faults = bench_import_faults(ROOT / "bench")
    assert not faults, "bench/ imports: " + "; ".join(faults)


def test_the_check_sees_each_kind_of_fault(tmp_path):
    (tmp_path / "common.py").write_text("def _helper(): pass\n")
    (tmp_path / "a.py").write_text("from tests.support.s3 import MotoServer\nimport tests.support\n")
    (tmp_path / "b.py").write_text("from bench.a import _ms, public\nfrom common import _helper\n")
    (tmp_path / "c.py").write_text("from bench import a\nimport bench.b as bb\nprint(a._Quiet, bb._x, a.ok)\n")
    (tmp_path / "d.py").write_text("from bench.common import mean_std\nfrom bench import common\nimport json\n")
    assert bench_import_faults(tmp_path) == [
        "a.py:1 imports from tests.support.s3",
        "a.py:2 imports tests.support",
        "b.py:1 imports bench.a._ms, a private name",
        "b.py:2 imports from the script common by its bare name",
        "b.py:2 imports common._helper, a private name",
        "c.py:3 uses a._Quiet, a private name",
        "c.py:3 uses bb._x, a private name",
    ]
