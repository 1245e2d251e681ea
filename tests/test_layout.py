"""Pure index math of ParamLayout: no processes."""

from __future__ import annotations

import itertools

import pytest
import torch

from dist_optim.layout import ParamLayout, TPSplit, ZeroShard


def _pieces(full: torch.Tensor, tp: int, tp_dim: int | None, dp: int) -> list[tuple[ParamLayout, torch.Tensor]]:
    out = []
    if tp_dim is None:
        tp = 1  # replicated across TP: one copy holds everything
    for t, d in itertools.product(range(tp), range(dp)):
        split = TPSplit(tp_dim, tp, t) if tp_dim is not None and tp > 1 else None
        local_numel = full.numel() // (tp if split else 1)
        zero = ZeroShard(dp, d, (-local_numel) % dp) if dp > 1 else None
        layout = ParamLayout(tuple(full.shape), split, zero)
        out.append((layout, layout.take_local(full)))
    return out


SHAPES = [((8, 6), 0), ((6, 8), -1), ((5, 3), None), ((3, 4, 3), 1), ((2,), None), ((7,), None), ((6, 5), 0)]


@pytest.mark.parametrize("shape,tp_dim", SHAPES)
@pytest.mark.parametrize("tp,dp", [(1, 1), (2, 1), (1, 4), (2, 2), (1, 3)])
def test_chunks_tile_the_full_tensor(shape, tp_dim, tp, dp) -> None:
    if tp_dim is not None and shape[tp_dim] % tp:
        pytest.skip("not divisible")
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape) + 1
    pieces = _pieces(full, tp, tp_dim, dp)
    # Every real element appears exactly once across the pieces; padding is zero.
    seen = torch.cat([p.reshape(-1) for _, p in pieces])
    real = seen[seen != 0]
    assert sorted(real.tolist()) == sorted(full.reshape(-1).tolist())
    for layout, piece in pieces:
        assert piece.numel() == layout.chunk_numel
        assert int((piece != 0).sum()) == layout.valid_numel


@pytest.mark.parametrize("shape,tp_dim", SHAPES)
@pytest.mark.parametrize("tp,dp", [(1, 1), (2, 1), (1, 4), (2, 2), (1, 3)])
def test_full_flat_index_bins_give_full_row_and_col_sums(shape, tp_dim, tp, dp) -> None:
    """Scatter-adding chunks at full_flat_index(drop) reproduces the full tensor's sums over drop."""
    if tp_dim is not None and shape[tp_dim] % tp:
        pytest.skip("not divisible")
    full = torch.randn(shape, dtype=torch.float64)
    for drop in [(), (-1,)] + ([(-2,), (0,)] if len(shape) >= 2 else []):
        reduced = ParamLayout(shape).reduced_shape(drop)
        acc = torch.zeros(torch.Size(reduced).numel(), dtype=torch.float64)
        for layout, piece in _pieces(full, tp, tp_dim, dp):
            idx = layout.full_flat_index(drop)
            mask = idx >= 0
            acc.index_add_(0, idx[mask], piece.reshape(-1)[mask])
        expected = full.sum(dim=drop) if drop else full
        torch.testing.assert_close(acc.reshape(reduced), expected.reshape(reduced))


def test_padding_only_rank() -> None:
    layout = ParamLayout((2,), zero=ZeroShard(4, 3, 2))
    assert layout.chunk_numel == 1 and layout.valid_numel == 0
    assert layout.full_flat_index().tolist() == [-1]


def test_bad_layouts_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot be split"):
        ParamLayout((5, 4), TPSplit(0, 2, 0))
    with pytest.raises(ValueError, match="padding"):
        ParamLayout((5, 4), zero=ZeroShard(3, 0, 0))
    with pytest.raises(ValueError, match="outside"):
        TPSplit(0, 2, 2)
    with pytest.raises(ValueError, match="shape"):
        ParamLayout((4, 4)).take_local(torch.zeros(3, 4))


def test_single_rank_zero_keeps_flat_form() -> None:
    layout = ParamLayout((3, 4), zero=ZeroShard(1, 0, 0))
    assert layout.zero is not None and layout.chunk_numel == 12
    assert layout.sum_groups == ()
    assert layout.take_local(torch.ones(3, 4)).shape == (12,)
