"""ColossalAI's positional setup_distributed contract and its traps (docs/design.md, "The ColossalAI contract")."""

from __future__ import annotations

import pytest
import torch

import dist_optim
from dist_optim import ParamLayout, TPSplit
from tests.helpers import dist_cases


def test_traps(pool4) -> None:
    for res in pool4.run(dist_cases.setup_traps):
        assert res["zero0"] == [(True, True), (True, False)]
        assert res["dp_group_kept"]
        assert "missing from shard_to_working_param" in res["missing"]
        assert "does not match a ZeRO group of size 2" in res["size"]
        assert "padding_map" in res["padding"]
        assert res["warned"]
        assert res["recovered"]


def test_colossal_dtensor_reader(pool4) -> None:
    for res in pool4.run(dist_cases.colossal_reader):
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


def test_gemini_and_fsdp_refuse_layout_dependent_optimizers(pool2) -> None:
    for res in pool2.run(dist_cases.refusals):
        for key, msg in res.items():
            assert "cannot run" in msg and "LowLevelZeroPlugin" in msg, (key, msg)
