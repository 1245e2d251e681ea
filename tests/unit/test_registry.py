"""The optimizer catalogue (``dist_optim.registry.catalogue``, one entry per optimizer registered by
its package) is what every list of optimizers derives from; the lists that cannot (the tests' and
the benches' own) name every optimizer family (CONTRIBUTING.md, "Adding an optimizer"): a new
optimizer that misses one fails here, naming the list.

The catalogue's classes must be exactly the :class:`~dist_optim.base.DistOptimizer` classes
``dist_optim`` exports."""

from __future__ import annotations

import re

import pytest
import torch

import dist_optim
from dist_optim.base import DistOptimizer
from dist_optim.registry import CatalogueEntry, catalogue

CATALOGUE = catalogue()
#: Each class's family name: the first catalogue name registered for it ("shampoo" for SOAP too).
FAMILY = {e.target: next(n for n, f in CATALOGUE.items() if f.target is e.target) for e in CATALOGUE.values()}


def test_every_exported_optimizer_has_a_catalogue_entry() -> None:
    exported = {
        obj
        for obj in (getattr(dist_optim, n) for n in dist_optim.__all__)
        if isinstance(obj, type) and issubclass(obj, DistOptimizer) and obj is not DistOptimizer
    }
    assert exported == set(FAMILY), f"exported {exported} != catalogued {set(FAMILY)}"


def test_the_lists_of_optimizers_derive_from_the_catalogue() -> None:
    """The recipe's short names, make demo's comparison and the planner's optimizers are the
    catalogue's, with the options, rates and texts its entries give."""
    from dist_optim.plan import COLUMNS, OPTIMIZERS, TRANSIENT_OPTIONS
    from recipes import building, compare_optimizers

    assert building.OURS == {n: (e.target, dict(e.recommended)) for n, e in CATALOGUE.items()}
    demo = {(e.demo.label, e.demo.source or n, e.demo.lr) for n, e in CATALOGUE.items() if e.demo is not None}
    assert demo == set(compare_optimizers.DEFAULT[1:]) and len(compare_optimizers.DEFAULT) == len(demo) + 1
    planned = {n for n, e in CATALOGUE.items() if e.planned}
    assert set(OPTIMIZERS) == set(CATALOGUE) | {"adamw"} and all(OPTIMIZERS[n] is e for n, e in CATALOGUE.items())
    assert COLUMNS == tuple(n for n in OPTIMIZERS if n == "adamw" or n in planned)
    assert TRANSIENT_OPTIONS == {n: e.transient for n, e in OPTIMIZERS.items()} and all(TRANSIENT_OPTIONS.values())


def test_every_catalogued_class_is_planned_and_demonstrated() -> None:
    """Each family reaches the planner and the demo under some name, with a demo row for every
    entry whose class the demo's ordinary optimizers would not reach otherwise."""
    from dist_optim.plan import OPTIMIZERS

    assert {e.target for e in OPTIMIZERS.values()} >= set(FAMILY)
    assert all(e.demo is not None for e in CATALOGUE.values())


def test_builder_options_go_to_the_builder() -> None:
    """split routes the options the param-group builder names to it, the rest to the constructor."""
    galore = CATALOGUE["galore"]
    routed = galore.split({"rank": 4, "update_proj_gap": 5, "lr": 1e-3})
    assert routed == ({"rank": 4, "update_proj_gap": 5}, {"lr": 1e-3})
    muon = CATALOGUE["muon"]
    assert muon.split({"per_head": True, "momentum": 0.9}) == ({"per_head": True}, {"momentum": 0.9})
    assert CatalogueEntry("x", dist_optim.DistributedLamb).split({"per_head": True}) == ({}, {"per_head": True})


def test_a_name_is_catalogued_once() -> None:
    from dist_optim.registry import register_entry

    with pytest.raises(ValueError, match="'lamb' is registered twice"):
        register_entry(CatalogueEntry("lamb", dist_optim.DistributedCAME))


def _lists() -> dict[str, set[str]]:
    """Each list that cannot derive from the catalogue (the tests' and the benches'), as the set of
    optimizer families it covers."""
    from bench.rows import rows
    from tests.distributed.test_devices import CASES as DEVICE_CASES
    from tests.helpers.cases import FAMILIES, PARITY_CASES

    return {
        "tests/helpers/cases.py FAMILIES": {FAMILY[f.cls] for f in FAMILIES},
        "tests/helpers/cases.py PARITY_CASES": {FAMILY[c.cls] for c in PARITY_CASES},
        "tests/distributed/test_devices.py CASES": {FAMILY[c.cls] for c in DEVICE_CASES},
        "bench/rows.py": {r.group for r in rows()},
    }


@pytest.mark.parametrize("where", list(_lists()))
def test_every_optimizer_is_in_every_list(where: str) -> None:
    missing = sorted(set(FAMILY.values()) - _lists()[where])
    assert not missing, f"{where} lacks {missing} (CONTRIBUTING.md, 'Adding an optimizer')"


@pytest.mark.parametrize("cls", [dist_optim.DistributedShampoo, dist_optim.DistributedKron, dist_optim.DistributedMuon])
@pytest.mark.parametrize("bad", ["bf16", torch.int8, 16])
def test_communication_dtype_has_one_rule(cls: type, bad: object) -> None:
    """Every optimizer with a ``communication_dtype`` refuses a bad one through the one check
    (``dist_optim.comm.dtypes.check_communication_dtype``), with its one message."""
    with pytest.raises(ValueError, match=r"^communication_dtype must be one of .*; got " + re.escape(repr(bad)) + "$"):
        cls([torch.nn.Parameter(torch.zeros(4, 3))], lr=1e-3, communication_dtype=bad)
