"""Stand-ins for packages a test converts from but this project does not install (KellerJordan's
``muon``, the NorMuon authors' ``normuon``: neither is on PyPI)."""

from __future__ import annotations

import types
from collections.abc import Iterable


def module_of(name: str, classes: Iterable[type]) -> types.ModuleType:
    """A module ``name`` holding ``classes`` by their names, each naming it as its module, so that
    ``dist_optim.convert`` finds them by the path it registers (``name.ClassName``). Put it in
    ``sys.modules`` under ``name`` for the test (``monkeypatch.setitem``)."""
    mod = types.ModuleType(name)
    for cls in classes:
        cls.__module__ = name
        cls.__qualname__ = cls.__name__
        setattr(mod, cls.__name__, cls)
    return mod
