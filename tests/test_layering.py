"""The package's import graph: each layer imports only the layers below it, and no module
imports itself back through another at import time (docs/architecture.md)."""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "stabletrain"
BASE = {"stabletrain.errors", "stabletrain.registry", "stabletrain.topology", "stabletrain.config"}
# who may not import whom (prefixes), with or without a function-level import
FORBIDDEN = {
    "stabletrain.config": ("stabletrain.",),  # but the BASE modules, see below
    "stabletrain.data": ("stabletrain.engine", "stabletrain.build", "stabletrain.run", "stabletrain.cli"),
    "stabletrain.optim": ("stabletrain.engine", "stabletrain.build", "stabletrain.run", "stabletrain.cli"),
    "stabletrain.models": ("stabletrain.engine", "stabletrain.build", "stabletrain.run", "stabletrain.cli"),
    "stabletrain.layers": ("stabletrain.engine", "stabletrain.build", "stabletrain.run", "stabletrain.cli",
                           "stabletrain.models", "stabletrain.optim", "stabletrain.data"),
    "stabletrain.losses": ("stabletrain.engine", "stabletrain.build", "stabletrain.run", "stabletrain.cli"),
    "stabletrain.monitor": ("stabletrain.engine", "stabletrain.build", "stabletrain.run", "stabletrain.cli"),
    "stabletrain.engine": ("stabletrain.models", "stabletrain.data", "stabletrain.optim", "stabletrain.losses",
                           "stabletrain.build", "stabletrain.run", "stabletrain.cli"),
    "stabletrain.analysis": ("stabletrain.engine", "stabletrain.models", "stabletrain.data", "stabletrain.optim",
                             "stabletrain.layers", "stabletrain.build", "stabletrain.run"),
}


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def _imports(path: Path, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("stabletrain"):
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("stabletrain")}
    return out


MODULES = dict(_modules())


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_imports_above_its_layer(name):
    for layer, banned in FORBIDDEN.items():
        if name == layer or name.startswith(layer + "."):
            imported = _imports(MODULES[name], top_level_only=False)
            if layer in BASE:
                imported = {i for i in imported if not any(i == b or i.startswith(b + ".") for b in BASE)}
            bad = sorted(i for i in imported if i.startswith(banned))
            assert not bad, f"{name} imports {bad}, above its layer"


@pytest.mark.parametrize("name", sorted(BASE))
def test_the_base_imports_only_the_base(name):
    imported = {i for i in _imports(MODULES[name], top_level_only=False) if i in MODULES}
    assert imported <= BASE, f"{name} imports {sorted(imported - BASE)}"


def test_no_import_cycle_at_import_time():
    graph = {n: {i for i in _imports(p, top_level_only=True) if i in MODULES and i != n} for n, p in MODULES.items()}
    # a package's __init__ is imported by importing any of its modules: edges to it are real
    state: dict[str, int] = {}

    def visit(n, path):
        state[n] = 1
        for m in graph[n]:
            if state.get(m) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path + [n, m]))
            if m not in state:
                visit(m, path + [n])
        state[n] = 2

    for n in graph:
        if n not in state:
            visit(n, [])
