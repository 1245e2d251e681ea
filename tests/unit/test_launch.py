"""The launcher's start-up hook (plugins/startup/sitecustomize.py) in fresh interpreters: with
``DIST_OPTIM_SWAP=1`` every plugin name of ``colossalai.booster.plugin`` (and of the submodule that
defines it) is dist_optim's drop-in, whichever of the two a script imports first; an environment's
own ``sitecustomize`` still runs; ``python -I`` and a process without the variable keep the stock
classes."""

from __future__ import annotations

import os
import subprocess
import sys

from dist_optim.plugins.autoswap import PLUGINS
from dist_optim.plugins.launch import STARTUP, environment

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))

PROBE = f"""
import importlib, json, os, sys
first = sys.argv[1]
importlib.import_module(first)
plugins = {PLUGINS!r}
out = {{}}
for name, module in plugins.items():
    for where in ("colossalai.booster.plugin", module):
        out[where + "." + name] = getattr(importlib.import_module(where), name).__module__
out["chained"] = os.environ.get("OTHER_SITECUSTOMIZE_RAN")
print(json.dumps(out))
"""


def _probe(env: dict[str, str], first: str = "colossalai.booster.plugin", *flags: str) -> dict[str, str]:
    import json

    done = subprocess.run(
        [sys.executable, *flags, "-c", PROBE, first], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_hook_swaps_every_plugin_and_chains_an_existing_sitecustomize(tmp_path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SITECUSTOMIZE_RAN'] = 'yes'\n")
    base = {**os.environ, "PYTHONPATH": os.pathsep.join([str(other), ROOT])}
    for first in ("colossalai.booster.plugin", "dist_optim.plugins"):
        seen = _probe(environment(base), first)
        assert seen.pop("chained") == "yes", "the shadowed sitecustomize did not run"
        assert set(seen.values()) == {"dist_optim.plugins"}, (first, seen)
    stock = _probe(base)
    assert stock.pop("chained") == "yes"
    assert "dist_optim.plugins" not in stock.values(), stock
    isolated = _probe(environment(base), "colossalai.booster.plugin", "-I")  # -I: no PYTHONPATH, stock
    assert "dist_optim.plugins" not in isolated.values(), isolated


def test_the_launcher_puts_the_hook_first_and_refuses_a_missing_command() -> None:
    env = environment({"PYTHONPATH": "/somewhere"}, cpu=True)
    assert env["PYTHONPATH"].split(os.pathsep) == [STARTUP, "/somewhere"]
    assert env["DIST_OPTIM_SWAP"] == "1" and env["DIST_OPTIM_CPU"] == "1"
    assert sorted(os.listdir(STARTUP)) in (["sitecustomize.py"], ["__pycache__", "sitecustomize.py"])
    done = subprocess.run(
        [sys.executable, "-m", "dist_optim.plugins.launch", "no-such-command-xyz"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2 and "command 'no-such-command-xyz' not found on PATH" in done.stderr, done.stderr
