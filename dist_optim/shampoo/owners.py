"""Which rank owns which block: Shampoo's tasks for the owner runtime (:mod:`dist_optim.sharding.runtime`).

* :func:`plan_block_owners`: every parameter's blocks (:func:`~dist_optim.shampoo.blocking.plan_blocks`)
  as one owner task of its work group, owners balanced by the cost model ``sum_k d_k^3``
  (:meth:`dist_optim.sharding.runtime.OwnerRuntime.plan`); how gradients reach the owners and directions
  the holders is the runtime's;
* :func:`total_failures`: the root-inverse failure counters summed over each work group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..comm import SumBucket
from ..layout import ParamLayout
from ..sharding.owners import Owner, Task, WorkGroup
from ..sharding.runtime import OwnerRuntime
from .blocking import Block, plan_blocks

__all__ = ["BlockPlan", "plan_block_owners", "total_failures"]


@dataclass
class BlockPlan:
    """A parameter's blocking and the owners of its blocks (:attr:`task`: ranks of its work group)."""

    full_shape: tuple[int, ...]
    view_shape: tuple[int, ...]
    blocks: list[Block]
    task: Task

    @property
    def work(self) -> WorkGroup:
        return self.task.work

    def owner(self, index: int) -> Owner:
        return self.task.owner(index)


def plan_block_owners(
    owners: OwnerRuntime, params: Sequence[torch.Tensor], specs: Sequence[tuple[ParamLayout, dict[str, Any]]]
) -> list[BlockPlan]:
    """The :class:`BlockPlan` of each parameter of ``params`` (``(layout, param group)`` each), its task
    planned by ``owners``; the blocks of all the parameters of a work group are assigned together,
    by cost. Pure."""
    blockings = [
        plan_blocks(
            tuple(layout.full_shape),
            group["max_preconditioner_dim"],
            group["merge_small_dims"],
            group["skip_preconditioning_dim_size_gt"],
            group["precondition_1d"],
        )
        for layout, group in specs
    ]
    tasks = owners.plan(
        params,
        [
            (layout, view, [b.box for b in blocks], [b.cost for b in blocks])
            for (layout, _), (view, blocks) in zip(specs, blockings)
        ],
    )
    return [
        BlockPlan(tuple(layout.full_shape), view, blocks, task)
        for (layout, _), (view, blocks), task in zip(specs, blockings, tasks)
    ]


def total_failures(
    plans: Sequence[BlockPlan], failures: Sequence[tuple[BlockPlan, torch.Tensor]], device: torch.device
) -> int:
    """The sum of the failure counters this rank holds (``failures``: each with its parameter's
    plan) over every work group of ``plans``: one all-reduce per group (collective when bound).
    The sums live on ``device``, the parameters': where the counters are (CUDA ones on a GPU) and
    what NCCL reduces, also on a rank that holds no counter of a group."""
    zero = torch.zeros((), dtype=torch.float64, device=device)
    # By process group and size: ONE_RANK's None is no group, a work group's None the whole job.
    totals = {(id(plan.work.group), plan.work.size): (plan.work, zero.clone()) for plan in plans}
    for plan, count in failures:
        totals[(id(plan.work.group), plan.work.size)][1].add_(count.to(device, torch.float64))
    bucket = SumBucket()
    for work, total in totals.values():
        if work.size > 1:
            bucket.add(total, [work.group])
    bucket.flush()
    return int(sum(float(total) for _, total in totals.values()))
