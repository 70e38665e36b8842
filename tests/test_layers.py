"""The package layers of docs/architecture.md, read from the source (ast, nothing imported):
no package imports one above it, ``streams/policies.py`` sits below every role, and no two
modules import each other, directly or round a circle (lazy imports inside functions count)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "schemas", "agents", "streams", "actor", "learner", "rlstream", "logtools", "localkafka")

#: what each package may import besides itself (docs/architecture.md, "Packages, bottom up")
MAY_IMPORT = {
    "runtime": set(),
    "localkafka": set(),
    "schemas": set(),
    "agents": set(),
    "streams": {"runtime", "schemas", "agents"},
    "actor": {"runtime", "schemas", "streams", "agents"},
    "learner": {"runtime", "schemas", "streams", "agents"},
    "logtools": {"runtime", "schemas", "streams", "agents", "actor", "learner", "rlstream"},
    "rlstream": set(PACKAGES),
}

#: the policy layer: below every role, above the bus
POLICY_LAYER = "streams.policies"
POLICY_LAYER_MAY_IMPORT = ("schemas", "agents", "streams.bus", "streams.topics", "streams.events", "streams.blobcache")

#: upward imports still known (module -> imported prefix), each to be removed by its owner;
#: docs/architecture.md names them. Nothing else may point upward.
KNOWN_UPWARD: set[tuple[str, str]] = set()


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
    """First-party modules ``module`` imports, at module level or lazily."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
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
            if any(mod == m and (t == p or t.startswith(p + ".")) for m, p in KNOWN_UPWARD):
                continue
            bad.append(f"{mod} -> {t}")
    assert not bad, "upward imports: " + ", ".join(sorted(bad))


def test_the_policy_layer_is_below_every_role():
    targets = _graph()[POLICY_LAYER]
    bad = [t for t in targets if not any(t == p or t.startswith(p + ".") for p in POLICY_LAYER_MAY_IMPORT)]
    assert not bad, f"{POLICY_LAYER} imports {sorted(bad)}"
    # and every role and tool that handles policies goes through it
    for user in ("actor.policy_client", "learner.learner", "logtools.subscribe", "logtools.serve",
                 "logtools.rollback", "streams.processors.importance"):
        assert POLICY_LAYER in _graph()[user], f"{user} does not use {POLICY_LAYER}"


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
