"""Where owner work goes, as pure geometry and scheduling: the layer under :mod:`dist_optim.sharding.owners`.

Pure functions: who owns which item (:func:`assign_owners`), and for a tensor held in pieces
(TP slices, ZeRO chunks) whose blocks have owners, which piece goes from which rank to which
(:func:`plan_route`). The owners compute; :func:`dist_optim.comm.share_owned` then gives every
rank every result in one collective, or :func:`dist_optim.comm.exchange` moves just the pieces
each rank needs.
"""

from __future__ import annotations

import bisect
import contextlib
import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..layout import Box, box_numel

__all__ = ["assign_owners", "recording_owner_loads", "plan_route", "Route", "LocalPiece", "BlockPiece"]

#: Lists that :func:`recording_owner_loads` fills, innermost last.
_LOAD_RECORDERS: list[list[list[float]]] = []


@contextlib.contextmanager
def recording_owner_loads() -> Iterator[list[list[float]]]:
    """Inside the block, every :func:`assign_owners` call appends the summed cost per owner rank
    to the yielded list (how balanced each optimizer's own cost model made its owners): the hook
    the planner reports owner balance with."""
    loads: list[list[float]] = []
    _LOAD_RECORDERS.append(loads)
    try:
        yield loads
    finally:
        _LOAD_RECORDERS.remove(loads)


def assign_owners(costs: Sequence[float], world_size: int) -> list[int]:
    """Owner rank of each item, balancing the summed cost per rank.

    Greedy longest-processing-time: items in decreasing cost (ties by index) go to the currently
    least-loaded rank (ties by rank). Deterministic, so every rank computes the same assignment
    without communicating; the most loaded rank carries at most 4/3 of the optimum.
    """
    if world_size < 1:
        raise ValueError(f"assign_owners: world_size must be >= 1, got {world_size}")
    owners = [0] * len(costs)
    if world_size > 1:
        heap = [(0.0, r) for r in range(world_size)]
        for i in sorted(range(len(costs)), key=lambda i: (-float(costs[i]), i)):
            load, rank = heapq.heappop(heap)
            owners[i] = rank
            heapq.heappush(heap, (load + float(costs[i]), rank))
    if _LOAD_RECORDERS:
        per = [0.0] * world_size
        for cost, owner in zip(costs, owners):
            per[owner] += float(cost)
        _LOAD_RECORDERS[-1].append(per)
    return owners


# ---- moving block pieces between the ranks that hold a tensor and the owners of its blocks ------
@dataclass(frozen=True)
class LocalPiece:
    """A piece of a holder's flat tensor: inside the box of ``box_shape`` whose first element is at
    ``offset``, the sub-box ``rel``."""

    offset: int
    box_shape: tuple[int, ...]
    rel: tuple[slice, ...]

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset : self.offset + math.prod(self.box_shape)].view(self.box_shape)[self.rel]

    @property
    def numel(self) -> int:
        return math.prod(sl.stop - sl.start for sl in self.rel)


@dataclass(frozen=True)
class BlockPiece:
    """A sub-box ``rel`` of block ``block``."""

    block: int
    rel: tuple[slice, ...]

    def view(self, blocks: Mapping[int, torch.Tensor]) -> torch.Tensor:
        return blocks[self.block][self.rel]

    @property
    def numel(self) -> int:
        return math.prod(sl.stop - sl.start for sl in self.rel)


@dataclass
class Route:
    """One rank's part in moving a tensor's blocks to their owners and the owners' results back,
    by rank of the work group (only ranks with something to move are keys): ``gather_send[r]``
    are this rank's pieces of rank r's blocks, ``gather_recv[r]`` where rank r's pieces go in
    this rank's blocks, ``scatter_send[r]`` the pieces of this rank's blocks that rank r holds,
    ``scatter_recv[r]`` where they go here. Both ends list the pieces in the same order (block,
    holder set, box)."""

    gather_send: dict[int, list[LocalPiece]] = field(default_factory=dict)
    gather_recv: dict[int, list[BlockPiece]] = field(default_factory=dict)
    scatter_send: dict[int, list[BlockPiece]] = field(default_factory=dict)
    scatter_recv: dict[int, list[LocalPiece]] = field(default_factory=dict)
    owned: list[int] = field(default_factory=list)


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def _relative(inner: Box, outer: Box) -> tuple[slice, ...]:
    return tuple(slice(lo - o0, hi - o0) for (lo, hi), (o0, _) in zip(inner, outer))


def _disjoint(boxes: Sequence[Box]) -> bool:
    """No two boxes share an element: a sweep along dim 0, so that only boxes overlapping there
    are compared (the holders of one row: a few per TP slice), not all pairs."""
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0] if boxes[i] else (0, 1))
    active: list[Box] = []
    for i in order:
        box = boxes[i]
        start = box[0][0] if box else 0
        active = [a for a in active if (a[0][1] if a else 1) > start]
        if any(_intersect(a, box) is not None for a in active):
            return False
        active.append(box)
    return True


def _block_lookup(blocks: Sequence[Box]) -> Callable[[Box], Iterable[int]]:
    """A function giving the indices of the blocks that can meet a box: by bisection along each
    dim when the blocks are the row-major product of per-dim cuts (Shampoo's blocking), else all."""
    ndim = len(blocks[0]) if blocks else 0
    cuts = [sorted({b[d] for b in blocks}) for d in range(ndim)]
    counts = [len(c) for c in cuts]
    if not blocks or math.prod(counts) != len(blocks) or list(itertools.product(*cuts)) != list(blocks):
        return lambda box: range(len(blocks))
    starts = [[lo for lo, _ in c] for c in cuts]
    strides = [math.prod(counts[d + 1 :]) for d in range(ndim)]

    def meeting(box: Box) -> Iterable[int]:
        ranges = []
        for d, (lo, hi) in enumerate(box):
            first = max(0, bisect.bisect_right(starts[d], lo) - 1)
            ranges.append(range(first, bisect.bisect_left(starts[d], hi)))
        return (sum(i * st for i, st in zip(idx, strides)) for idx in itertools.product(*ranges))

    return meeting


def _box_lookup(boxes: Sequence[Box]) -> Callable[[Box], Iterable[int]]:
    """A function giving the indices of the ``boxes`` that can meet a box: those that start along
    dim 0 less than the tallest box's height before its start and before its end (bisection on
    the sorted starts), so that a block is compared with the holdings of its rows, not all."""
    if not boxes or not boxes[0]:
        return lambda box: range(len(boxes))
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0][0])
    starts = [boxes[i][0][0] for i in order]
    tallest = max(b[0][1] - b[0][0] for b in boxes)

    def meeting(box: Box) -> Iterable[int]:
        lo, hi = box[0]
        return order[bisect.bisect_left(starts, lo - tallest + 1) : bisect.bisect_left(starts, hi)]

    return meeting


#: Distinct holdings with the ranks holding them (a replica set), and each rank's replica set.
_Replicas = tuple[list[tuple[tuple[tuple[Box, int], ...], list[int]]], list[int]]


def _replica_sets(holdings: Sequence[Sequence[tuple[Box, int]]]) -> _Replicas:
    """The distinct holdings in order of their first holder, each with its ranks, and by rank the
    index of its replica set."""
    index: dict[tuple[tuple[Box, int], ...], int] = {}
    distinct: list[tuple[tuple[tuple[Box, int], ...], list[int]]] = []
    set_of: list[int] = []
    for rank, held in enumerate(holdings):
        key = tuple(held)
        si = index.setdefault(key, len(distinct))
        if si == len(distinct):
            distinct.append((key, []))
        distinct[si][1].append(rank)
        set_of.append(si)
    return distinct, set_of


def _pieces_of(
    blocks: Sequence[Box],
    owned: Sequence[int],
    distinct: Sequence[tuple[tuple[tuple[Box, int], ...], list[int]]],
    mine: int,
) -> dict[tuple[int, int, int], Box]:
    """The pieces ``(block, replica set, box) -> their box`` that a rank of replica set ``mine``
    owning the blocks ``owned`` sends or receives, and only those: the pieces of its own set's
    boxes (it may be their source, and it receives their results) and those of the blocks it owns.
    Found from those boxes' and blocks' side, so that a rank's cost follows its own pieces, not
    every piece of the work group (at 1024 ranks, a thousand times more)."""
    found: dict[tuple[int, int, int], Box] = {}
    meeting = _block_lookup(blocks)
    for k, (box, _) in enumerate(distinct[mine][0]):
        for bi in meeting(box):
            inter = _intersect(blocks[bi], box)
            if inter is not None:
                found[(bi, mine, k)] = inter
    if owned:
        located = [(si, k, box) for si, (held, _) in enumerate(distinct) for k, (box, _) in enumerate(held)]
        holders = _box_lookup([box for _, _, box in located])
        for bi in owned:
            for j in holders(blocks[bi]):
                si, k, box = located[j]
                inter = _intersect(blocks[bi], box)
                if inter is not None:
                    found[(bi, si, k)] = inter
    return found


def plan_route(
    blocks: Sequence[Box], owners: Sequence[int], holdings: Sequence[Sequence[tuple[Box, int]] | None], me: int
) -> Route | None:
    """``me``'s :class:`Route` for a tensor cut into ``blocks`` (boxes of its full view) owned by
    ``owners`` (ranks of the work group), whose rank r holds the boxes ``holdings[r]`` (each with
    its offset in r's flat tensor, :meth:`ParamLayout.local_boxes`).

    Ranks holding the same boxes are replicas (TP ranks of a replicated parameter, data-parallel
    ranks without ZeRO): a block owner takes a piece from itself if it is one of them, else from
    the replica at its own index modulo their number, so the sending is spread; every replica
    receives the results. None (take the all-gather path) unless the distinct holdings tile the
    tensor exactly, each element held by one replica set."""
    if any(h is None for h in holdings):
        return None
    distinct, set_of = _replica_sets(holdings)  # type: ignore[arg-type]
    boxes = [box for held, _ in distinct for box, _ in held]
    if sum(box_numel(b) for b in boxes) != sum(box_numel(b) for b in blocks) or not _disjoint(boxes):
        return None
    mine = set_of[me]
    route = Route(owned=[bi for bi, owner in enumerate(owners) if owner == me])
    # In (block, replica set, box) order: both ends of a piece list it at the same place.
    for (bi, si, k), inter in sorted(_pieces_of(blocks, route.owned, distinct, mine).items()):
        owner, block = owners[bi], blocks[bi]
        held, members = distinct[si]
        box, offset = held[k]
        source = owner if set_of[owner] == si else members[owner % len(members)]
        local = LocalPiece(offset, tuple(hi - lo for lo, hi in box), _relative(inter, box))
        piece = BlockPiece(bi, _relative(inter, block))
        if source == me:
            route.gather_send.setdefault(owner, []).append(local)
        if owner == me:
            route.gather_recv.setdefault(source, []).append(piece)
            for member in members:
                route.scatter_send.setdefault(member, []).append(piece)
        if si == mine:
            route.scatter_recv.setdefault(owner, []).append(local)
    return route
