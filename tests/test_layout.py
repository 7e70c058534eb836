"""The package layout: capabilities import the core, never each other, and no import circle.

Read from the source (every ``import`` statement, also inside functions and
``TYPE_CHECKING`` blocks), not from what Python happens to load.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Bottom to top; a module may import its own package and lower layers only.
LAYERS: list[set[str]] = [
    {"torch_compat", "suggest", "user_warning", "model_views"},
    {"strategy"},
    {"distributed"},
    {"scaling"},
    {"core"},
    {"amp", "sharding", "compression"},  # the capabilities: never import one another
    {"optim", "model"},  # the composers: the meta-optimizer and the model wrapper
    {"checkpoint"},
    {"fleet", "launcher", ""},  # "" is distamp/__init__.py
]
LAYER_OF = {area: i for i, areas in enumerate(LAYERS) for area in areas}


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    """``distamp/sharding/flat_state.py`` -> ``distamp.checkpoint.flat_state``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """Each distamp module -> the distamp modules (or packages) it imports."""
    modules = {module_name(p, root): p for p in (root / "distamp").rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                if not base.startswith("distamp"):
                    continue
                for alias in node.names:
                    graph[name].add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
            elif isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names if a.name.startswith("distamp"))
    return graph


def area(module: str) -> str:
    """The top-level package (or module) of ``distamp`` a module belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports that go up a layer, or sideways between two areas of one layer."""
    bad = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            a, b = area(module), area(target)
            if a != b and LAYER_OF[b] >= LAYER_OF[a]:
                bad.append(f"{module} -> {target}")
    return bad


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_every_area_has_a_layer():
    areas = {area(m) for m in import_graph(ROOT)}
    assert areas <= set(LAYER_OF), f"place these in LAYERS: {sorted(areas - set(LAYER_OF))}"


def test_imports_run_down_the_layers_and_never_between_capabilities():
    assert layer_violations(import_graph(ROOT)) == []


def test_no_import_circle():
    assert import_cycles(import_graph(ROOT)) == []


CAPABILITIES = {"amp", "sharding", "compression"}


def capability_imports(graph: dict[str, set[str]], importer: str) -> list[str]:
    """Imports from the area ``importer`` into a capability's package."""
    return sorted(f"{m} -> {t}" for m, targets in graph.items() if area(m) == importer
                  for t in targets if area(t) in CAPABILITIES)


def test_checkpoints_reach_a_capabilitys_state_only_through_the_core():
    # The precision plugin's checkpoint_layout (distamp.core) says where the state lies; no sharding internals.
    assert capability_imports(import_graph(ROOT), "checkpoint") == []


@pytest.fixture
def tree(tmp_path):
    def write(files: dict[str, str]) -> pathlib.Path:
        for rel, text in files.items():
            path = tmp_path / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return tmp_path
    return write


def test_the_checks_find_a_sideways_import_an_upward_one_and_a_circle(tree):
    root = tree({
        "distamp/__init__.py": "",
        "distamp/sharding/__init__.py": "",
        "distamp/sharding/a.py": "from distamp.amp import b\n",
        "distamp/amp/__init__.py": "",
        "distamp/amp/b.py": "def f():\n    from distamp.sharding import a\n",
        "distamp/core/__init__.py": "",
        "distamp/core/c.py": "from ..optim import d\n",
        "distamp/optim/__init__.py": "",
        "distamp/optim/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import distamp.core.c\n",
    })
    graph = import_graph(root)
    assert layer_violations(graph) == [
        "distamp.amp.b -> distamp.sharding.a",
        "distamp.core.c -> distamp.optim.d",
        "distamp.sharding.a -> distamp.amp.b",
    ]
    assert sorted(import_cycles(graph)) == [["distamp.amp.b", "distamp.sharding.a"],
                                            ["distamp.core.c", "distamp.optim.d"]]


def test_the_check_finds_a_checkpoint_module_importing_a_capability(tree):
    root = tree({
        "distamp/__init__.py": "",
        "distamp/checkpoint/__init__.py": "",
        "distamp/checkpoint/save.py": "from distamp.core import plugin\nfrom distamp.sharding import flat_state\n",
        "distamp/core/__init__.py": "",
        "distamp/core/plugin.py": "",
        "distamp/sharding/__init__.py": "",
        "distamp/sharding/flat_state.py": "",
    })
    assert capability_imports(import_graph(root), "checkpoint") == [
        "distamp.checkpoint.save -> distamp.sharding.flat_state"]
