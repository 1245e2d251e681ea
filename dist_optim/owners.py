"""Whole tensors on owner ranks: the owner mechanism that Shampoo (blocks of a tensor) and Muon
(one matrix per parameter) share.

Work that needs a whole tensor (a preconditioner block, a Newton-Schulz iteration of a matrix) is
owned by one rank of a *work group*: the parameter's data-parallel (ZeRO) group, or under tensor
parallelism the TP x DP grid that group spans with the TP group (:func:`work_grids`), so that TP
peers split the work instead of repeating it. Owners are chosen by cost
(:func:`dist_optim.work.assign_owners`). A tensor held in pieces (TP slices, ZeRO chunks) then moves
as pieces, each straight from a rank that holds it to the owner of its block and the owner's
result back to every rank that holds that piece:

* :func:`plan_routes`: which piece goes where (:func:`dist_optim.work.plan_route`), from every
  rank's holding, asked in one ``all_gather_object`` per work group (when the optimizer plans, not
  every step);
* :func:`to_owners` / :func:`from_owners`: one ``all_to_all`` per work group and direction for all
  the tensors of a step (:func:`dist_optim.comm.exchange`), in a chosen communication dtype. A
  rank receives its blocks and its pieces of the results: about ``2/size`` of the bytes of
  gathering every full tensor, and nobody holds a full tensor it does not own.

Pure planning here, every collective in :mod:`dist_optim.comm`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .comm import all_gather_objects, exchange, grid_groups, group_key, group_rank, group_size, ordered_groups
from .layout import Box, ParamLayout
from .work import Route, plan_route

__all__ = ["Holding", "holding", "member_layout", "work_grids", "plan_routes", "to_owners", "from_owners"]

#: What a rank tells the others of its work group about its piece of a tensor: the full shape, its
#: TP rank and its ZeRO rank (None where not split that way).
Holding = tuple[tuple[int, ...], "int | None", "int | None"]


def holding(layout: ParamLayout) -> Holding:
    """This rank's :data:`Holding` of a tensor of ``layout``."""
    return (
        layout.full_shape,
        None if layout.tp is None else layout.tp.rank,
        None if layout.zero is None else layout.zero.rank,
    )


def member_layout(layout: ParamLayout, theirs: Holding) -> ParamLayout | None:
    """``layout`` as another rank of the work group holds it (its :func:`holding`); None where
    that rank's layout differs from this one's in more than its TP and ZeRO ranks."""
    full_shape, tp_rank, zero_rank = theirs
    if full_shape != layout.full_shape or (tp_rank is None) != (layout.tp is None):
        return None
    if (zero_rank is None) != (layout.zero is None):
        return None
    tp = None if layout.tp is None else dataclasses.replace(layout.tp, rank=tp_rank)
    zero = None if layout.zero is None else dataclasses.replace(layout.zero, rank=zero_rank)
    return dataclasses.replace(layout, tp=tp, zero=zero)


def work_grids(tp_group: Any, bases: Sequence[Any]) -> dict[tuple[int, ...], Any]:
    """Under TP, the TP x DP grid group of each data-parallel (ZeRO) group in ``bases``, by
    :func:`~dist_optim.comm.group_key` of the base group (only those that form a grid).

    Collective over the whole job (it makes process groups): every process calls it at the same
    point, when its optimizer is bound. Empty without TP."""
    if tp_group is None or group_size(tp_group) <= 1:
        return {}
    ordered = ordered_groups(g for g in bases if g is not None)
    return {group_key(base): grid for base, grid in zip(ordered, grid_groups(tp_group, ordered)) if grid is not None}


def plan_routes(
    layouts: Sequence[ParamLayout],
    views: Sequence[tuple[int, ...]],
    blocks: Sequence[Sequence[Box]],
    owners: Sequence[Sequence[int]],
    group: Any,
) -> list[Route | None]:
    """This rank's :class:`~dist_optim.work.Route` for each tensor of a work group: tensor i has
    ``layouts[i]``, is cut into ``blocks[i]`` (boxes of its full tensor seen in ``views[i]``) with
    owners ``owners[i]`` (ranks of ``group``). None for a tensor whose pieces cannot be routed
    (not boxes of the view, or holdings that do not tile it): the caller gathers it whole.

    Collective over ``group`` (one ``all_gather_object``): every rank of it calls this with the
    same tensors in the same order. If the ranks do not list the same number of tensors, every
    rank sees it and all of them get None everywhere."""
    every = all_gather_objects([holding(layout) for layout in layouts], group=group)
    if any(len(theirs) != len(layouts) for theirs in every):
        return [None] * len(layouts)
    me = group_rank(group)
    routes: list[Route | None] = []
    for i, layout in enumerate(layouts):
        members = [member_layout(layout, theirs[i]) for theirs in every]
        holdings = [None if m is None else m.local_boxes(views[i]) for m in members]
        routes.append(plan_route(blocks[i], owners[i], holdings, me))
    return routes


def to_owners(
    moves: Sequence[tuple[Route, torch.Tensor, Mapping[int, torch.Tensor]]],
    group: Any,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """For each ``(route, local, blocks)``: this rank's pieces of the flat ``local`` tensor go to
    the owners of their blocks, and the blocks this rank owns (``blocks``, by block index, in the
    blocking's view) are filled from the pieces the holders send. One ``all_to_all`` over
    ``group`` in ``dtype`` for all of them; every rank of ``group`` calls it."""
    _move([(r.gather_send, local, r.gather_recv, owned) for r, local, owned in moves], group, dtype, device)


def from_owners(
    moves: Sequence[tuple[Route, Mapping[int, torch.Tensor], torch.Tensor]],
    group: Any,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """The way back of :func:`to_owners`: for each ``(route, blocks, local)`` the owners' results
    (``blocks``) go to every rank that holds a piece of them, into the flat ``local`` tensor. One
    ``all_to_all`` over ``group`` in ``dtype``."""
    _move([(r.scatter_send, owned, r.scatter_recv, local) for r, owned, local in moves], group, dtype, device)


def _move(
    moves: Sequence[tuple[Mapping[int, Sequence[Any]], Any, Mapping[int, Sequence[Any]], Any]],
    group: Any,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    size = group_size(group)
    send: list[list[torch.Tensor]] = [[] for _ in range(size)]
    recv: list[list[torch.Tensor]] = [[] for _ in range(size)]
    for out_pieces, source, in_pieces, target in moves:
        for rank, pieces in out_pieces.items():
            send[rank] += [pc.view(source) for pc in pieces]
        for rank, pieces in in_pieces.items():
            recv[rank] += [pc.view(target) for pc in pieces]
    exchange(send, recv, group, dtype, device)
