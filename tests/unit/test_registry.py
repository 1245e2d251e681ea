"""Every optimizer of dist_optim appears in every list that names optimizers (CONTRIBUTING.md,
"Adding an optimizer"): a new optimizer that misses one fails here, naming the list.

The optimizers are those whose modules registered a planner entry (``register_plan``), and they
must be exactly the :class:`~dist_optim.base.DistOptimizer` classes ``dist_optim`` exports."""

from __future__ import annotations

import importlib
import re

import pytest
import torch

import dist_optim
from dist_optim.base import DistOptimizer
from dist_optim.registry import lookup, plan_entries

OURS = {name: entry.target for name, entry in plan_entries().items()}


def _name_of(cls: type) -> str:
    return next(n for n, c in OURS.items() if c is cls)


def test_every_exported_optimizer_registers_a_plan_entry() -> None:
    exported = {
        obj
        for obj in (getattr(dist_optim, n) for n in dist_optim.__all__)
        if isinstance(obj, type) and issubclass(obj, DistOptimizer) and obj is not DistOptimizer
    }
    assert exported == set(OURS.values()), f"exported {exported} != registered {set(OURS.values())}"


def _lists() -> dict[str, set[str]]:
    """Each list, as the set of our optimizers' names it covers."""
    from bench.rows import rows
    from dist_optim.plan import TRANSIENT_OPTIONS
    from recipes import building, compare_optimizers
    from tests.distributed.test_devices import CASES as DEVICE_CASES
    from tests.helpers.cases import FAMILIES, PARITY_CASES

    compared = set()
    for _, name, _ in compare_optimizers.DEFAULT:
        if name in building.OURS:
            compared.add(name)
            continue
        module, attr = name.rsplit(".", 1)
        conversion = lookup(getattr(importlib.import_module(module), attr))
        if conversion is not None:  # an ordinary optimizer the plugins swap for ours
            compared.add(_name_of(conversion.target))
    return {
        "recipes/train.py OURS": set(building.OURS),
        "recipes/compare_optimizers.py DEFAULT": compared,
        "dist_optim/plan TRANSIENT_OPTIONS": set(TRANSIENT_OPTIONS),
        "tests/helpers/cases.py FAMILIES": {_name_of(f.cls) for f in FAMILIES},
        "tests/helpers/cases.py PARITY_CASES": {_name_of(c.cls) for c in PARITY_CASES},
        "tests/distributed/test_devices.py CASES": {_name_of(c.cls) for c in DEVICE_CASES},
        "bench/rows.py": {r.group for r in rows()},
    }


@pytest.mark.parametrize("where", list(_lists()))
def test_every_optimizer_is_in_every_list(where: str) -> None:
    missing = sorted(set(OURS) - _lists()[where])
    assert not missing, f"{where} lacks {missing} (CONTRIBUTING.md, 'Adding an optimizer')"


@pytest.mark.parametrize("cls", [dist_optim.DistributedShampoo, dist_optim.DistributedKron, dist_optim.DistributedMuon])
@pytest.mark.parametrize("bad", ["bf16", torch.int8, 16])
def test_communication_dtype_has_one_rule(cls: type, bad: object) -> None:
    """Every optimizer with a ``communication_dtype`` refuses a bad one through the one check
    (``dist_optim.comm.dtypes.check_communication_dtype``), with its one message."""
    with pytest.raises(ValueError, match=r"^communication_dtype must be one of .*; got " + re.escape(repr(bad)) + "$"):
        cls([torch.nn.Parameter(torch.zeros(4, 3))], lr=1e-3, communication_dtype=bad)
