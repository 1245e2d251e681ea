"""Splitting per-parameter work (preconditioner roots, projections) across data-parallel ranks.

Pure functions: who owns which item (:func:`assign_owners`), and for a tensor held in pieces
(TP slices, ZeRO chunks) whose blocks have owners, which piece goes from which rank to which
(:func:`plan_route`). The owners compute; :func:`dist_optim.comm.share_owned` then gives every
rank every result in one collective, or :func:`dist_optim.comm.exchange` moves just the pieces
each rank needs.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .layout import Box, box_numel

__all__ = ["assign_owners", "plan_route", "Route", "LocalPiece", "BlockPiece"]


def assign_owners(costs: Sequence[float], world_size: int) -> list[int]:
    """Owner rank of each item, balancing the summed cost per rank.

    Greedy longest-processing-time: items in decreasing cost (ties by index) go to the currently
    least-loaded rank (ties by rank). Deterministic, so every rank computes the same assignment
    without communicating; the most loaded rank carries at most 4/3 of the optimum.
    """
    if world_size < 1:
        raise ValueError(f"assign_owners: world_size must be >= 1, got {world_size}")
    owners = [0] * len(costs)
    if world_size == 1:
        return owners
    heap = [(0.0, r) for r in range(world_size)]
    for i in sorted(range(len(costs)), key=lambda i: (-float(costs[i]), i)):
        load, rank = heapq.heappop(heap)
        owners[i] = rank
        heapq.heappush(heap, (load + float(costs[i]), rank))
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


@dataclass(frozen=True)
class BlockPiece:
    """A sub-box ``rel`` of block ``block``."""

    block: int
    rel: tuple[slice, ...]

    def view(self, blocks: Mapping[int, torch.Tensor]) -> torch.Tensor:
        return blocks[self.block][self.rel]


@dataclass
class Route:
    """One rank's part in moving a tensor's blocks to their owners and the owners' results back,
    by rank of the work group: ``gather_send[r]`` are this rank's pieces of rank r's blocks,
    ``gather_recv[r]`` where rank r's pieces go in this rank's blocks, ``scatter_send[r]`` the
    pieces of this rank's blocks that rank r holds, ``scatter_recv[r]`` where they go here. Both
    ends list the pieces in the same order (block, holder set, box)."""

    gather_send: list[list[LocalPiece]]
    gather_recv: list[list[BlockPiece]]
    scatter_send: list[list[BlockPiece]]
    scatter_recv: list[list[LocalPiece]]
    owned: list[int]

    def counts(self) -> dict[str, int]:
        """Elements this rank sends and receives in each direction (for tests and benchmarks)."""

        def total(pieces: list[list[LocalPiece]] | list[list[BlockPiece]]) -> int:
            return sum(math.prod(s.stop - s.start for s in pc.rel) for per_rank in pieces for pc in per_rank)

        names = ("gather_send", "gather_recv", "scatter_send", "scatter_recv")
        return {name: total(getattr(self, name)) for name in names}


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def _relative(inner: Box, outer: Box) -> tuple[slice, ...]:
    return tuple(slice(lo - o0, hi - o0) for (lo, hi), (o0, _) in zip(inner, outer))


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
    sets: dict[tuple[tuple[Box, int], ...], list[int]] = {}
    for rank, held in enumerate(holdings):
        sets.setdefault(tuple(held), []).append(rank)  # type: ignore[arg-type]
    distinct = list(sets.items())
    boxes = [box for held, _ in distinct for box, _ in held]
    if sum(box_numel(b) for b in boxes) != sum(box_numel(b) for b in blocks):
        return None
    if any(_intersect(a, b) is not None for i, a in enumerate(boxes) for b in boxes[i + 1 :]):
        return None
    size = len(holdings)
    route = Route(*([[] for _ in range(size)] for _ in range(4)), owned=[])  # type: ignore[arg-type]
    for bi, (block, owner) in enumerate(zip(blocks, owners)):
        if owner == me:
            route.owned.append(bi)
        for held, members in distinct:
            source = owner if owner in members else members[owner % len(members)]
            for box, offset in held:
                inter = _intersect(block, box)
                if inter is None:
                    continue
                local = LocalPiece(offset, tuple(hi - lo for lo, hi in box), _relative(inter, box))
                mine = BlockPiece(bi, _relative(inter, block))
                if source == me:
                    route.gather_send[owner].append(local)
                if owner == me:
                    route.gather_recv[source].append(mine)
                for member in members:
                    if owner == me:
                        route.scatter_send[member].append(mine)
                    if member == me:
                        route.scatter_recv[owner].append(local)
    return route
