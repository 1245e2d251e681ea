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


def test_modules_and_classes_stay_readable() -> None:
    """Readable sizes: no module of the package over 600 lines, no class over 400."""
    too_long = []
    for path in sorted((ROOT / "dist_optim").rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(ROOT).as_posix()
        if text.count("\n") > 600:
            too_long.append(f"{rel}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text, rel)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 400:
                too_long.append(f"{rel}: class {node.name} {node.end_lineno - node.lineno + 1} lines")
    assert too_long == []


#: Primitives with one home and the only modules that may use them (call them, or name them as an
#: attribute, ``torch._foreach_mul_`` say): an optimizer reaches owners, routes and exchanges through
#: dist_optim.owners alone (one interface, nothing re-written), and scales a list of tensors through
#: dist_optim.multi_tensor.scale_ (torch 2.5.1's CPU ``_foreach_mul_`` by a number rounds it to a
#: bf16/fp16 list's dtype first).
ONE_HOME = {
    "assign_owners": {"dist_optim/placement.py", "dist_optim/owners.py"},
    "plan_route": {"dist_optim/placement.py", "dist_optim/owners.py"},
    "exchange": {"dist_optim/comm.py", "dist_optim/owners.py"},
    "share_owned": {"dist_optim/comm.py", "dist_optim/owners.py"},
    "work_grids": {"dist_optim/owners.py"},
    "work_group": {"dist_optim/owners.py"},
    "_foreach_mul_": {"dist_optim/multi_tensor.py"},
}


def test_one_home_primitives_are_used_only_by_their_modules() -> None:
    uses = []
    for path in sorted((ROOT / "dist_optim").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.Attribute):
                name = node.attr
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                name = node.func.id
            else:
                continue
            if name in ONE_HOME and rel not in ONE_HOME[name]:
                uses.append(f"{rel}:{node.lineno}: {name}")
    assert uses == []
