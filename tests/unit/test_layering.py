"""The dependency direction of docs/architecture.md, checked on the sources' import statements:
``bench/``, ``recipes/``, ``dist_optim/`` and ``plugins/`` never import ``tests`` (what the tests
share with them is ``dist_optim.testing``), the package never imports ``bench``, and no module of
the package outside ``dist_optim/testing/`` imports ``dist_optim.testing``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _package_of(path: Path) -> list[str]:
    """The package a file's relative imports start from, by its installed name (``plugins/`` installs
    as ``dist_optim.plugins``)."""
    parts = list(path.relative_to(ROOT).parent.parts)
    return ["dist_optim", *parts] if parts[:1] == ["plugins"] else parts


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-local and relative imports included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            package = _package_of(path)
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def _offenders(folders: list[str], banned: tuple[str, ...], skip: str | None = None) -> list[str]:
    """``file: module`` for every import of a module under one of ``banned`` in those folders."""
    found = []
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if skip and rel.startswith(skip):
                continue
            bad = sorted(n for n in _imports(path) if any(n == b or n.startswith(b + ".") for b in banned))
            found += [f"{rel}: {name}" for name in bad]
    return found


def test_nothing_outside_tests_imports_tests() -> None:
    assert _offenders(["bench", "recipes", "dist_optim", "plugins"], ("tests",)) == []


def test_the_package_never_imports_bench() -> None:
    assert _offenders(["dist_optim", "plugins"], ("bench",)) == []


def test_the_core_never_imports_dist_optim_testing() -> None:
    assert _offenders(["dist_optim", "plugins"], ("dist_optim.testing",), skip="dist_optim/testing/") == []
