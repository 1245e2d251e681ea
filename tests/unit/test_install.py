"""A non-editable install imports: the wheel that ``pip wheel .`` builds holds every module of the
source tree (``dist_optim/`` and ``plugins/`` as ``dist_optim.plugins``), and every one of them
imports from the installed copy, in a Python that cannot see the source tree or the editable
install.

The editable install of ``make setup`` serves any module from the source tree through its import
finder, which once hid a wheel without ``dist_optim.shampoo`` and ``dist_optim.plan``. The check
runs ``python -S`` (no site hooks, so no editable finder and no ``.pth`` file) in an empty
directory, with the installed wheel first on ``sys.path`` and the environment's site-packages
(torch, colossalai) after it, and asserts where each module was loaded from.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Not copied into the build: environments, outputs, caches and earlier builds.
COPY_IGNORE = (".git", ".venv", "runs", "build", "dist", "*.egg-info", "__pycache__", ".whl", ".gl")

#: Source folder -> the package its modules install as.
TREES = {"dist_optim": "dist_optim", "plugins": "dist_optim.plugins"}

IMPORT_ALL = """
import importlib, json, sys
modules = json.loads(sys.argv[1])
out = {}
for name in modules:
    out[name] = importlib.import_module(name).__file__
print(json.dumps(out))
"""


def _source_modules() -> list[str]:
    """Every module of the source tree, by the name it has once installed."""
    names = []
    for folder, package in TREES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            names.append(".".join([package, *parts]))
    return names


def test_wheel_holds_and_imports_every_module(tmp_path: Path) -> None:
    # A copy of the sources: setuptools reuses a build/ folder in the tree it builds, whose stale
    # files would hide a package the current setup.py leaves out.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*COPY_IGNORE))
    wheels = tmp_path / "wheels"
    # --no-build-isolation: build with the environment's setuptools (no download, seconds).
    build = ["wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source)]
    subprocess.run(
        [sys.executable, "-m", "pip", *build],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("dist_optim-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        files = [n for n in zf.namelist() if n.endswith(".py")]
    in_wheel = sorted(n[: -len(".py")].replace("/", ".").removesuffix(".__init__") for n in files)
    modules = _source_modules()
    assert in_wheel == sorted(modules), (
        f"the wheel's modules differ from the source tree's: missing {sorted(set(modules) - set(in_wheel))}, "
        f"extra {sorted(set(in_wheel) - set(modules))}"
    )
    assert not any(n.startswith("plugins/") for n in files), "plugins/ must install as dist_optim.plugins"

    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        check=True,
        cwd=tmp_path,
    )
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    path = os.pathsep.join([str(target), *site.getsitepackages()])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    # -S: no site module, so neither the editable install's finder nor any .pth file is loaded;
    # PYTHONPATH then puts the installed wheel ahead of the environment's packages.
    env["PYTHONPATH"] = path
    done = subprocess.run(
        [sys.executable, "-S", "-c", IMPORT_ALL, json.dumps(modules)],
        cwd=empty,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, f"importing the installed wheel failed:\n{done.stderr[-3000:]}"
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    elsewhere = {name: f for name, f in loaded.items() if not str(f).startswith(str(target))}
    assert not elsewhere, f"modules not loaded from the installed wheel: {elsewhere}"
