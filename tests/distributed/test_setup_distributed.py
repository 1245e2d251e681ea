"""ColossalAI's positional setup_distributed contract and its traps (docs/design.md, "The ColossalAI contract")."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import dist_optim
from dist_optim import ParamLayout, TPSplit
from dist_optim.plugins.contract import setup_distributed
from dist_optim.testing import grid_groups


# ---- workers (every rank) ----------------------------------------------------------------------
def _working(shape: tuple[int, ...], dim: int | None) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.randn(shape))
    p._test_tp_dim = dim  # read by the reader tests/helpers/parity.py registers
    return p


def setup_traps() -> dict[str, Any]:
    import tests.helpers.parity  # noqa: F401  (registers the test TP reader)

    tg, dg = grid_groups(2, 2)
    out: dict[str, Any] = {}
    # zero_stage=0: ColossalAI passes dp_group with is_zero=False -> no ZeRO layout.
    w = [_working((4, 6), 0), _working((6,), None)]
    opt = dist_optim.DistributedLamb(w)
    setup_distributed(opt, tg, dg, {}, {}, False)
    out["zero0"] = [(opt.layout(p).zero is None, opt.layout(p).tp is not None) for p in w]
    out["dp_group_kept"] = opt.dp_group is dg
    # A ZeRO shard missing from shard_to_working_param.
    chunk = torch.zeros(6)
    opt = dist_optim.DistributedLamb([chunk])
    try:
        setup_distributed(opt, tg, dg, {}, {}, True)
        out["missing"] = "no error"
    except ValueError as e:
        out["missing"] = str(e)
    # A shard whose size does not fit the group it is said to be sharded over.
    work = _working((4, 6), 0)
    chunk = torch.zeros(3)  # 12 local elements over 2 ranks = 6, not 3
    opt = dist_optim.DistributedLamb([chunk])
    try:
        setup_distributed(opt, tg, dg, {id(chunk): work}, {id(work): 0}, True)
        out["size"] = "no error"
    except ValueError as e:
        out["size"] = str(e)
    # Missing padding map entry.
    chunk = torch.zeros(6)
    opt = dist_optim.DistributedLamb([chunk])
    try:
        setup_distributed(opt, tg, dg, {id(chunk): work}, {}, True)
        out["padding"] = "no error"
    except ValueError as e:
        out["padding"] = str(e)
    # bf16 masters without their working params: TP layout unknowable -> warned, not guessed silently.
    master = torch.zeros(2, 6)
    opt = dist_optim.DistributedLamb([master])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        setup_distributed(opt, tg, dg, {}, {}, False)
    out["warned"] = any("master" in str(c.message) for c in caught)
    # ...and with master_to_working the layout is recovered.
    work = _working((2, 6), 0)
    opt = dist_optim.DistributedLamb([master])
    setup_distributed(opt, tg, dg, {}, {}, False, master_to_working={id(master): work})
    out["recovered"] = opt.layout(master).full_shape == (4, 6)
    return out


def colossal_reader() -> list[Any]:
    """ColossalAI's own dtensors: the plugin reader finds the split dim."""
    from colossalai.tensor.d_tensor.api import shard_colwise, shard_rowwise

    import dist_optim.plugins  # noqa: F401  (registers the ColossalAI reader)
    from dist_optim.layout import read_tp_dim

    tg, _ = grid_groups(2, 2)
    rows = shard_rowwise(torch.randn(4, 6), tg)
    cols = shard_colwise(torch.randn(4, 6), tg)
    return [read_tp_dim(rows), read_tp_dim(cols), read_tp_dim(torch.randn(3)), tuple(rows.shape), tuple(cols.shape)]


# ---- tests ---------------------------------------------------------------------------------------
def test_traps(pool4) -> None:
    for res in pool4.run(setup_traps):
        assert res["zero0"] == [(True, True), (True, False)]
        assert res["dp_group_kept"]
        assert "missing from shard_to_working_param" in res["missing"]
        assert "does not match a ZeRO group of size 2" in res["size"]
        assert "padding_map" in res["padding"]
        assert res["warned"]
        assert res["recovered"]


def test_colossal_dtensor_reader(pool4) -> None:
    for res in pool4.run(colossal_reader):
        assert res == [0, 1, None, (2, 6), (4, 3)]


def test_bind_errors() -> None:
    a, b = torch.zeros(4, 6), torch.zeros(3)
    opt = dist_optim.DistributedLamb([a, b])
    with pytest.raises(ValueError, match="parameter #1 .* has no layout"):
        opt.bind({a: ParamLayout((4, 6))})
    with pytest.raises(ValueError, match="local shape"):
        opt.bind({a: ParamLayout((8, 6), TPSplit(0, 2, 0)), b: ParamLayout((4,))})
    opt.bind({a: ParamLayout((8, 6), TPSplit(0, 2, 1)), b: ParamLayout((3,))})
    assert opt.layout(a).tp_offset == 4
