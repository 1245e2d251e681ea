"""Pure index math of ParamLayout: no processes."""

from __future__ import annotations

import itertools

import pytest
import torch

from dist_optim.layout import ParamLayout, TPSplit, ZeroShard, box_numel, range_boxes
from dist_optim.sharding.placement import assign_owners, plan_route


def _cuts(numel: int, size: int, seed: int) -> tuple[int, ...]:
    """Flat-range bounds for ``size`` ranks (FSDP's fragments): cut anywhere, with empty ranges
    (the first rank's always, and repeated cuts)."""
    gen = torch.Generator().manual_seed(seed)
    inner = sorted(torch.randint(0, numel + 1, (size - 2,), generator=gen).tolist()) if size > 2 else []
    return (0, 0, *inner, numel)[: size + 1] if size > 1 else (0, numel)


def _zero(local_numel: int, dp: int, d: int, ragged: bool) -> ZeroShard | None:
    if dp == 1 and not ragged:
        return None
    if ragged:
        return ZeroShard(dp, d, 0, bounds=_cuts(local_numel, dp, local_numel * 7 + dp))
    return ZeroShard(dp, d, (-local_numel) % dp)


def _pieces(
    full: torch.Tensor, tp: int, tp_dim: int | None, dp: int, ragged: bool = False
) -> list[tuple[ParamLayout, torch.Tensor]]:
    out = []
    if tp_dim is None:
        tp = 1  # replicated across TP: one copy holds everything
    for t, d in itertools.product(range(tp), range(dp)):
        split = TPSplit(tp_dim, tp, t) if tp_dim is not None and tp > 1 else None
        local_numel = full.numel() // (tp if split else 1)
        layout = ParamLayout(tuple(full.shape), split, _zero(local_numel, dp, d, ragged))
        out.append((layout, layout.take_local(full)))
    return out


SHAPES = [((8, 6), 0), ((6, 8), -1), ((5, 3), None), ((3, 4, 3), 1), ((2,), None), ((7,), None), ((6, 5), 0)]


@pytest.mark.parametrize("shape,tp_dim", SHAPES)
@pytest.mark.parametrize("tp,dp", [(1, 1), (2, 1), (1, 4), (2, 2), (1, 3)])
@pytest.mark.parametrize("ragged", [False, True], ids=["chunks", "ranges"])
def test_chunks_tile_the_full_tensor(shape, tp_dim, tp, dp, ragged) -> None:
    if tp_dim is not None and shape[tp_dim] % tp:
        pytest.skip("not divisible")
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape) + 1
    pieces = _pieces(full, tp, tp_dim, dp, ragged)
    # Every real element appears exactly once across the pieces; padding is zero.
    seen = torch.cat([p.reshape(-1) for _, p in pieces])
    real = seen[seen != 0]
    assert sorted(real.tolist()) == sorted(full.reshape(-1).tolist())
    for layout, piece in pieces:
        assert piece.numel() == layout.chunk_numel
        assert int((piece != 0).sum()) == layout.valid_numel


@pytest.mark.parametrize("shape,tp_dim", SHAPES)
@pytest.mark.parametrize("tp,dp", [(1, 1), (2, 1), (1, 4), (2, 2), (1, 3)])
@pytest.mark.parametrize("ragged", [False, True], ids=["chunks", "ranges"])
def test_full_flat_index_bins_give_full_row_and_col_sums(shape, tp_dim, tp, dp, ragged) -> None:
    """Scatter-adding chunks at full_flat_index(drop) reproduces the full tensor's sums over drop."""
    if tp_dim is not None and shape[tp_dim] % tp:
        pytest.skip("not divisible")
    full = torch.randn(shape, dtype=torch.float64)
    for drop in [(), (-1,)] + ([(-2,), (0,)] if len(shape) >= 2 else []):
        reduced = ParamLayout(shape).reduced_shape(drop)
        acc = torch.zeros(torch.Size(reduced).numel(), dtype=torch.float64)
        for layout, piece in _pieces(full, tp, tp_dim, dp, ragged):
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


def test_flat_ranges() -> None:
    """A flat-range shard: each rank's unpadded range, empty ones included; bad bounds refused."""
    full = torch.arange(12.0).reshape(3, 4)
    layouts = [ParamLayout((3, 4), zero=ZeroShard(3, r, 0, bounds=(0, 5, 5, 12))) for r in range(3)]
    assert [lay.chunk_range for lay in layouts] == [(0, 5), (5, 5), (5, 12)]
    assert [lay.chunk_numel for lay in layouts] == [lay.valid_numel for lay in layouts] == [5, 0, 7]
    assert layouts[0].gather_widths == (5, 0, 7)
    assert torch.equal(layouts[2].take_local(full), torch.arange(5.0, 12.0))
    assert layouts[1].local_boxes((3, 4)) == [] and layouts[1].full_flat_index().numel() == 0
    with pytest.raises(ValueError, match="non-decreasing"):
        ZeroShard(3, 0, 0, bounds=(0, 6, 5, 12))
    with pytest.raises(ValueError, match="3 non-decreasing"):
        ZeroShard(2, 0, 0, bounds=(0, 5, 5, 12))
    with pytest.raises(ValueError, match="padding 0"):
        ZeroShard(3, 0, 1, bounds=(0, 5, 5, 12))
    with pytest.raises(ValueError, match="end at 11"):
        ParamLayout((3, 4), zero=ZeroShard(3, 0, 0, bounds=(0, 5, 5, 11)))


def test_single_rank_zero_keeps_flat_form() -> None:
    layout = ParamLayout((3, 4), zero=ZeroShard(1, 0, 0))
    assert layout.zero is not None and layout.chunk_numel == 12
    assert layout.sum_groups == ()
    assert layout.take_local(torch.ones(3, 4)).shape == (12,)


# ---- boxes and routes (what Shampoo moves between the holders of pieces and block owners) ------
def _box_slices(box) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in box)


@pytest.mark.parametrize("shape", [(7,), (3, 5), (4, 1, 6), (2, 3, 2, 3)])
def test_range_boxes_are_the_range_in_order(shape) -> None:
    n = torch.Size(shape).numel()
    index = torch.arange(n).reshape(shape)
    for start in range(n + 1):
        for stop in range(start, n + 1):
            boxes = range_boxes(start, stop, shape)
            got = [i for box in boxes for i in index[_box_slices(box)].reshape(-1).tolist()]
            assert got == list(range(start, stop)), (shape, start, stop, boxes)
            assert len(boxes) <= 2 * len(shape) - 1


@pytest.mark.parametrize("shape,tp_dim", SHAPES)
@pytest.mark.parametrize("tp,dp", [(1, 1), (2, 1), (1, 4), (2, 2), (1, 3)])
@pytest.mark.parametrize("ragged", [False, True], ids=["chunks", "ranges"])
def test_local_boxes_locate_every_local_element(shape, tp_dim, tp, dp, ragged) -> None:
    if tp_dim is not None and shape[tp_dim] % tp:
        pytest.skip("not divisible")
    full = torch.randn(shape, dtype=torch.float64)
    for layout, piece in _pieces(full, tp, tp_dim, dp, ragged):
        flat = piece.reshape(-1)
        boxes = layout.local_boxes(shape)
        assert sum(box_numel(b) for b, _ in boxes) == layout.valid_numel
        for box, offset in boxes:
            part = full[_box_slices(box)].reshape(-1)
            assert torch.equal(flat[offset : offset + part.numel()], part)
        merged = (torch.Size(shape).numel(),)  # a view with every dim merged
        if layout.tp is None:
            for box, offset in layout.local_boxes(merged):
                part = full.reshape(-1)[_box_slices(box)]
                assert torch.equal(flat[offset : offset + part.numel()], part)
        elif len(shape) > 1:
            assert layout.local_boxes(merged) is None  # the TP slice is no box of that view


def _route_all(
    full: torch.Tensor, layouts: list[ParamLayout], pieces: list[torch.Tensor], block: int, reverse: bool = False
) -> bool:
    """Plan every member's route, move the pieces as comm.exchange would, and check that each
    owner gets its full blocks and each member gets back exactly its own piece. ``reverse``
    lists the blocks in another order than the row-major grid (plan_route then tries every block
    against every box instead of bisecting)."""
    shape = tuple(full.shape)
    per_dim = [[(s, min(s + block, d)) for s in range(0, d, block)] for d in shape]
    blocks = list(itertools.product(*per_dim))[:: -1 if reverse else 1]
    size = len(layouts)
    owners = assign_owners([box_numel(b) for b in blocks], size)
    holdings = [lay.local_boxes(shape) for lay in layouts]
    routes = [plan_route(blocks, owners, holdings, me) for me in range(size)]
    if any(r is None for r in routes):
        return False
    flats = [p.reshape(-1) for p in pieces]

    def unfilled(i: int) -> torch.Tensor:
        return torch.full(tuple(hi - lo for lo, hi in blocks[i]), float("nan"), dtype=full.dtype)

    def move(send: str, recv: str, sources: list, targets: list) -> None:
        """What exchange() does: rank src's pieces for dst into dst's pieces from src, in order."""
        for src in range(size):
            for dst in range(size):
                sent = [pc.view(sources[src]) for pc in getattr(routes[src], send).get(dst, [])]
                into = [pc.view(targets[dst]) for pc in getattr(routes[dst], recv).get(src, [])]
                assert [t.shape for t in sent] == [t.shape for t in into]
                for a, b in zip(sent, into):
                    b.copy_(a)

    got = [{i: unfilled(i) for i in r.owned} for r in routes]
    move("gather_send", "gather_recv", flats, got)
    for me, r in enumerate(routes):
        assert sorted(r.owned) == [i for i, o in enumerate(owners) if o == me]
        for i in r.owned:
            assert torch.equal(got[me][i], full[_box_slices(blocks[i])])
    back = [torch.full_like(f, float("nan")) for f in flats]
    move("scatter_send", "scatter_recv", got, back)
    for lay, f, b in zip(layouts, flats, back):
        n = lay.valid_numel
        assert torch.equal(b[:n], f[:n]), "a member did not get its own piece back"
        assert torch.isnan(b[n:]).all(), "padding is not sent"
    return True


@pytest.mark.parametrize("shape,tp_dim", SHAPES)
@pytest.mark.parametrize(
    "tp,dp,zero", [(1, 4, True), (2, 2, True), (2, 2, False), (4, 1, False), (1, 3, True), (1, 4, "ranges")]
)
def test_routes_bring_every_block_to_its_owner_and_back(shape, tp_dim, tp, dp, zero) -> None:
    """Members of a TP x DP grid, each holding its TP slice (or the whole tensor if it is
    replicated over TP) and its ZeRO chunk (or all of it without ZeRO), or a flat range of it."""
    if tp_dim is not None and shape[tp_dim] % tp:
        pytest.skip("not divisible")
    full = torch.randn(shape, dtype=torch.float64)
    layouts = []
    for t, d in itertools.product(range(tp), range(dp)):
        split = TPSplit(tp_dim, tp, t) if tp_dim is not None and tp > 1 else None
        local_numel = full.numel() // (tp if split else 1)
        layouts.append(ParamLayout(shape, split, _zero(local_numel, dp, d, zero == "ranges") if zero else None))
    pieces = [lay.take_local(full) for lay in layouts]
    for block in (2, 3, 100):
        assert _route_all(full, layouts, pieces, block)
    assert _route_all(full, layouts, pieces, 2, reverse=True)


def test_routes_refuse_holdings_that_do_not_tile() -> None:
    """Holdings that overlap without being replicas (or leave a gap) get no route."""
    full = torch.randn(4, 6)
    halves = [ParamLayout((4, 6), TPSplit(0, 2, r)) for r in range(2)]
    overlapping = [ParamLayout((4, 6)), halves[1]]  # one holds all, the other half of it
    assert not _route_all(full, overlapping, [lay.take_local(full) for lay in overlapping], 2)
    gap = [halves[0], halves[0]]  # the second half is held by nobody
    assert not _route_all(full, gap, [lay.take_local(full) for lay in gap], 2)


def test_geometry_is_the_layout_without_its_groups() -> None:
    """ParamLayout.geometry: equal to the layout (same hash), the same split and shard, and no
    process group held (a cache keyed by it keeps none alive)."""
    tp_group, zero_group = object(), object()
    layout = ParamLayout((8, 6), TPSplit(0, 2, 1, tp_group), ZeroShard(4, 3, 0, zero_group))
    geometry = layout.geometry
    assert geometry == layout and hash(geometry) == hash(layout)
    assert geometry.tp == layout.tp and geometry.zero == layout.zero
    assert geometry.tp is not None and geometry.tp.group is None
    assert geometry.zero is not None and geometry.zero.group is None
    assert ParamLayout((5,)).geometry == ParamLayout((5,))
