"""The TP x DP grid groups over which owner work is split: made once per job, collectively
(:func:`spanning_groups`), found again by their two groups (:func:`grid_of`); :func:`topology_token`
changes wherever a group's answers may.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from .collectives import all_gather_objects
from .groups import group_key, releases

_TORCH_DIST = dist  # ``dist`` itself is rebound inside collectives_through

#: Grid groups made by :func:`spanning_groups`, by their sorted member ranks (made once per job), with
#: the default group they were made under: a re-initialised job makes them again.
_GRIDS: dict[tuple[int, ...], tuple[Any, Any]] = {}

#: Grids whose ranks are in the order of parts partitioned over a data-parallel group, then TP
#: (:func:`grid_of`), by the keys of the two groups, with the default group they were made under.
_GRID_OF: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[Any, Any]] = {}


def topology_token() -> Any:
    """Changes wherever group_size, group_rank, group_key or grid_of may answer otherwise for the same
    groups (a new default group, a grid made, :func:`release_groups`): :mod:`dist_optim.sharding.partition`
    keeps its plans by it. None where not torch.distributed's own (collectives_through; no group)."""
    if dist is not _TORCH_DIST or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.group.WORLD, len(_GRID_OF), releases()


def grid_of(base: Any, tp: Any) -> Any:
    """The grid group :func:`spanning_groups` made of data-parallel group ``base`` and TP group ``tp``
    when every member's rank in it is ``rank(base) * size(tp) + rank(tp)``: the index of the part
    a member keeps of a tensor partitioned over ``(base, tp)`` (:mod:`dist_optim.sharding.partition`), which
    then takes one collective over the grid instead of one per group. None otherwise (no grid made,
    or its ranks in another order)."""
    if base is None or tp is None or not dist.is_available() or not dist.is_initialized():
        return None
    found = _GRID_OF.get((group_key(base), group_key(tp)))
    return found[1] if found is not None and found[0] is dist.group.WORLD else None


def spanning_groups(tp_group: Any, bases: Sequence[Any]) -> list[Any]:
    """For each group in ``bases`` (data-parallel groups of this process), the group of all ranks
    of the grid it spans with ``tp_group``: the union of the TP groups of its members (the TP x DP
    ranks of a pipeline stage), or None where the two are not orthogonal axes of one grid.

    Making process groups is collective over the whole job in torch.distributed: every process
    must call this at the same point (a plugin binding its optimizer), with its own groups. One
    ``all_gather_object`` over the world tells every process every process's groups; all of them
    then create every valid grid in one sorted order, once per job."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return [None] * len(bases)
    tp = tuple(sorted(dist.get_process_group_ranks(tp_group)))
    mine = [(tp, group_key(b)) for b in bases]
    every = all_gather_objects(mine)
    tp_of = {r: pairs[0][0] for r, pairs in enumerate(every) if pairs}

    def span(pair: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple[int, ...] | None:
        a, b = pair
        if any(q not in tp_of for q in b):
            return None
        ranks = tuple(sorted({r for q in b for r in tp_of[q]}))
        return ranks if len(ranks) == len(a) * len(b) else None

    # The ranks of one data-parallel group name the same pair, and the same grid: each distinct
    # pair is spanned and each grid checked once, not once per rank (quadratic in the world size:
    # seconds at 1024 ranks).
    spanned: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[int, ...] | None] = {}
    for pairs in every:
        for pair in pairs:
            if pair not in spanned:
                spanned[pair] = span(pair)
    spans = [[spanned[pair] for pair in pairs] for pairs in every]
    listed = [set(s for s in per_rank if s is not None) for per_rank in spans]
    # A grid is made only if every member names it: then all of them agree on its members.
    named = {s for per_rank in listed for s in per_rank}
    valid = sorted(s for s in named if all(s in listed[q] for q in s))
    world = dist.group.WORLD
    for ranks in valid:
        made = _GRIDS.get(ranks)
        if made is None or made[0] is not world:
            _GRIDS[ranks] = (world, dist.new_group(list(ranks)))
        # A member's grid rank is its place in the sorted ranks (new_group sorts them); where that is
        # r_dp * tp + r_tp for every member, the grid is the two groups in one (grid_of).
        pairs = {q: next(pair for pair, s in zip(every[q], spans[q]) if s == ranks) for q in ranks}
        if all(i == b.index(q) * len(a) + a.index(q) for i, (q, (a, b)) in enumerate(pairs.items())):
            for a, b in set(pairs.values()):
                _GRID_OF[(b, a)] = (world, _GRIDS[ranks][1])
    me = dist.get_rank()
    return [_GRIDS[s][1] if s in valid else None for s in spans[me]]
