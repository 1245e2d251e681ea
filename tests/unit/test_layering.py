"""The dependency direction of docs/architecture.md, checked on the sources' imports (statements,
and ``importlib.import_module`` / ``__import__`` of a literal name): ``bench/``, ``recipes/``,
``dist_optim/`` and ``plugins/`` never import ``tests`` (what the tests share with them is
``dist_optim.testing``), the package never imports ``bench``, no module of the package outside
``dist_optim/testing/`` imports ``dist_optim.testing``, and the core (``dist_optim/`` less the
planner and the test support, which sit beside the plugins) imports neither ColossalAI nor the
plugins, nor reads ColossalAI's tensor attributes."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _package_of(path: Path) -> list[str]:
    """The package a file's relative imports start from, by its installed name (``plugins/`` installs
    as ``dist_optim.plugins``)."""
    parts = list(path.relative_to(ROOT).parent.parts)
    return ["dist_optim", *parts] if parts[:1] == ["plugins"] else parts


#: Calls that import a module named by their first argument.
DYNAMIC_IMPORTS = {"import_module", "__import__"}


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-local and relative imports included, and
    ``importlib.import_module`` / ``__import__`` of a literal name)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in DYNAMIC_IMPORTS and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
        elif isinstance(node, ast.Import):
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


#: The core: what an optimizer is built of. The planner and the test support run ColossalAI's code
#: (the planner simulates its plugins; the pools preload them), like the plugins themselves.
CORE_SKIPS = ("dist_optim/plan/", "dist_optim/testing/")


def _core_offenders(banned: tuple[str, ...]) -> list[str]:
    return [f for f in _offenders(["dist_optim"], banned) if not f.startswith(CORE_SKIPS)]


def test_the_core_knows_no_colossalai() -> None:
    assert _core_offenders(("colossalai", "dist_optim.plugins")) == []
    readers = [
        path.relative_to(ROOT).as_posix()
        for path in sorted((ROOT / "dist_optim").rglob("*.py"))
        if "dist_layout" in path.read_text() and not path.relative_to(ROOT).as_posix().startswith(CORE_SKIPS)
    ]
    assert readers == []


def test_dynamic_imports_are_seen() -> None:
    """The check above would miss a module loaded by name if _imports did not read such calls."""
    source = "import importlib\nimportlib.import_module('dist_optim.plugins')\n__import__('colossalai')\n"
    path = ROOT / "runs" / "layering_probe.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(source)
    try:
        assert {"dist_optim.plugins", "colossalai"} <= _imports(path)
    finally:
        path.unlink()


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


#: The package's layers, lowest first (docs/architecture.md): a module imports from its own folder
#: and from lower layers only. The optimizers never import each other; the test support, the plugins
#: and the planner sit above them all.
LAYERS: dict[str, int] = {
    **dict.fromkeys(["layout", "checks", "kernels"], 0),  # what a piece is; option checks; local numerics
    "comm": 1,  # every collective
    **dict.fromkeys(["sharding", "states", "nonfinite"], 2),  # owners, owner runtime; state formats; NaN check
    "base": 3,  # the one optimizer class
    "registry": 4,  # conversions and the planner's entries
    **dict.fromkeys(["factored", "galore", "kron", "lamb", "muon", "shampoo"], 5),  # the optimizers
    **dict.fromkeys(["testing", "plugins"], 6),  # test support; all that is ColossalAI's
    "plan": 7,  # the planner simulates the plugins
}


def _layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "dist_optim" and len(parts) > 1 and parts[1] in LAYERS else None


def test_the_folders_show_the_layers() -> None:
    """At most 8 modules directly in dist_optim/, every folder and module placed in a layer, and
    every import going down the layers (or within its own folder)."""
    top = sorted(p.name for p in (ROOT / "dist_optim").glob("*.py"))
    assert len(top) <= 8, top
    entries = {p.stem for p in (ROOT / "dist_optim").iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    assert entries - {"__init__"} == set(LAYERS) - {"plugins"}
    upward = []
    for path in sorted((ROOT / "dist_optim").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.name == "__init__.py" and len(rel.parts) == 2:
            continue  # the package's front door re-exports the optimizers
        home = rel.parts[1] if len(rel.parts) > 2 else rel.stem
        for name in _imports(path):
            there = _layer_of(name)
            if there is not None and there != home and LAYERS[there] >= LAYERS[home]:
                upward.append(f"{rel.as_posix()}: {name}")
    assert sorted(set(upward)) == []


#: Primitives with one home and the only modules that may use them (call them, or name them as an
#: attribute, ``torch._foreach_mul_`` say): an optimizer reaches owners, routes and exchanges through
#: dist_optim.sharding.owners alone (one interface, nothing re-written), steps its owner work through
#: dist_optim.sharding.runtime alone, and scales a list of tensors through
#: dist_optim.kernels.multi_tensor.scale_ (torch 2.5.1's CPU ``_foreach_mul_`` by a number rounds it to a
#: bf16/fp16 list's dtype first).
ONE_HOME = {
    "assign_owners": {"dist_optim/sharding/placement.py", "dist_optim/sharding/owners.py"},
    "plan_route": {"dist_optim/sharding/placement.py", "dist_optim/sharding/owners.py"},
    "exchange": {"dist_optim/comm/collectives.py", "dist_optim/sharding/owners.py"},
    "share_owned": {"dist_optim/comm/collectives.py", "dist_optim/sharding/owners.py"},
    "work_grids": {"dist_optim/sharding/owners.py"},
    # a step's owner choreography: the owner runtime's alone
    "to_owners": {"dist_optim/sharding/owners.py", "dist_optim/sharding/runtime.py"},
    "from_owners": {"dist_optim/sharding/owners.py", "dist_optim/sharding/runtime.py"},
    "pipelined": {"dist_optim/sharding/owners.py", "dist_optim/sharding/runtime.py"},
    "route_tasks": {"dist_optim/sharding/owners.py", "dist_optim/sharding/runtime.py"},
    "plan_tasks": {"dist_optim/sharding/owners.py", "dist_optim/sharding/runtime.py"},
    "scatter_results": {"dist_optim/sharding/owners.py", "dist_optim/sharding/runtime.py"},
    "work_group": {"dist_optim/sharding/owners.py"},
    "_foreach_mul_": {"dist_optim/kernels/multi_tensor.py"},
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


def test_an_installed_integration_is_loaded_when_a_split_is_first_read() -> None:
    """The core names no integration, yet a ColossalAI tensor is never read as replicated because
    dist_optim.plugins was not imported: read_tp_dim loads the modules setup.py declares under the
    entry-point group dist_optim.integrations (in a fresh interpreter, nothing imported before)."""
    probe = (
        "import sys, torch\n"
        "from dist_optim.layout import read_tp_dim\n"
        "assert 'dist_optim.plugins' not in sys.modules\n"
        "assert read_tp_dim(torch.zeros(2)) is None\n"
        "print('dist_optim.plugins.colossal' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "True", done.stdout


def test_the_readme_stays_a_newcomer_page() -> None:
    """The README is what it is, the two commands, use, the support table and a few headline claims
    in at most 200 lines; depth goes to docs/."""
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 200, f"README.md has {lines} lines; move depth into docs/"
