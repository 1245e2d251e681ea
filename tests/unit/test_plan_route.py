"""placement.plan_route against the algorithm it replaced, on TP x DP layouts with and without ZeRO.

plan_route used to list every piece of the work group (every block against every holder's box)
and keep a rank's own; it now finds only the pieces of the rank's own boxes and of the blocks it
owns. The routes must be the same, piece for piece and in the same order: both ends of an
all_to_all list a piece at the same place. :func:`_reference_route` is the earlier algorithm,
kept here as the specification (with every block compared against every box)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import pytest

from dist_optim.layout import Box, ParamLayout, TPSplit, ZeroShard, box_numel
from dist_optim.sharding.placement import BlockPiece, LocalPiece, Route, assign_owners, plan_route


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def _relative(inner: Box, outer: Box) -> tuple[slice, ...]:
    return tuple(slice(lo - o0, hi - o0) for (lo, hi), (o0, _) in zip(inner, outer))


def _reference_route(
    blocks: Sequence[Box], owners: Sequence[int], holdings: Sequence[Sequence[tuple[Box, int]] | None], me: int
) -> Route | None:
    """The earlier plan_route: every (block, holder set, box) that meets, filtered for ``me``."""
    if any(h is None for h in holdings):
        return None
    sets: dict[tuple[tuple[Box, int], ...], list[int]] = {}
    for rank, held in enumerate(holdings):
        sets.setdefault(tuple(held), []).append(rank)  # type: ignore[arg-type]
    distinct = list(sets.items())
    boxes = [box for held, _ in distinct for box, _ in held]
    if sum(box_numel(b) for b in boxes) != sum(box_numel(b) for b in blocks):
        return None
    if any(_intersect(a, b) is not None for a, b in itertools.combinations(boxes, 2)):
        return None
    pieces = []
    for si, (held, _) in enumerate(distinct):
        for k, (box, _) in enumerate(held):
            for bi, block in enumerate(blocks):
                inter = _intersect(block, box)
                if inter is not None:
                    pieces.append((bi, si, k, inter))
    pieces.sort(key=lambda pc: pc[:3])
    route = Route(owned=[bi for bi, owner in enumerate(owners) if owner == me])
    for bi, si, k, inter in pieces:
        owner, block = owners[bi], blocks[bi]
        held, members = distinct[si]
        box, offset = held[k]
        source = owner if owner in members else members[owner % len(members)]
        if owner != me and source != me and me not in members:
            continue
        local = LocalPiece(offset, tuple(hi - lo for lo, hi in box), _relative(inter, box))
        mine = BlockPiece(bi, _relative(inter, block))
        if source == me:
            route.gather_send.setdefault(owner, []).append(local)
        if owner == me:
            route.gather_recv.setdefault(source, []).append(mine)
            for member in members:
                route.scatter_send.setdefault(member, []).append(mine)
        if me in members:
            route.scatter_recv.setdefault(owner, []).append(local)
    return route


def _grid_layouts(shape: tuple[int, ...], tp_dim: int | None, tp: int, dp: int, zero: bool) -> list[ParamLayout]:
    """The layouts of the members of a TP x DP grid (TP fastest), as the plugins bind them."""
    out = []
    for d, t in itertools.product(range(dp), range(tp)):
        split = TPSplit(tp_dim, tp, t) if tp_dim is not None and tp > 1 else None
        local = box_numel(tuple((0, s) for s in shape)) // (tp if split else 1)
        out.append(ParamLayout(shape, split, ZeroShard(dp, d, (-local) % dp) if zero else None))
    return out


def _blocks(shape: tuple[int, ...], side: int) -> list[Box]:
    per_dim = [[(s, min(s + side, d)) for s in range(0, d, side)] for d in shape]
    return list(itertools.product(*per_dim))


@pytest.mark.parametrize(
    "shape,tp_dim,tp,dp,zero",
    [
        ((64, 48), 0, 4, 8, True),  # Llama's column-parallel weights under ZeRO-1
        ((48, 64), 1, 4, 8, True),  # row-parallel
        ((40, 24), None, 4, 4, True),  # replicated over TP (norms, unsplit weights): TP replicas
        ((40, 24), 0, 2, 3, False),  # no ZeRO: data-parallel replicas of each TP slice
        ((37, 11), None, 1, 6, True),  # rows cut unevenly, ZeRO padding
        ((3, 10, 6), 1, 2, 4, True),  # a 3-d tensor
        ((101,), None, 2, 5, True),  # a vector
        ((8, 8), None, 1, 1, False),  # one rank
    ],
)
@pytest.mark.parametrize("side", [5, 16, 1000])
@pytest.mark.parametrize("owned_by", ["balanced", "random", "reversed blocks"])
def test_routes_equal_the_earlier_algorithms(
    shape: tuple[int, ...], tp_dim: int | None, tp: int, dp: int, zero: bool, side: int, owned_by: str
) -> None:
    layouts = _grid_layouts(shape, tp_dim, tp, dp, zero)
    view = shape
    blocks = _blocks(view, side)
    if owned_by == "reversed blocks":  # not the row-major grid: no bisection over the blocks
        blocks = blocks[::-1]
    size = len(layouts)
    if owned_by == "random":
        gen = random.Random(hash((shape, side, size)))
        owners = [gen.randrange(size) for _ in blocks]
    else:
        owners = assign_owners([box_numel(b) for b in blocks], size)
    holdings = [lay.local_boxes(view) for lay in layouts]
    for me in range(size):
        expected = _reference_route(blocks, owners, holdings, me)
        assert expected is not None
        assert plan_route(blocks, owners, holdings, me) == expected, me


def test_routes_refuse_what_the_earlier_algorithm_refused() -> None:
    """Holdings that overlap, leave a gap, or are not boxes (None): no route, as before."""
    whole, half = ParamLayout((4, 6)), ParamLayout((4, 6), TPSplit(0, 2, 1))
    blocks = _blocks((4, 6), 2)
    for holdings in (
        [whole.local_boxes((4, 6)), half.local_boxes((4, 6))],
        [half.local_boxes((4, 6)), half.local_boxes((4, 6))],
        [half.local_boxes((24,)), half.local_boxes((4, 6))],
    ):
        for me in range(2):
            assert _reference_route(blocks, [0, 1] * 3, holdings, me) is None
            assert plan_route(blocks, [0, 1] * 3, holdings, me) is None
