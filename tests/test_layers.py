"""The package layers of docs/architecture.md, read from the source (ast, nothing imported):
no package imports one above it, ``streams/policies.py`` sits below every role, and no two
modules import each other, directly or round a circle (lazy imports inside functions and
``if __name__ == "__main__":`` blocks count: an entry point there is an import like any other)."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _layers() -> dict[str, set[str]]:
    """Package -> the packages it may import, read from the table of docs/architecture.md
    ("| `pkg/` | what it holds | `a`, `b` |"; "nothing of ours" or "everything")."""
    table = ARCHITECTURE.read_text().split("## Packages, bottom up", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| `")]
    order = [cells[0].strip().strip("`/") for cells in rows]
    out: dict[str, set[str]] = {}
    for pkg, cells in zip(order, rows):
        may = cells[-1]
        out[pkg] = set(order) - {pkg} if "everything" in may else set(re.findall(r"`([a-z_]+)`", may))
        below = set(order[: order.index(pkg)])
        assert out[pkg] <= below, f"docs/architecture.md: {pkg} may import {sorted(out[pkg] - below)}, listed above it"
    return out


MAY_IMPORT = _layers()
PACKAGES = tuple(MAY_IMPORT)

#: Entry hooks: a package's name that an outside program resolves reaches the composition root
#: (docs/architecture.md): ``faust -A streams worker`` takes ``streams.app``. Nothing else may
#: point upward, ``__main__`` blocks included: entry points live in ``rlstream.entry`` and
#: ``localkafka/__main__.py``.
ENTRY_HOOKS: set[tuple[str, str]] = {("streams", "rlstream.entry")}

#: the policy layer: below every role, above the bus
POLICY_LAYER = "streams.policies"
POLICY_LAYER_MAY_IMPORT = ("config", "schemas", "agents", "streams.bus", "streams.topics", "streams.events",
                           "streams.blobcache")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The first-party module ``name`` denotes (``a.b.c`` may be a name in module ``a.b``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """First-party modules ``module`` imports: at module level, lazily, or in its ``__main__`` block."""
    is_pkg = path.name == "__init__.py"
    out = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".")
                pkg = pkg if is_pkg else pkg[:-1]
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for n in names:
            target = _resolve(n, modules)
            if target is not None and target != module:
                out.add(target)
    return out


@functools.cache
def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def test_no_package_imports_one_above_it():
    bad = []
    for mod, targets in _graph().items():
        pkg = mod.split(".")[0]
        for t in targets:
            tpkg = t.split(".")[0]
            if tpkg == pkg or tpkg in MAY_IMPORT[pkg]:
                continue
            if (mod, t) in ENTRY_HOOKS:
                continue
            bad.append(f"{mod} -> {t}")
    assert not bad, "upward imports: " + ", ".join(sorted(bad))


def test_the_policy_layer_is_below_every_role():
    layer = [m for m in _graph() if m == POLICY_LAYER or m.startswith("streams.policy.")]
    assert len(layer) > 5, layer  # the facade and its modules, one per idea
    allowed = (*POLICY_LAYER_MAY_IMPORT, "streams.policy")
    for module in layer:
        bad = [t for t in _graph()[module] if not any(t == p or t.startswith(p + ".") for p in allowed)]
        assert not bad, f"{module} imports {sorted(bad)}"
    # and every role and tool that handles policies goes through it (the importance processor's
    # loader is injected by wiring: the pure processors import no policy layer)
    for user in ("actor.policy_client", "learner.learner", "logtools.subscribe", "logtools.serve",
                 "logtools.rollback", "rlstream.wiring"):
        assert POLICY_LAYER in _graph()[user], f"{user} does not use {POLICY_LAYER}"
    pure = [m for m in _graph() if m.startswith("streams.processors")]
    assert len(pure) >= 5 and not [m for m in pure if any(t.startswith("streams.polic") for t in _graph()[m])]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_circle():
    assert _cycles(_graph()) == []


def test_the_checks_see_what_they_forbid():
    """The walker finds a circle and an upward import where there is one (so the tests above
    cannot pass for want of seeing anything)."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    modules = _modules()
    assert "rlstream.wiring" in _graph()["rlstream.colocated"]
    assert _imports("learner.x", ROOT / "learner" / "learner.py", modules) >= {"streams.policies", "agents.core"}
    assert MAY_IMPORT["config"] == set() and "config" in MAY_IMPORT["agents"]
    assert "rlstream.entry" in _graph()["streams"]  # the one entry hook is seen, and allowed by name


def test_an_import_in_a_main_block_counts(tmp_path):
    """An entry point's ``__main__`` block is an import like any other: the two circles it made
    (``localkafka.broker`` -> ``localkafka.cli`` -> ``localkafka.broker``; ``streams.worker`` ->
    ``rlstream.entry`` -> ``rlstream.wiring`` -> ``streams.worker``) would be seen."""
    (tmp_path / "broker.py").write_text('import sys\n\nif __name__ == "__main__":\n    from cli import main\n'
                                        '\n    sys.exit(main())\n')
    (tmp_path / "cli.py").write_text("import broker\n")
    modules = {"broker": tmp_path / "broker.py", "cli": tmp_path / "cli.py"}
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert graph == {"broker": {"cli"}, "cli": {"broker"}}
    assert _cycles(graph) == [["broker", "cli"]]
    assert "localkafka.cli" in _graph()["localkafka.__main__"]  # the broker's command line, from the top
    assert "rlstream.entry" not in _graph()["streams.worker"] and "localkafka.cli" not in _graph()["localkafka.broker"]


def test_no_package_imports_the_composition_root():
    """Only ``rlstream`` imports ``rlstream`` (the tools sit below it), the entry hook aside."""
    bad = [f"{m} -> {t}" for m, targets in _graph().items() for t in targets
           if t.split(".")[0] == "rlstream" and m.split(".")[0] != "rlstream" and (m, t) not in ENTRY_HOOKS]
    assert not bad, bad


def _environ_reads(path: Path) -> list[int]:
    """Lines of ``path`` that touch the process environment (``os.environ``, ``os.getenv``,
    ``os.putenv``, ``from os import environ``)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "environb", "getenv", "putenv", "unsetenv"):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in ("environ", "getenv", "environb") for a in node.names):
            lines.append(node.lineno)
    return lines


def test_only_config_reads_the_environment():
    """``config.env.Environment`` is the one reader; everything else gets typed values passed down."""
    bad = []
    for pkg in (*PACKAGES, "bench"):
        for path in (ROOT / pkg).rglob("*.py"):
            if pkg == "config":
                continue
            bad += [f"{path.relative_to(ROOT)}:{n}" for n in _environ_reads(path)]
    assert not bad, "environment read outside config/: " + ", ".join(bad)
    assert _environ_reads(ROOT / "config" / "env.py"), "the checker sees config's own read"


def test_importing_the_faust_app_touches_neither_network_nor_disk(tmp_path):
    """``import streams.faust_app`` (and the rest of the streams package) opens no socket and
    writes no file, with an unreachable broker configured; an audit hook records any try."""
    probe = (
        "import sys\n"
        "seen = []\n"
        "def hook(event, args):\n"
        "    if event == 'socket.connect' or (event == 'open' and len(args) > 1 and args[1] and\n"
        "            any(c in str(args[1]) for c in 'wax+')):\n"
        "        seen.append((event, str(args[0])[:200]))\n"
        "sys.addaudithook(hook)\n"
        "import streams.faust_app, streams.worker, streams.settings\n"
        "assert not hasattr(streams.faust_app, 'app'), 'an app was built at import'\n"
        "print(repr(seen))\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(tmp_path), "KAFKA_BROKERS": "127.0.0.1:1",
           "RLSTREAM_CONFIG": str(tmp_path / "missing.json"), "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = [e for e in ast.literal_eval(out.stdout.strip().splitlines()[-1])
            if not e[1].startswith(("/dev/", "/proc/", "/sys/"))]  # library probes of the machine
    assert seen == [], seen
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())


#: Where the roles and components are defined: every class of these modules is built by
#: ``rlstream/wiring.py`` alone (the composition root; docs/architecture.md).
COMPONENT_MODULES = ("actor", "learner", "streams.worker", "streams.faust_app", "streams.shell",
                     "streams.processors", "streams.policy", "streams.blobcache", "streams.offsets",
                     "streams.events")


def _component_classes(root: Path = ROOT) -> set[str]:
    """Names of the classes defined in ``COMPONENT_MODULES`` under ``root``."""
    out = set()
    for mod in COMPONENT_MODULES:
        base = root.joinpath(*mod.split("."))
        paths = sorted(base.rglob("*.py")) if base.is_dir() else [base.with_suffix(".py")]
        for path in paths:
            out |= {n.name for n in ast.walk(ast.parse(path.read_text(), str(path))) if isinstance(n, ast.ClassDef)}
    return out


def _constructor_calls(path: Path, classes: set[str]) -> list[str]:
    """``file:line name`` of each call in ``path`` whose dotted callee names one of ``classes``:
    ``Learner(...)``, ``distributed.DataParallel.from_env(...)``, ``CircuitBreaker(...)``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        parts, f = [], node.func
        while isinstance(f, ast.Attribute):
            parts.append(f.attr)
            f = f.value
        if isinstance(f, ast.Name):
            parts.append(f.id)
        if classes & set(parts):
            out.append(f"{path.relative_to(path.parents[1])}:{node.lineno} {'.'.join(reversed(parts))}")
    return out


def _rlstream_builders(root: Path = ROOT) -> list[str]:
    classes = _component_classes(root)
    return [hit for path in sorted((root / "rlstream").glob("*.py")) if path.name != "wiring.py"
            for hit in _constructor_calls(path, classes)]


def test_only_wiring_builds_roles_and_components():
    """No module of ``rlstream/`` but ``wiring.py`` calls a role's or a component's constructor
    (``Learner(``, ``Actor(``, ``DataParallel.from_env(``, ``CircuitBreaker(``, the shells):
    the drivers and process bodies ask ``wiring`` for them."""
    classes = _component_classes()
    assert {"Learner", "Actor", "DataParallel", "CircuitBreaker", "PrepareWorker", "StreamsApp", "ShellCore",
            "Prepare", "PolicySubscriber", "LearnerGate"} <= classes
    assert any("DataParallel.from_env" in hit for hit in _constructor_calls(ROOT / "rlstream" / "wiring.py", classes))
    bad = _rlstream_builders()
    assert not bad, "built outside rlstream/wiring.py: " + ", ".join(bad)
