"""Which rank owns which block, and how gradients reach the owners and directions the holders.

Shampoo's use of the owner interface of :mod:`dist_optim.owners` (which issues every collective
through :mod:`dist_optim.comm`); nothing of the mechanism is written here:

* :func:`plan_owners`: every parameter's blocks (:func:`~dist_optim.shampoo.blocking.plan_blocks`)
  as an owner :class:`~dist_optim.owners.Task` of its work group, owners balanced by the cost
  model ``sum_k d_k^3`` (:func:`dist_optim.owners.plan_tasks`);
* :func:`send_routed` / :func:`finish_routed`: for parameters held in pieces (TP slices, ZeRO
  chunks), gradient pieces to the owners of their blocks (in flight while the previous bucket
  computes) and the owners' directions back to every rank that holds their pieces
  (:func:`~dist_optim.owners.to_owners` / :func:`~dist_optim.owners.from_owners`: one
  ``all_to_all`` per work group and direction).

Parameters held whole (DDP) or gathered whole use their full gradients; their owners' directions
reach every rank through :func:`dist_optim.owners.share_results`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..comm import SumBucket
from ..layout import ParamLayout
from ..owners import Moved, Owner, Sending, Task, WorkGroup, from_owners, plan_tasks, to_owners
from ..placement import Route
from .blocking import Block, plan_blocks

__all__ = ["Plan", "Routed", "plan_owners", "send_routed", "finish_routed", "total_failures"]


@dataclass
class Plan:
    """A parameter's blocking and the owners of its blocks (:attr:`task`: ranks of its work group)."""

    full_shape: tuple[int, ...]
    view_shape: tuple[int, ...]
    blocks: list[Block]
    task: Task

    @property
    def owners(self) -> list[int]:
        return self.task.owners

    @property
    def work(self) -> WorkGroup:
        return self.task.work

    @property
    def route(self) -> Route | None:
        return self.task.route

    def owner(self, index: int) -> Owner:
        return self.task.owner(index)


@dataclass
class Routed:
    """A parameter stepped through :func:`send_routed` / :func:`finish_routed`: its local
    gradient, then its local update."""

    group: dict[str, Any]
    p: torch.Tensor
    state: dict[str, Any]
    grad: torch.Tensor
    t: int
    plan: Plan
    layout: ParamLayout
    update: torch.Tensor | None = dataclasses.field(default=None)


def plan_owners(params: Sequence[tuple[ParamLayout, dict[str, Any], WorkGroup]]) -> list[Plan]:
    """The :class:`Plan` of each ``(layout, param group, work group)``; the blocks of all the
    parameters of a work group are assigned together, by cost."""
    blockings = [
        plan_blocks(
            tuple(layout.full_shape),
            group["max_preconditioner_dim"],
            group["merge_small_dims"],
            group["skip_preconditioning_dim_size_gt"],
        )
        for layout, group, _ in params
    ]
    tasks = plan_tasks(
        [
            (work, layout, view, [b.box for b in blocks], [b.cost for b in blocks])
            for (layout, _, work), (view, blocks) in zip(params, blockings)
        ]
    )
    return [
        Plan(tuple(layout.full_shape), view, blocks, task)
        for (layout, _, _), (view, blocks), task in zip(params, blockings, tasks)
    ]


def send_routed(
    routed: Sequence[Routed], comm_dtype: torch.dtype | None, wait: bool = True, bucket_bytes: int | None = None
) -> tuple[list[Moved], Sending]:
    """Each rank's gradient pieces to the owners of their blocks (in ``comm_dtype``; None: the
    widest of the gradients' dtypes); with ``wait=False`` in flight until the returned
    :class:`~dist_optim.owners.Sending` is waited for (in rounds over ``bucket_bytes``:
    :func:`dist_optim.owners.to_owners`). Owners keep no full gradient."""
    moved = [Moved(r.plan.task, [r.grad], r.grad.dtype) for r in routed]
    return moved, to_owners(moved, comm_dtype, wait, bucket_bytes)


def finish_routed(
    routed: Sequence[Routed],
    moved: Sequence[Moved],
    directions: Callable[[list[tuple[Routed, int, torch.Tensor]]], list[torch.Tensor]],
    share_dtype: torch.dtype,
    bucket_bytes: int | None = None,
) -> None:
    """After :func:`send_routed` (waited for): ``directions`` of every block ``i`` this rank owns
    of a parameter, ``(routed parameter, i, gradient)``, all of the bucket in one call, then the
    directions' pieces back to every rank that holds them (in ``share_dtype``) into each
    :attr:`Routed.update`. Nobody assembles a full direction."""
    owned = [(r, m, i, g) for r, m in zip(routed, moved) for i, (g,) in m.boxes.items()]
    for (_, m, i, _), d in zip(owned, directions([(r, i, g) for r, _, i, g in owned])):
        m.results[i] = d  # each owned block's gradient is replaced by its direction
    from_owners(moved, share_dtype, bucket_bytes)
    for r, m in zip(routed, moved):
        r.update = m.out


def total_failures(plans: Sequence[Plan], failures: Sequence[tuple[Plan, torch.Tensor]], device: torch.device) -> int:
    """The sum of the failure counters this rank holds (``failures``: each with its parameter's
    plan) over every work group of ``plans``: one all-reduce per group (collective when bound).
    The sums live on ``device``, the parameters': where the counters are (CUDA ones on a GPU) and
    what NCCL reduces, also on a rank that holds no counter of a group."""
    zero = torch.zeros((), dtype=torch.float64, device=device)
    # By process group and size: ALONE's None is no group, a work group's None the whole job.
    totals = {(id(plan.work.group), plan.work.size): (plan.work, zero.clone()) for plan in plans}
    for plan, count in failures:
        totals[(id(plan.work.group), plan.work.size)][1].add_(count.to(device, torch.float64))
    bucket = SumBucket()
    for work, total in totals.values():
        if work.size > 1:
            bucket.add(total, [work.group])
    bucket.flush()
    return int(sum(float(total) for _, total in totals.values()))
