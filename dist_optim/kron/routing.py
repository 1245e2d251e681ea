"""Who owns each Kron parameter, and how momenta reach the owners and directions the holders.

Built on the owner mechanism of :mod:`dist_optim.owners` (every collective in
:mod:`dist_optim.comm`):

* :func:`owners_of`: one owner per parameter in its work group (the TP x data grid of its ZeRO
  or data-parallel group, :func:`dist_optim.owners.work_group`), balancing
  :func:`~dist_optim.kron.structure.precond_cost` (:func:`dist_optim.owners.assign`);
* :func:`plan_piece_routes`: which of a rank's pieces of a momentum go to the owner and which
  pieces of the direction come back (one box: the whole tensor; one ``all_gather_object`` per
  work group, :func:`dist_optim.owners.plan_routes`);
* :func:`route_inputs` / :func:`route_directions`: pieces to the owners and back, one
  ``all_to_all`` per work group each way (:func:`~dist_optim.owners.to_owners`,
  :func:`~dist_optim.owners.from_owners`);
* :func:`gather_inputs` / :func:`share`: the fallback where no route exists: every rank gathers
  the full momenta (one all_gather per ZeRO/TP group) and receives the owners' full directions
  (one all_gather per work group). The same result, bit for bit in fp32.

Work groups are always visited in :func:`dist_optim.comm.ordered_groups` order: every rank issues
the same collectives in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..comm import gather_full, ordered_groups, widest_dtype
from ..layout import Box, ParamLayout
from ..owners import (
    Owner,
    assign,
    data_group,
    from_owners,
    plan_routes,
    share_results,
    to_owners,
    work_grids,
    work_group,
)
from ..work import Route
from .options import precond_dtype

__all__ = [
    "Item",
    "route_view",
    "owners_of",
    "plan_piece_routes",
    "by_work_group",
    "gather_inputs",
    "route_inputs",
    "hold_direction",
    "route_directions",
    "share",
]

LayoutOf = Callable[[torch.Tensor], ParamLayout]


@dataclass(eq=False)
class Item:
    """One parameter's step: its inputs and, as they come, the route, the owner's whole inputs,
    the owner's whole direction and this rank's direction (whole, or its local piece when
    routed)."""

    group: dict[str, Any]
    p: torch.Tensor
    m: torch.Tensor
    g: torch.Tensor
    route: Route | None = None
    full_m: torch.Tensor | None = None
    full_g: torch.Tensor | None = None
    owned: torch.Tensor | None = None
    direction: torch.Tensor | None = None

    def fit_inputs(self) -> list[torch.Tensor]:
        """The tensors the owner needs whole: the momentum, and the gradient where the
        preconditioner is fitted to it."""
        return [self.m] if self.group["momentum_into_precond_update"] else [self.m, self.g]


def route_view(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a parameter is routed in: its full shape (a scalar as one element)."""
    return tuple(shape) or (1,)


def _whole_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


def owners_of(
    params: Sequence[torch.Tensor],
    layouts: Sequence[ParamLayout],
    costs: Sequence[float],
    dp_group: Any,
    tp_group: Any,
) -> dict[torch.Tensor, Owner]:
    """Every parameter's owner in its work group, by cost. Collective over the job under TP (the
    grids are process groups)."""
    grids = work_grids(tp_group, [data_group(lay, dp_group) for lay in layouts])
    items = [(work_group(layout, dp_group, tp_group, grids), cost) for layout, cost in zip(layouts, costs)]
    return dict(zip(params, assign(items)))


def plan_piece_routes(
    owners: Mapping[torch.Tensor, Owner], layout_of: LayoutOf, route_pieces: bool
) -> dict[torch.Tensor, Route | None]:
    """The route of every parameter with a shared owner (all of them unless ``route_pieces`` is
    False); a parameter missing from the result, or with None (holdings that do not tile the
    tensor), takes the gathering path."""
    by_group: dict[int, tuple[Any, list[torch.Tensor]]] = {}
    for p, owner in owners.items():
        if route_pieces and owner.shared:
            by_group.setdefault(id(owner.work.group), (owner.work.group, []))[1].append(p)
    routes: dict[torch.Tensor, Route | None] = {}
    for group in ordered_groups(entry[0] for entry in by_group.values()):
        params = by_group[id(group)][1]
        layouts = [layout_of(p) for p in params]
        views = [route_view(lay.full_shape) for lay in layouts]
        found = plan_routes(
            layouts,
            views,
            [[_whole_box(view)] for view in views],
            [[owners[p].rank] for p in params],
            group,
        )
        routes.update(zip(params, found))
    return routes


def by_work_group(
    work: Sequence[Item], routes: Mapping[torch.Tensor, Route | None], owners: Mapping[torch.Tensor, Owner]
) -> tuple[list[Item], list[tuple[Any, list[Item]]]]:
    """Sets each item's route; returns the items without one (the gathering path) and the routed
    ones per work group, in the order every rank walks the groups."""
    routed: dict[int, tuple[Any, list[Item]]] = {}
    plain: list[Item] = []
    for item in work:
        item.route = routes.get(item.p)
        if item.route is None:
            plain.append(item)
        else:
            owner_group = owners[item.p].work.group
            routed.setdefault(id(owner_group), (owner_group, []))[1].append(item)
    return plain, [routed[id(wg)] for wg in ordered_groups(entry[0] for entry in routed.values())]


def gather_inputs(items: Sequence[Item], layout_of: LayoutOf, comm_dtype: torch.dtype | None) -> None:
    """The fallback: every rank gathers the full momentum (and gradient) of ``items`` (one
    all_gather per ZeRO/TP group; a whole local tensor is used as it is)."""
    if not items:
        return
    tensors = [(layout_of(it.p), t) for it in items for t in it.fit_inputs()]
    dtype = comm_dtype or widest_dtype(t for _, t in tensors)
    fulls = iter(gather_full(tensors, dtype=dtype))
    for it in items:
        it.full_m = next(fulls)
        it.full_g = it.full_m if it.group["momentum_into_precond_update"] else next(fulls)


def route_inputs(wg: Any, items: Sequence[Item], layout_of: LayoutOf, comm_dtype: torch.dtype | None) -> None:
    """The pieces of the momenta (and gradients) of one work group to their owners, who
    assemble the whole tensors: one all_to_all. A tensor every rank holds whole (replicated)
    is not sent: its owner uses its own copy, the same as every other rank's."""
    moves: list[tuple[Route, torch.Tensor, dict[int, torch.Tensor]]] = []
    for it in items:
        layout = layout_of(it.p)
        assert it.route is not None
        wholes: list[torch.Tensor] = []
        for t in it.fit_inputs():
            if layout.is_local:
                wholes.append(t)
                continue
            blocks = {i: t.new_empty(route_view(layout.full_shape)) for i in it.route.owned}
            moves.append((it.route, t.reshape(-1), blocks))
            wholes.append(blocks.get(0, t))
        if it.route.owned:
            it.full_m = wholes[0]
            it.full_g = wholes[-1]
    # Whether anything is sent is the same on every rank of the work group: its members list
    # the same parameters, each held whole either on all of them or on none (plan_route).
    if moves:
        dtype = comm_dtype or widest_dtype(local for _, local, _ in moves)
        to_owners(moves, wg, dtype, moves[0][1].device)


def hold_direction(
    item: Item, u: torch.Tensor | None, shape: tuple[int, ...], owner: Owner | None, comm_dtype: torch.dtype | None
) -> None:
    """Keep the owner's direction ``u`` (None elsewhere) for the way back: routed, as the piece
    :func:`route_directions` sends; otherwise as the whole tensor :func:`share` fills (a buffer
    of ``shape`` on non-owners). The owner's whole inputs are dropped."""
    item.full_m = item.full_g = None
    if item.route is not None:
        item.owned = u  # from_owners rounds every holder's piece, the owner's included
        return
    if u is None:
        u = torch.empty(shape, dtype=precond_dtype(item.group), device=item.m.device)
    elif comm_dtype is not None and owner is not None and owner.shared:
        # The owner applies what the others receive, so replicas cannot drift apart.
        u = u.to(comm_dtype).to(u.dtype)
    item.direction = u


def route_directions(wg: Any, items: Sequence[Item], layout_of: LayoutOf, comm_dtype: torch.dtype | None) -> None:
    """The owners' directions of one work group to every rank holding a piece of them, the
    owner included: one all_to_all. :func:`dist_optim.comm.exchange` rounds a rank's pieces to
    itself through the communication dtype too, so every holder applies the same values."""
    moves: list[tuple[Route, dict[int, torch.Tensor], torch.Tensor]] = []
    for it in items:
        layout = layout_of(it.p)
        assert it.route is not None
        blocks = {} if it.owned is None else {0: it.owned.reshape(route_view(layout.full_shape))}
        local = torch.empty(it.m.numel(), dtype=precond_dtype(it.group), device=it.m.device)
        local[layout.valid_numel :].zero_()  # ZeRO padding at the end of a chunk
        moves.append((it.route, blocks, local))
        it.direction = local
    dtype = comm_dtype or widest_dtype(local for _, _, local in moves)
    from_owners(moves, wg, dtype, moves[0][2].device)
    for it in items:
        it.owned = None


def share(
    owners: Mapping[torch.Tensor, Owner],
    entries: Sequence[tuple[torch.Tensor, list[torch.Tensor]]],
    dtype: torch.dtype | None,
) -> None:
    """Fill every rank's tensors of ``entries`` (param, tensors) from the param's owner: one
    all_gather per work group (:func:`dist_optim.owners.share_results`; ``dtype`` None: the
    widest of the group's tensors). ``entries`` must list the same params in the same order on
    every rank. Unbound (no owners), nothing moves."""
    share_results([(owners[p], tensors) for p, tensors in entries if p in owners], dtype)
