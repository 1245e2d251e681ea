"""Whole tensors on owner ranks: the owner mechanism that Shampoo (blocks of a tensor), Muon (one
matrix per parameter) and Kron (one whole parameter) share.

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

Work whose results every rank of the work group needs whole (Kron's factors in its full state,
GaLore's projectors; Kron's directions where no route exists) is assigned and shared with the
same groups:

* :func:`work_group`: the :class:`WorkGroup` of a parameter (its grid, its data-parallel group, its
  TP group, or :data:`ALONE`);
* :func:`assign`: an :class:`Owner` for each item, balancing costs per work group
  (:func:`dist_optim.work.assign_owners`); pure, so every rank computes the same owners;
* :func:`share_results`: the owners' results to every rank of their work groups, one
  ``all_gather`` per work group (:func:`dist_optim.comm.share_owned`), in a chosen dtype.

``None`` as a group. A process group of ``None`` is the default group, the whole job, here as in
:mod:`dist_optim.comm` and ``torch.distributed`` (``comm.group_size(None)`` is the world size). The
only ``None`` that means "no group" is an optimizer's ``dp_group`` / ``tp_group`` attribute when it
was bound without one (:meth:`~dist_optim.base.DistOptimizer.bind`): :func:`work_grids` and
:func:`work_group` read those, and turn "none" into :data:`ALONE` (a work group of one rank, which
issues no collective), so that no size or rank is ever computed from a ``None`` that means "none".

Pure planning here, every collective in :mod:`dist_optim.comm`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .comm import (
    all_gather_objects,
    exchange,
    grid_groups,
    group_key,
    group_rank,
    group_size,
    ordered_groups,
    share_owned,
)
from .layout import Box, ParamLayout
from .work import Route, assign_owners, plan_route

__all__ = [
    "grid_or_data_group",
    "split_size",
    "Holding",
    "holding",
    "member_layout",
    "work_grids",
    "plan_routes",
    "to_owners",
    "from_owners",
    "WorkGroup",
    "ALONE",
    "data_group",
    "work_group",
    "Owner",
    "assign",
    "share_results",
]

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
    tp = None if layout.tp is None or tp_rank is None else dataclasses.replace(layout.tp, rank=tp_rank)
    zero = None if layout.zero is None or zero_rank is None else dataclasses.replace(layout.zero, rank=zero_rank)
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
    # A member's boxes follow from this rank's layout and view (compared without process groups)
    # and the member's holding alone; a model's tensors come in few such kinds (a Llama's 80
    # decoder layers repeat the same ones), so each (kind, holding) is worked out once, not once
    # per tensor and member (at 1024 ranks that was most of the time of planning).
    kinds: dict[tuple[ParamLayout, tuple[int, ...]], int] = {}
    boxes: dict[tuple[int, Holding], list[tuple[Box, int]] | None] = {}
    for i, layout in enumerate(layouts):
        view = tuple(views[i])
        kind = kinds.setdefault((layout, view), len(kinds))
        holdings = []
        for theirs in every:
            key = (kind, theirs[i])
            if key not in boxes:
                m = member_layout(layout, theirs[i])
                boxes[key] = None if m is None else m.local_boxes(view)
            holdings.append(boxes[key])
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


# ---- whole results that every rank of the work group needs ------------------------------------
@dataclasses.dataclass(frozen=True)
class WorkGroup:
    """The ranks that split a set of whole-tensor work (a TP x DP grid, a data-parallel group, a TP
    group) and this rank's place among them: ``size`` ranks, this one ``rank``.

    ``group`` is their process group, read only when ``size > 1`` (a work group of one rank issues
    no collective); there ``None`` would be the default group, as everywhere in dist_optim."""

    group: Any
    size: int
    rank: int

    @classmethod
    def of(cls, group: Any) -> WorkGroup:
        """The work group of the ranks of ``group`` (a process group; None: the whole job);
        :data:`ALONE` when it has one rank."""
        size = group_size(group)
        return cls(group, size, group_rank(group)) if size > 1 else ALONE


#: This rank alone: the work is not split (unbound, or no other rank holds the tensor).
ALONE = WorkGroup(group=None, size=1, rank=0)


def data_group(layout: ParamLayout, dp_group: Any) -> Any:
    """The data-parallel group over which a tensor of ``layout`` is split or replicated: its ZeRO
    group, else the optimizer's ``dp_group`` (None where it was bound without one: none)."""
    return layout.zero.group if layout.zero is not None else dp_group


def grid_or_data_group(layout: ParamLayout, dp_group: Any, grids: Mapping[tuple[int, ...], Any]) -> Any:
    """The process group over which Shampoo and Muon split a tensor's whole-tensor work: the TP x DP
    grid of its :func:`data_group` where :func:`work_grids` made one, else that group (None: the
    work is not split)."""
    base = data_group(layout, dp_group)
    if base is None or not grids:
        return base
    return grids.get(group_key(base), base)


def split_size(group: Any, bound: bool) -> int:
    """How many ranks split the work over ``group``, a result of :func:`grid_or_data_group`: 1 for
    an unbound optimizer or a group of None (the work is not split), else the group's size."""
    return group_size(group) if bound and group is not None else 1


def work_group(layout: ParamLayout, dp_group: Any, tp_group: Any, grids: Mapping[tuple[int, ...], Any]) -> WorkGroup:
    """The ranks that share the whole-tensor work of a tensor of ``layout``: the TP x DP grid of its
    :func:`data_group` (``grids``: from :func:`work_grids`) when it has one, else that data-parallel
    group alone (its TP peers then compute the same results), else, with no data-parallel group, its
    TP group (``layout``'s, or the optimizer's ``tp_group`` for a tensor replicated over TP);
    :data:`ALONE` without either.

    ``dp_group`` / ``tp_group`` are the optimizer's (None: bound without one). A grid is used for
    a TP-split tensor only when its TP group is the optimizer's (the one the grids were made with).
    Every rank that holds pieces of the tensor gets the same ranks."""
    base = data_group(layout, dp_group)
    own_tp = layout.tp.group if layout.tp is not None else tp_group
    if base is not None:
        same_tp = layout.tp is None or (tp_group is not None and group_key(own_tp) == group_key(tp_group))
        grid = grids.get(group_key(base)) if same_tp else None
        return WorkGroup.of(grid if grid is not None else base)
    return WorkGroup.of(own_tp) if own_tp is not None else ALONE


@dataclasses.dataclass(frozen=True)
class Owner:
    """Who computes one item of whole-tensor work: rank ``rank`` of the work group ``work``."""

    work: WorkGroup
    rank: int

    @property
    def mine(self) -> bool:
        """Whether this rank computes the item."""
        return self.rank == self.work.rank

    @property
    def shared(self) -> bool:
        """Whether the result travels to other ranks (the work group has more than this one)."""
        return self.work.size > 1


def _bucket(work: WorkGroup) -> tuple[int, int]:
    # By process group (WorkGroup.of makes a new object per call) and size (ALONE's None is no group).
    return id(work.group), work.size


def assign(items: Sequence[tuple[WorkGroup, float]]) -> list[Owner]:
    """The :class:`Owner` of each ``(work group, cost)`` item: the items of each work group, in
    their order, balanced by cost over its ranks (:func:`~dist_optim.work.assign_owners`).

    Pure: every rank of a work group computes the same owners when it lists the same items in the
    same order with the same costs (from full shapes, never from local ones)."""
    by_group: dict[tuple[int, int], list[int]] = {}
    for i, (work, _) in enumerate(items):
        by_group.setdefault(_bucket(work), []).append(i)
    owners: list[Owner | None] = [None] * len(items)
    for idx in by_group.values():
        work = items[idx[0]][0]
        for i, rank in zip(idx, assign_owners([float(items[i][1]) for i in idx], work.size)):
            owners[i] = Owner(items[i][0], rank)
    return owners  # type: ignore[return-value]


def share_results(results: Sequence[tuple[Owner, Sequence[torch.Tensor]]], dtype: torch.dtype | None = None) -> None:
    """Every rank of each item's work group gets the item's tensors from its owner, in place: one
    ``all_gather`` per work group for all its items (:func:`~dist_optim.comm.share_owned`), work
    groups in the one global order (:func:`~dist_optim.comm.ordered_groups`).

    ``results`` are ``(owner, tensors)``: on the owner the computed tensors, elsewhere tensors of
    the same shapes and dtypes to fill. Collective over every work group of more than one rank
    among them: every rank of a work group lists the same items in the same order. ``dtype`` is
    the communication precision (None: the widest dtype of each work group's tensors); results
    are written back in each tensor's own dtype."""
    by_group: dict[tuple[int, int], tuple[Any, list[torch.Tensor], list[int]]] = {}
    for owner, tensors in results:
        if not owner.shared:
            continue
        _, shared, owners = by_group.setdefault(_bucket(owner.work), (owner.work.group, [], []))
        shared.extend(tensors)
        owners.extend([owner.rank] * len(tensors))
    groups = {id(group): key for key, (group, _, _) in by_group.items()}
    for group in ordered_groups(group for group, _, _ in by_group.values()):
        _, tensors, owners = by_group[groups[id(group)]]
        share_owned(tensors, owners, group, dtype=dtype)
