"""Who computes what, and the collectives of a GaLore step (every one in :mod:`dist_optim.comm`,
owners from :mod:`dist_optim.owners`); the arithmetic is :mod:`.projection`'s and :mod:`.adamw`'s.

* :func:`plan_refresh`: one SVD owner per matrix in its work group (balanced by
  :func:`.projection.svd_cost`) and the routes of its gradient's pieces to it, planned once;
* :func:`refresh`: bucket by bucket (``bucket_bytes`` of full gradients), the pieces of the
  refreshing gradients routed to their SVD owners (``owners.to_owners``: one all-to-all per work
  group), the SVDs, the projectors shared with the work group (``share_results``: one all-gather
  per work group);
* :func:`project_all`: every rank's partial low-rank gradients of a bucket summed over the ranks
  that hold pieces of each matrix, in rank order (:class:`~dist_optim.comm.OrderedSumBucket`);
* :func:`shared_absmax`: the absmax of every 8-bit block of plain parameters held in pieces,
  max-reduced over their holders (one :class:`~dist_optim.comm.MaxBucket`).

Every rank calls these with the same items in the same order, so the collectives match.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import bnb_states as bnb
from .. import comm
from ..budget import buckets
from ..layout import ParamLayout
from ..owners import Moved, Task, WorkGroup, plan_tasks, route_tasks, share_results, to_owners
from .adamw import plain_moments_8bit
from .projection import new_projectors, project, svd_cost
from .state import Item, stored_projectors

__all__ = ["plan_refresh", "refresh", "project_all", "shared_absmax"]


def plan_refresh(
    items: Sequence[tuple[ParamLayout, tuple[int, ...]]], work_of: Callable[[ParamLayout], WorkGroup]
) -> list[Task]:
    """One SVD task per GaLore matrix (``(layout, full shape)``, every GaLore parameter of the optimizer
    in its order, whether it has a gradient this step or not): one box, the whole matrix, its owner
    balanced by :func:`.projection.svd_cost` over the matrix's work group, and the route of its
    gradient's pieces to that owner (:func:`dist_optim.owners.route_tasks`: one ``all_gather_object``
    per work group, once, when the optimizer first refreshes)."""
    whole = [tuple((0, n) for n in shape) for _, shape in items]
    tasks = plan_tasks(
        [(work_of(layout), layout, shape, [box], [svd_cost(shape)]) for (layout, shape), box in zip(items, whole)]
    )
    route_tasks(tasks)
    return tasks


def refresh(
    items: list[Item],
    tasks: Sequence[Task],
    projector_dtype: Callable[[torch.dtype], torch.dtype],
    stats: collections.Counter[str],
    bucket_bytes: int | None,
) -> None:
    """New projectors from the SVDs of the full gradients of ``items`` (``tasks``: their
    :func:`plan_refresh` tasks), bucket by bucket (:func:`dist_optim.budget.buckets` of the full
    gradients' bytes): each rank's pieces of the bucket's gradients to the SVD owners
    (:func:`dist_optim.owners.to_owners`: one ``all_to_all`` per work group), the owners' SVDs, the
    projectors from their owners to the work group (``share_results``: one ``all_gather`` per work
    group), the full gradients dropped before the next bucket. A matrix whose pieces have no route
    (holdings that do not tile it) is gathered whole instead (``comm.gather_full``). Counts the bytes
    moved in ``stats`` (``route_bytes``: pieces sent to owners; ``gather_bytes``; ``share_bytes``)
    and the refresh step."""
    stats["refresh_steps"] += 1
    sizes = [it.layout.full_numel * it.grad.element_size() for it in items]
    for start, stop in buckets(sizes, bucket_bytes):
        _refresh_bucket(items[start:stop], tasks[start:stop], projector_dtype, stats)


def _refresh_bucket(
    items: Sequence[Item],
    tasks: Sequence[Task],
    projector_dtype: Callable[[torch.dtype], torch.dtype],
    stats: collections.Counter[str],
) -> None:
    routed = [Moved(task, [it.grad], it.grad.dtype) for it, task in zip(items, tasks) if task.route is not None]
    to_owners(routed, None)
    moved = {id(m.task): m for m in routed}
    unrouted = [it for it, task in zip(items, tasks) if task.work.size > 1 and task.route is None]
    gathered = dict(zip(map(id, unrouted), comm.gather_full([(it.layout, it.grad) for it in unrouted])))
    results = []
    for it, task in zip(items, tasks):
        owner = task.owner(0)
        m = moved.get(id(task))
        if m is not None:
            if m.sent:
                stats["route_bytes"] += it.grad.numel() * it.grad.element_size()
            full = m.boxes[0][0] if owner.mine else None
        elif task.work.size > 1:
            if not it.layout.is_local:
                stats["gather_bytes"] += it.layout.full_numel * it.grad.element_size()
            full = gathered[id(it)] if owner.mine else None
        else:
            full = it.grad  # this rank alone holds the matrix, whole
        tensors = new_projectors(
            it.state,
            it.side,
            it.layout.full_shape,
            int(it.group["rank"]),
            projector_dtype(it.grad.dtype),
            it.grad.device,
            None if full is None else full.reshape(it.layout.full_shape),
            shared=owner.shared,
        )
        results.append((owner, tensors))
    # The owners' full gradients go before the projectors are shared: only projectors stay.
    for m in routed:
        m.boxes = {}
    gathered.clear()
    share_results(results)
    stats["share_bytes"] += sum(
        t.numel() * t.element_size() for owner, tensors in results if owner.shared for t in tensors
    )


def project_all(items: Sequence[Item], stats: collections.Counter[str]) -> None:
    """Every item's low-rank gradient (``item.low``), whole on every rank that holds a piece of it,
    its partial sums added in rank order (:class:`~dist_optim.comm.OrderedSumBucket`: a
    reduce-scatter and an all-gather per group and stage), so that the sum does not depend on the
    other items of the call (the caller's buckets); counts the bytes summed in ``stats["sum_bytes"]``."""
    bucket = comm.OrderedSumBucket()
    for it in items:
        left, right = stored_projectors(it.state, it.grad.dtype)
        it.low = project(it.grad, it.layout, it.side, int(it.group["rank"]), left, right)
        if it.layout.sum_groups:
            bucket.add(it.low, it.layout.sum_groups)
            stats["sum_bytes"] += it.low.numel() * it.low.element_size()
    bucket.flush()


def shared_absmax(
    states: list[dict[str, Any]],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    layouts: list[ParamLayout],
    eight: list[bool],
    betas: tuple[float, float],
) -> dict[int, tuple[bnb.FullBlocks, list[torch.Tensor]]]:
    """8-bit moments of a parameter held in pieces: the absmax of every quantisation block of
    the full tensor, by index of the parameter (the new moments are recomputed by the update
    rather than held), in one max-reduction per process group for the whole parameter group."""
    beta1, beta2 = betas
    sharded: dict[int, tuple[bnb.FullBlocks, list[torch.Tensor]]] = {}
    maxes = comm.MaxBucket()
    for i, (p, grad, layout, e) in enumerate(zip(params, grads, layouts, eight)):
        if e and not layout.is_local:
            blocks = bnb.FullBlocks(layout, p.device)
            moments = plain_moments_8bit(states[i], grad, blocks, beta1, beta2)
            sharded[i] = (blocks, [maxes.add(blocks.amax(m), layout.sum_groups) for m in moments])
    maxes.flush()
    return sharded
