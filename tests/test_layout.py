"""The package's import layout: every import (top level or inside a function) read from the source, so that a
package never imports from one that imports it (an upward arrow: serve -> cli, drafters -> tune or train,
kernels -> models), and no modules import each other in a circle."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

import specdecode

ROOT = Path(specdecode.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(module: str, path: Path, modules: set[str]) -> set[str]:
    """The specdecode modules `module` imports anywhere in its source (a name from a package: the package)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(filter(None, [".".join(package.split(".")[: len(package.split(".")) - node.level + 1]),
                                              node.module]))
            for alias in node.names:
                name = f"{base}.{alias.name}"
                found.add(name if name in modules else base)
    return {name for name in found if name in modules and name != module}


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for path in ROOT.rglob("*.py")}
    return {module: imported(module, path, set(paths)) for module, path in paths.items()}


def package_of(module: str) -> str:
    """specdecode.drafters.eagle -> drafters; specdecode.cli -> cli."""
    return module.split(".")[1]


def test_the_reader_sees_relative_and_function_level_imports():
    graph = import_graph()
    assert "specdecode.drafters.base" in graph["specdecode.drafters.building"]  # from .base import ...
    assert "specdecode.arguments" in graph["specdecode.serve.soak"]  # inside a function
    assert "specdecode.files" in graph["specdecode.models.native.weights"]  # from ...files import


def test_no_package_imports_from_a_package_that_imports_it():
    sorter = graphlib.TopologicalSorter()
    for module, targets in import_graph().items():
        if module == "specdecode":
            continue  # the root re-exports the API
        for target in targets:
            if target != "specdecode" and package_of(target) != package_of(module):
                sorter.add(package_of(module), package_of(target))
    try:
        sorter.prepare()
    except graphlib.CycleError as exc:
        pytest.fail(f"packages import each other: {' -> '.join(exc.args[1])}")


def test_no_import_circle_between_modules():
    sorter = graphlib.TopologicalSorter()
    for module, targets in import_graph().items():
        sorter.add(module, *targets)
    try:
        sorter.prepare()
    except graphlib.CycleError as exc:
        pytest.fail(f"modules import each other: {' -> '.join(exc.args[1])}")
