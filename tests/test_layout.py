"""The package layout keeps its promises (docs/architecture.md): no module imports another
package's private (``_name``) member, and no module keeps runtime state in a ``global``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "ftkit"


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        package = ".".join(parts[:-1])
        yield path, package, ast.parse(path.read_text())


def _target(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    base = package.split(".")
    if node.level > 1:
        base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def test_no_private_member_is_imported_across_packages():
    found = []
    for path, package, tree in _modules():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            target = _target(node, package)
            if not target.startswith("ftkit"):
                continue
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and target.rpartition(".")[0] != package and target != package:
                    found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} imports {target}.{alias.name}")
    assert found == []


def test_no_module_sets_a_global_at_runtime():
    found = [f"{path.relative_to(ROOT.parent)}:{node.lineno}"
             for path, _, tree in _modules() for node in ast.walk(tree) if isinstance(node, ast.Global)]
    assert found == []


def test_the_checks_see_a_violation(tmp_path):
    """The scan itself works: a cross-package private import and a global are found."""
    tree = ast.parse("from ..control.controller import _dist_info\ndef f():\n    global X\n")
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert _target(imports[0], "ftkit.checkpoint") == "ftkit.control.controller"
    assert any(isinstance(n, ast.Global) for n in ast.walk(tree))
