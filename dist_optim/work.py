"""Splitting per-parameter work (preconditioner roots, projections) across data-parallel ranks.

Pure functions: who owns which item. The owners compute; :func:`dist_optim.comm.share_owned`
then gives every rank every result in one collective.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["assign_owners"]


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
