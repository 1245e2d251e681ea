"""dist_optim's start-up hook, put first on ``PYTHONPATH`` by ``python -m dist_optim.plugins.launch``.

Python imports the first ``sitecustomize`` on its path when it starts (not under ``-S``, and not
under ``-I`` or ``-E``, which ignore ``PYTHONPATH``). This one first runs the ``sitecustomize`` it
shadows, so an environment's own keeps working, then arranges, in every process the launcher
starts (``torchrun`` and ``colossalai run`` pass their environment to their workers):

* ``DIST_OPTIM_SWAP=1``: once ``colossalai.booster.plugin`` is imported, its plugin classes are
  dist_optim's drop-ins (``dist_optim.plugins.autoswap``), so an unchanged script's
  ``booster.boost`` swaps and binds our optimizers;
* ``DIST_OPTIM_CPU=1``: once ``colossalai`` is imported, its plugins run on CPU processes with gloo
  (``dist_optim.plugins.cpu``), for trying a script without GPUs.

Nothing heavy is imported here: torch and ColossalAI load when the script imports them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))


def _on(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def _chain() -> None:
    """Run the ``sitecustomize`` this one shadows, if there is one."""
    mine = sys.modules.pop("sitecustomize", None)
    path = sys.path[:]
    sys.path[:] = [p for p in path if os.path.abspath(p or os.curdir) != _HERE]
    try:
        importlib.import_module("sitecustomize")
    except ModuleNotFoundError as exc:
        if exc.name != "sitecustomize":
            raise
    finally:
        sys.path[:] = path
        if mine is not None:
            sys.modules["sitecustomize"] = mine


class _Then(importlib.abc.Loader):
    """A module's own loader, with ``action`` run once the module has executed."""

    def __init__(self, loader: Any, action: Callable[[], None]) -> None:
        self._loader = loader
        self._action = action

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._action()

    def __getattr__(self, name: str) -> Any:  # get_source and the like, for tracebacks
        return getattr(self._loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs an action right after each named module is first imported."""

    def __init__(self, actions: dict[str, Callable[[], None]]) -> None:
        self.actions = actions

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        action = self.actions.pop(fullname, None)
        if action is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Then(spec.loader, action)
                return spec
        return None


def _run_on_cpu() -> None:
    from dist_optim.plugins.cpu import install

    install()


def _import_ours() -> None:
    # dist_optim.plugins imports colossalai.booster.plugin itself; when that import is what brought
    # us here, the swap runs once dist_optim.plugins has finished (its own action below).
    if "dist_optim.plugins" not in sys.modules:
        importlib.import_module("dist_optim.plugins")


def _swap() -> None:
    from dist_optim.plugins.autoswap import apply

    apply()


def install() -> None:
    actions: dict[str, Callable[[], None]] = {}
    if _on("DIST_OPTIM_CPU"):
        actions["colossalai"] = _run_on_cpu
    if _on("DIST_OPTIM_SWAP"):
        actions["colossalai.booster.plugin"] = _import_ours
        actions["dist_optim.plugins"] = _swap
    if actions:
        sys.meta_path.insert(0, _AfterImport(actions))


_chain()
install()
