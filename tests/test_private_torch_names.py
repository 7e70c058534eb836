"""Only distamp/torch_compat.py names private torch attributes and modules.

Any other module of distamp that imports a torch module with a private path
component (``torch.utils._pytree``), reaches a private attribute through a
torch name (``torch._foreach_add_``, ``dist.distributed_c10d._get_default_store``)
or reads a private attribute distamp does not define itself on some object
(``ddp._has_rebuilt_buckets``, ``grad._version``) fails here, naming the file,
the line and the name: it goes through the compatibility module, which says
on which torch versions it was checked.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "distamp"
COMPAT = PACKAGE / "torch_compat.py"

# Private names of the standard library that distamp uses (not torch's).
STDLIB_PRIVATE = {
    "_exit": "os._exit: a worker's bootstrap ends without running atexit handlers",
    "_getframe": "sys._getframe: warnings point at the user's line",
    "_actions": "argparse's parser._actions: distrun's --help groups",
}


def _sources() -> list[pathlib.Path]:
    return sorted(path for path in PACKAGE.rglob("*.py") if path != COMPAT)


def _is_private_torch_module(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "torch" and any(part.startswith("_") for part in parts[1:])


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_private_names() -> set[str]:
    """Every private name distamp defines: functions, classes, attributes assigned, keyword and dataclass fields."""
    names: set[str] = set()
    for path in [*_sources(), COMPAT]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return {name for name in names if _private(name)}


def _torch_aliases(tree: ast.Module) -> dict[str, str]:
    """Local names bound to torch modules or objects, with their dotted torch path."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    aliases[alias.asname or "torch"] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


def _chain(node: ast.expr) -> tuple[str | None, list[str]]:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return (node.id if isinstance(node, ast.Name) else None), list(reversed(parts))


def find_private_torch_uses(path: pathlib.Path, defined: set[str]) -> list[str]:
    """``file:line: name`` for each private torch name ``path`` uses."""
    tree = ast.parse(path.read_text())
    aliases = _torch_aliases(tree)
    found = []
    where = path.relative_to(PACKAGE.parent) if path.is_relative_to(PACKAGE.parent) else path.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"{where}:{node.lineno}: import {a.name}" for a in node.names if _is_private_torch_module(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            for alias in node.names:
                if _is_private_torch_module(f"{node.module}.{alias.name}"):
                    found.append(f"{where}:{node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            root, parts = _chain(node)
            if root in aliases:
                found.append(f"{where}:{node.lineno}: {aliases[root]}.{'.'.join(parts)}")
            elif root not in ("self", "cls") and node.attr not in defined and node.attr not in STDLIB_PRIVATE:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)} (not defined by distamp)")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value) and node.args[1].value not in defined):
            found.append(f"{where}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return found


def test_no_module_but_torch_compat_names_a_private_torch_name():
    defined = _defined_private_names()
    found = [use for path in _sources() for use in find_private_torch_uses(path, defined)]
    assert not found, "private torch names outside distamp/torch_compat.py:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import torch\ntorch._foreach_add_(a, b)\n", "torch._foreach_add_"),
        ("import torch.distributed as dist\ndist.distributed_c10d._get_default_store()\n",
         "torch.distributed.distributed_c10d._get_default_store"),
        ("from torch.utils._pytree import tree_map\n", "from torch.utils._pytree import tree_map"),
        ("import torch.distributed.fsdp._fully_shard._fsdp_api\n", "import torch.distributed.fsdp._fully_shard"),
        ("def f(ddp):\n    return ddp._has_rebuilt_buckets\n", "ddp._has_rebuilt_buckets (not defined by distamp)"),
        ("def f(p):\n    return getattr(p, '_unsharded_param', None)\n", "getattr(..., '_unsharded_param')"),
    ],
)
def test_the_scan_finds_each_kind_of_private_use(tmp_path, source, expected):
    path = tmp_path / "probe.py"
    path.write_text(source)
    found = find_private_torch_uses(path, defined=set())
    assert any(expected in use for use in found), found


def test_the_scan_leaves_distamps_own_private_names_and_the_stdlib_alone(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("import os\nclass A:\n    def _own(self):\n        return other._own, os._exit\n")
    found = find_private_torch_uses(path, defined={"_own"})
    assert found == []
