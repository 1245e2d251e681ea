"""Which rank owns which block, and how gradients reach the owners and directions the holders.

Built on the owner mechanism of :mod:`dist_optim.owners` (every collective in
:mod:`dist_optim.comm`):

* :func:`plan_owners`: every parameter's blocks (:func:`~dist_optim.shampoo.blocking.plan_blocks`)
  and their owners in its work group, by the cost model ``sum_k d_k^3``
  (:func:`dist_optim.work.assign_owners`);
* :func:`plan_piece_routes`: for parameters held in pieces (TP slices, ZeRO chunks), which piece
  goes to which owner (:func:`dist_optim.owners.plan_routes`, one ``all_gather_object`` per work
  group);
* :func:`exchange_routed`: gradient pieces to the owners of their blocks, the owners' directions
  back to every rank that holds their pieces (:func:`~dist_optim.owners.to_owners` /
  :func:`~dist_optim.owners.from_owners`: one ``all_to_all`` per work group and direction);
* :class:`Shares`: results computed on their owners handed to every rank of the work group
  (:func:`dist_optim.comm.share_owned`: one ``all_gather`` per work group), for parameters held
  whole (DDP) or gathered whole.

Work groups are always visited in :func:`dist_optim.comm.ordered_groups` order: every rank issues
the same collectives in the same order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..comm import ordered_groups, share_owned, widest_dtype
from ..layout import ParamLayout
from ..owners import from_owners, plan_routes, to_owners
from ..work import Route, assign_owners
from .blocking import Block, plan_blocks

__all__ = ["Plan", "Routed", "Shares", "plan_owners", "plan_piece_routes", "exchange_routed"]


@dataclass
class Plan:
    """A parameter's blocking and the owners of its blocks (ranks of ``work_group``)."""

    full_shape: tuple[int, ...]
    view_shape: tuple[int, ...]
    blocks: list[Block]
    owners: list[int]
    work_group: Any


@dataclass
class Routed:
    """A parameter stepped through :func:`exchange_routed`: its local gradient, then its owned
    blocks' gradients (replaced by their directions), then its local update."""

    group: dict[str, Any]
    p: torch.Tensor
    state: dict[str, Any]
    route: Route
    grad: torch.Tensor
    t: int
    plan: Plan
    layout: ParamLayout
    blocks: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    update: torch.Tensor | None = None


def plan_owners(
    params: Sequence[tuple[tuple[int, ...], dict[str, Any], Any]], size: Callable[[Any], int]
) -> list[Plan]:
    """The :class:`Plan` of each ``(full_shape, param group, work group)``; the blocks of all the
    parameters of a work group (of ``size(work_group)`` ranks) are assigned together, by cost."""
    plans: list[Plan] = []
    by_group: dict[int, list[Plan]] = {}
    for full_shape, group, wg in params:
        view, blocks = plan_blocks(
            tuple(full_shape),
            group["max_preconditioner_dim"],
            group["merge_small_dims"],
            group["skip_preconditioning_dim_size_gt"],
        )
        plan = Plan(tuple(full_shape), view, blocks, [0] * len(blocks), wg)
        plans.append(plan)
        by_group.setdefault(id(wg), []).append(plan)
    for group_plans in by_group.values():
        owners = assign_owners([b.cost for plan in group_plans for b in plan.blocks], size(group_plans[0].work_group))
        i = 0
        for plan in group_plans:
            plan.owners = owners[i : i + len(plan.blocks)]
            i += len(plan.blocks)
    return plans


def plan_piece_routes(layouts: Sequence[ParamLayout], plans: Sequence[Plan]) -> list[Route | None]:
    """Which of this rank's pieces of each parameter go to which block owner, and which pieces of
    the owners' directions come back (:func:`dist_optim.work.plan_route`), for parameters held in
    pieces whose blocks are split over a work group of more than one rank; None where the pieces
    are not boxes of the blocking's view (full gradients are then gathered). Collective: one
    ``all_gather_object`` per work group, every rank of it calling with its own pieces."""
    found: list[Route | None] = [None] * len(plans)
    by_group: dict[int, tuple[Any, list[int]]] = {}
    for i, plan in enumerate(plans):
        by_group.setdefault(id(plan.work_group), (plan.work_group, []))[1].append(i)
    for wg in ordered_groups(entry[0] for entry in by_group.values()):
        members = by_group[id(wg)][1]
        routes = plan_routes(
            [layouts[i] for i in members],
            [plans[i].view_shape for i in members],
            [[b.box for b in plans[i].blocks] for i in members],
            [plans[i].owners for i in members],
            wg,
        )
        for i, route in zip(members, routes):
            found[i] = route
    return found


def exchange_routed(
    routed: Sequence[Routed],
    direction: Callable[..., torch.Tensor | None],
    comm_dtype: torch.dtype | None,
    share_dtype: torch.dtype,
) -> None:
    """Each rank's gradient pieces to the owners of their blocks (one ``all_to_all`` per work
    group, in ``comm_dtype``; None: the widest of the gradients' dtypes), ``direction(state, i, block,
    gradient, group, t)`` on the owner of every block ``i`` of a parameter (the optimizer's state
    of it, its param group and step), the directions' pieces back to every rank that
    holds them (another ``all_to_all``, in ``share_dtype``) into each :attr:`Routed.update`. Owners
    keep no full gradient and nobody assembles a full direction."""
    by_group: dict[int, tuple[Any, list[Routed]]] = {}
    for r in routed:
        by_group.setdefault(id(r.plan.work_group), (r.plan.work_group, []))[1].append(r)
    order = [(wg, by_group[id(wg)][1]) for wg in ordered_groups(entry[0] for entry in by_group.values())]
    for r in routed:
        r.blocks = {i: r.grad.new_empty(r.plan.blocks[i].shape) for i in r.route.owned}
    for wg, members in order:
        _move(wg, members, True, comm_dtype)
    for r in routed:  # each owned block's gradient is replaced by its direction
        for i in r.route.owned:
            d = direction(r.state, i, r.plan.blocks[i], r.blocks[i], r.group, r.t)
            assert d is not None  # no parameter to apply to: always a direction
            r.blocks[i] = d
        r.update = r.grad.new_empty(r.grad.numel())
        r.update[r.layout.valid_numel :].zero_()  # ZeRO padding at the end of the chunk
    for wg, members in order:
        _move(wg, members, False, share_dtype)


def _move(wg: Any, members: list[Routed], gather: bool, dtype: torch.dtype | None) -> None:
    if dtype is None:  # the widest of the parameters' own dtypes: the same on every rank
        dtype = widest_dtype(r.grad for r in members)
    device = members[0].grad.device
    if gather:
        to_owners([(r.route, r.grad.reshape(-1), r.blocks) for r in members], wg, dtype, device)
    else:
        assert all(r.update is not None for r in members)
        from_owners([(r.route, r.blocks, r.update) for r in members], wg, dtype, device)  # type: ignore[misc]


class Shares:
    """Tensors each computed on one owner rank of a work group, to be handed to every rank of it."""

    def __init__(self) -> None:
        self._by_group: dict[int, tuple[Any, list[torch.Tensor], list[int]]] = {}

    def add(self, work_group: Any, tensors: Sequence[torch.Tensor], owners: Sequence[int]) -> None:
        """``tensors`` (final shapes on every rank; the result on their owner) and their owners."""
        entry = self._by_group.setdefault(id(work_group), (work_group, [], []))
        entry[1].extend(tensors)
        entry[2].extend(owners)

    def _in_order(self) -> list[tuple[Any, list[torch.Tensor], list[int]]]:
        return [self._by_group[id(wg)] for wg in ordered_groups(e[0] for e in self._by_group.values())]

    def share_rounded(self, dtype: torch.dtype, my_rank: Callable[[Any], int]) -> None:
        """Share in ``dtype``; owners first round their own tensors the same way, so that every
        rank applies the same values (replicas stay equal)."""
        for wg, tensors, owners in self._in_order():
            if dtype != tensors[0].dtype:
                me = my_rank(wg)
                for d, owner in zip(tensors, owners):
                    if owner == me:
                        d.copy_(d.to(dtype))
            share_owned(tensors, owners, wg, dtype=dtype)

    def share_exact(self) -> None:
        """Share in float64 where any tensor is float64, else float32: state, not rounded."""
        for wg, tensors, owners in self._in_order():
            wide = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
            share_owned(tensors, owners, wg, dtype=wide)
