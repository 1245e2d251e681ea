"""Who owns each Kron parameter, and how momenta reach the owners and directions the holders.

Kron's use of the owner interface of :mod:`dist_optim.owners` (which issues every collective
through :mod:`dist_optim.comm`); nothing of the mechanism is written here:

* :func:`plan_owners`: one owner per parameter (one box: the whole tensor, in :func:`route_view`)
  in its work group, balancing :func:`~dist_optim.kron.structure.precond_cost`
  (:func:`dist_optim.owners.plan_tasks`); :func:`dist_optim.owners.route_tasks` then says which of
  a rank's pieces go to the owner;
* :func:`send_inputs` / :func:`send_directions`: the momenta's (and gradients') pieces to the
  owners and the directions' pieces back, one ``all_to_all`` per work group each way
  (:func:`~dist_optim.owners.to_owners`, :func:`~dist_optim.owners.from_owners`);
* :func:`gather_inputs` and :func:`dist_optim.owners.share_results`: the fallback where no route
  exists: every rank gathers the full momenta (one all_gather per ZeRO/TP group) and receives the
  owners' full directions (one all_gather per work group). The same result, bit for bit in fp32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..comm import gather_full
from ..dtypes import widest_dtype
from ..layout import Box, ParamLayout
from ..owners import Moved, Sending, Task, WorkGroup, from_owners, plan_tasks, to_owners
from .options import precond_dtype

__all__ = ["Item", "route_view", "plan_owners", "gather_inputs", "send_inputs", "hold_direction", "send_directions"]


@dataclass(eq=False)
class Item:
    """One parameter's step: its inputs and, as they come, its owner task, its exchange (routed),
    the owner's whole inputs and this rank's direction (whole, or its local piece when routed)."""

    group: dict[str, Any]
    p: torch.Tensor
    m: torch.Tensor
    g: torch.Tensor
    layout: ParamLayout
    task: Task | None = None
    #: ``m`` is a copy the owner may overwrite (an 8-bit momentum's fp32 value), not the state's.
    scratch: bool = False
    moved: Moved | None = None
    full_m: torch.Tensor | None = None
    full_g: torch.Tensor | None = None
    direction: torch.Tensor | None = None

    @property
    def routed(self) -> bool:
        return self.task is not None and self.task.route is not None

    def fit_inputs(self) -> list[torch.Tensor]:
        """The tensors the owner needs whole: the momentum, and the gradient where the
        preconditioner is fitted to it."""
        return [self.m] if self.group["momentum_into_precond_update"] else [self.m, self.g]


def route_view(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a parameter is routed in: its full shape (a scalar as one element)."""
    return tuple(shape) or (1,)


def _whole_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


def plan_owners(
    params: Sequence[torch.Tensor], layouts: Sequence[ParamLayout], costs: Sequence[float], works: Sequence[WorkGroup]
) -> dict[torch.Tensor, Task]:
    """Every parameter's owner task in its work group (``works``), by cost. Pure."""
    views = [route_view(layout.full_shape) for layout in layouts]
    items = zip(works, layouts, views, costs)
    tasks = plan_tasks([(work, layout, view, [_whole_box(view)], [cost]) for work, layout, view, cost in items])
    return dict(zip(params, tasks))


def gather_inputs(items: Sequence[Item], comm_dtype: torch.dtype | None) -> None:
    """The fallback: every rank gathers the full momentum (and gradient) of ``items`` (one
    all_gather per ZeRO/TP group; a whole local tensor is used as it is)."""
    if not items:
        return
    tensors = [(it.layout, t) for it in items for t in it.fit_inputs()]
    dtype = comm_dtype or widest_dtype(t for _, t in tensors)
    fulls = iter(gather_full(tensors, dtype=dtype))
    for it in items:
        it.full_m = next(fulls)
        it.full_g = it.full_m if it.group["momentum_into_precond_update"] else next(fulls)


def send_inputs(
    items: Sequence[Item], comm_dtype: torch.dtype | None, wait: bool = True, bucket_bytes: int | None = None
) -> Sending:
    """The pieces of the routed items' momenta (and gradients) to their owners, who get the whole
    tensors (``full_m``, ``full_g``; filled once the returned :class:`~dist_optim.owners.Sending`
    is waited for): one all_to_all per work group (in rounds over ``bucket_bytes``,
    :func:`dist_optim.owners.to_owners`). A tensor every rank holds whole (replicated) is not sent:
    its owner uses its own copy, the same as every other rank's."""
    moved = []
    for it in items:
        assert it.task is not None
        it.moved = Moved(it.task, it.fit_inputs(), precond_dtype(it.group))
        moved.append(it.moved)
    sending = to_owners(moved, comm_dtype, wait, bucket_bytes)
    for it in items:
        assert it.moved is not None
        if it.moved.boxes:
            wholes = it.moved.boxes[0]
            it.full_m, it.full_g = wholes[0], wholes[-1]
    return sending


def hold_direction(item: Item, u: torch.Tensor | None, shape: tuple[int, ...]) -> None:
    """Keep the owner's direction ``u`` (None elsewhere) for the way back: routed, as the box
    :func:`send_directions` sends; otherwise as the whole tensor
    :func:`dist_optim.owners.share_results` fills (a buffer of ``shape`` on non-owners). The
    owner's whole inputs are dropped."""
    item.full_m = item.full_g = None
    if item.moved is not None:
        if u is not None:
            item.moved.results[0] = u  # from_owners rounds every holder's piece, the owner's included
        return
    if u is None:
        u = torch.empty(shape, dtype=precond_dtype(item.group), device=item.m.device)
    item.direction = u


def send_directions(items: Sequence[Item], comm_dtype: torch.dtype | None, bucket_bytes: int | None = None) -> None:
    """The owners' directions of the routed items to every rank holding a piece of them, the owner
    included: one all_to_all per work group (in rounds over ``bucket_bytes``,
    :func:`dist_optim.owners.from_owners`). :func:`dist_optim.comm.exchange` rounds a rank's
    pieces to itself through the communication dtype too, so every holder applies the same
    values."""
    from_owners([it.moved for it in items if it.moved is not None], comm_dtype, bucket_bytes)
    for it in items:
        assert it.moved is not None
        it.direction, it.moved = it.moved.out, None
