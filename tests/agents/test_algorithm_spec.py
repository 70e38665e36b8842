"""One spec per algorithm: registered once, joined to its config.algos row, asked instead of names."""

import ast
from pathlib import Path

import torch

from agents.registry import ALGORITHMS, SPECS, algorithm_spec
from agents.vtrace import VTraceConfig, behaviour_weights, importance_weights
from config.algos import ALGO_DEFAULTS

ROOT = Path(__file__).resolve().parents[2]
ALGO_MODULES = {"ppo": "agents.ppo", "grpo": "agents.grpo", "dapo": "agents.dapo", "agro": "agents.agro",
                "tba": "agents.tba", "dpo": "agents.dpo"}
VARIANT_OF = {"dapo": "grpo", "tba": "agro"}  # subclasses: a variant may import its parent


def test_every_spec_joins_its_row_and_class():
    assert set(SPECS) == set(ALGO_DEFAULTS) == set(ALGORITHMS)
    for name, spec in SPECS.items():
        assert spec.algorithm.name == name and spec.defaults is ALGO_DEFAULTS[name]
        assert spec.overlap == ALGO_DEFAULTS[name].overlap
        assert algorithm_spec(name.upper()) is spec


def test_replay_rule_is_the_vtrace_caps_exactly_where_the_config_has_them():
    lr = torch.tensor([-3.0, -0.2, 0.0, 0.4, 2.5, float("nan")])
    for spec in SPECS.values():
        cfg = spec.config()
        rho, c = spec.replay_weights(cfg, lr)
        want = behaviour_weights(cfg, lr)[:2] if isinstance(cfg, VTraceConfig) else importance_weights(lr)[:2]
        assert torch.equal(rho, want[0]) and torch.equal(c, want[1])


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_algorithms_are_siblings():
    """No algorithm imports another's module for a helper (only a variant its parent)."""
    for name, mod in ALGO_MODULES.items():
        path = ROOT / mod.replace(".", "/")
        files = sorted(path.glob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
        allowed = {ALGO_MODULES[VARIANT_OF[name]]} if name in VARIANT_OF else set()
        for f in files:
            others = {m for m in _imports(f) for o, om in ALGO_MODULES.items()
                      if o != name and (m == om or m.startswith(om + "."))}
            assert others <= allowed, (f, others)


def test_wiring_and_learner_core_ask_the_spec_not_the_name():
    for rel in ("rlstream/wiring.py", "learner/core.py"):
        tree = ast.parse((ROOT / rel).read_text())
        names = {n.value for n in ast.walk(tree) if isinstance(n, ast.Compare)
                 for n in ast.walk(n) if isinstance(n, ast.Constant) and n.value in SPECS}
        assert not names, (rel, names)
        assert "VTraceConfig" not in {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}, rel
