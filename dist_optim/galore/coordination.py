"""Who computes what, and the collectives of a GaLore step (every one in :mod:`dist_optim.comm`,
owners from :mod:`dist_optim.owners`); the arithmetic is :mod:`.projection`'s and :mod:`.adamw`'s.

* :func:`plan_refresh`: one SVD owner per matrix in its work group (balanced by
  :func:`.projection.svd_cost`) and the routes of its gradient's pieces to it, planned once;
* :func:`refresh`: bucket by bucket (``bucket_bytes`` of full gradients), the pieces of the
  refreshing gradients routed to their SVD owners (``owners.to_owners``: one all-to-all per work
  group), the SVDs, each rank's partition of the projectors from their owners
  (``owners.scatter_results``: one all-to-all per work group);
* :func:`start_gather_projectors`: a bucket's whole projectors from the work groups' partitions (one
  all-gather per work group, :mod:`dist_optim.partition`), issued asynchronously so that it travels
  while the step does other work (the NaN/Inf check, the previous bucket);
* :func:`project_all`: every rank's partial low-rank gradients of a bucket summed over the ranks
  that hold pieces of each matrix, in rank order, each rank receiving its partition of the sums
  (a reduce-scatter: one all-to-all per group and stage; ZeRO and TP one stage over their grid);
* :func:`gather_steps`: the whole normalised low-rank steps from every rank's partition (one
  all-gather per group and stage, likewise);
* :func:`shared_absmax`: the absmax of every 8-bit block of plain parameters held in pieces,
  max-reduced over their holders (one :class:`~dist_optim.comm.MaxBucket`).

Every rank calls these with the same items in the same order, so the collectives match.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import bnb_states as bnb
from .. import comm
from ..budget import buckets
from ..layout import ParamLayout
from ..owners import Moved, Owner, Task, WorkGroup, plan_tasks, route_tasks, scatter_results, to_owners
from ..partition import all_gather_parts, live_groups, partition_span, reduce_scatter_parts, start_all_gather_parts
from .adamw import plain_moments_8bit
from .geometry import low_rank_shape, projector_shapes
from .projection import new_projectors, project, svd_cost
from .state import Item, low_rank_numel, stored_projectors

__all__ = [
    "plan_refresh",
    "refresh",
    "gather_projectors",
    "start_gather_projectors",
    "ProjectorGathering",
    "project_all",
    "gather_steps",
    "shared_absmax",
]


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
    (:func:`dist_optim.owners.to_owners`: one ``all_to_all`` per work group), the owners' SVDs, each
    rank's partition of the projectors from their owner (``scatter_results``: one ``all_to_all`` per
    work group; with whether the owner's SVD succeeded), the full gradients dropped before the next
    bucket. A matrix whose pieces have no route (holdings that do not tile it) is gathered whole
    instead (``comm.gather_full``). Counts the bytes moved in ``stats`` (``route_bytes``: pieces sent
    to owners; ``gather_bytes``; ``scatter_bytes``: whole projectors an owner sends out) and the
    refresh step."""
    stats["refresh_steps"] += 1
    sizes = [it.layout.full_numel * it.grad.element_size() for it in items]
    for start, stop in buckets(sizes, bucket_bytes):
        _refresh_bucket(items[start:stop], tasks[start:stop], projector_dtype, stats, bucket_bytes)


def _refresh_bucket(
    items: Sequence[Item],
    tasks: Sequence[Task],
    projector_dtype: Callable[[torch.dtype], torch.dtype],
    stats: collections.Counter[str],
    bucket_bytes: int | None,
) -> None:
    routed = [Moved(task, [it.grad], it.grad.dtype) for it, task in zip(items, tasks) if task.route is not None]
    to_owners(routed, None, bucket_bytes=bucket_bytes)
    moved = {id(m.task): m for m in routed}
    unrouted = [it for it, task in zip(items, tasks) if task.work.size > 1 and task.route is None]
    gathered = dict(zip(map(id, unrouted), comm.gather_full([(it.layout, it.grad) for it in unrouted])))
    results: list[tuple[Owner, list[torch.Tensor], list[torch.Tensor]]] = []
    previous = []
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
        dtype = projector_dtype(it.grad.dtype)
        grad = None if full is None else full.reshape(it.layout.full_shape)
        if not owner.shared:
            new_projectors(
                it.state, it.side, it.layout.full_shape, int(it.group["rank"]), dtype, it.grad.device, grad, False
            )
            continue
        # Shared: the owner computes the whole projectors, and whether its SVD succeeded (one value
        # per rank, so that each receives it with its partition); every rank gets its partitions.
        tensors: list[torch.Tensor] = []
        previous.append((it, {k: it.state.pop(k) for k in _projector_shapes(it) if k in it.state}))
        if grad is not None:
            tensors, ok = new_projectors(
                it.state, it.side, it.layout.full_shape, int(it.group["rank"]), dtype, it.grad.device, grad, True
            )
            tensors.append(torch.full((owner.work.size,), float(ok), dtype=dtype, device=it.grad.device))
        numels = [math.prod(shape) for shape in _projector_shapes(it).values()]
        parts = [_empty_part(numel, it.proj_groups, dtype, it.grad.device) for numel in numels]
        results.append((owner, tensors, parts + [torch.empty(1, dtype=dtype, device=it.grad.device)]))
    # The owners' full gradients go before the projectors are sent: only projectors stay.
    for m in routed:
        m.boxes = {}
    gathered.clear()
    scatter_results(results)
    stats["scatter_bytes"] += sum(t.numel() * t.element_size() for _, tensors, _ in results for t in tensors)
    for (it, old), (_, _, parts) in zip(previous, results):
        _keep_partitions(it, parts[:-1], parts[-1], old)


def _projector_shapes(it: Item) -> dict[str, tuple[int, int]]:
    return projector_shapes(it.layout.full_shape, it.side, int(it.group["rank"]))


def _empty_part(numel: int, groups: tuple[Any, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    lo, hi = partition_span(numel, groups)
    return torch.empty(hi - lo, dtype=dtype, device=device)


def _keep_partitions(it: Item, parts: Sequence[torch.Tensor], ok: torch.Tensor, old: dict[str, Any]) -> None:
    """This rank's partitions of the new projectors over its work group (``parts``) go into the
    state (the owner's whole ones are dropped); where the owner's SVD failed (``ok`` 0), the
    previous partitions stay, as an unshared projector keeps its previous value."""
    for key, part in zip(_projector_shapes(it), parts):
        prev = old.get(key)
        if prev is not None and prev.shape == part.shape:
            it.state[key] = torch.where(ok.bool(), part, prev)
        else:
            it.state[key] = part


class ProjectorGathering:
    """:func:`start_gather_projectors` in flight: :meth:`wait` sets the items' whole projectors (and
    :attr:`flag_sum`, where it carried a NaN/Inf flag)."""

    def __init__(self, items: Sequence[Item], stats: collections.Counter[str], flag: torch.Tensor | None) -> None:
        requests: list[tuple[torch.Tensor, tuple[Any, ...], int, int]] = []
        self._where: list[tuple[Item, str, tuple[int, int]]] = []
        for it in items:
            if not live_groups(it.proj_groups):
                it.proj = stored_projectors(it.state, it.grad.dtype)
                continue
            absent = torch.empty(0, dtype=it.grad.dtype, device=it.grad.device)
            it.proj = (absent, absent)
            m, n = it.layout.full_shape
            r = int(it.group["rank"])
            for key, shape in (("proj_left", (m, r)), ("proj_right", (r, n))):
                if key in it.state:
                    requests.append((it.state[key], it.proj_groups, m * r if key == "proj_left" else r * n, 1))
                    self._where.append((it, key, shape))
        #: The job-wide sum of the ranks' flags, once waited for; None where none was carried.
        self.flag_sum: torch.Tensor | None = None
        # The flag rides on the all-gather of a work group that is the whole job, in its dtype (a
        # small integer: exact); each rank's flag is its one-element part of a ``size``-vector.
        carrier = next((r for r in requests if comm.group_size(r[1][0]) == comm.group_size(None)), None)
        self.carries_flag = flag is not None and carrier is not None
        if flag is not None and carrier is not None:
            group = carrier[1][0]
            requests.append((flag.to(carrier[0].dtype), (group,), comm.group_size(group), 1))
        self._stats = stats
        self._gathering = start_all_gather_parts(requests)

    def wait(self) -> None:
        wholes = self._gathering.wait()
        if self.carries_flag and self.flag_sum is None:
            self.flag_sum = wholes[-1].float().sum().reshape(1)
        for (it, key, shape), full in zip(self._where, wholes):
            self._stats["projector_bytes"] += full.numel() * full.element_size()
            left, right = it.proj  # type: ignore[misc]
            whole = full.view(shape).to(it.grad.dtype)
            it.proj = (whole, right) if key == "proj_left" else (left, whole)
        self._where = []


def start_gather_projectors(
    items: Sequence[Item], stats: collections.Counter[str], flag: torch.Tensor | None = None
) -> ProjectorGathering:
    """Every item's whole projectors (``item.proj``, in the gradient's dtype, set by the returned
    object's ``wait()``) from the partitions the ranks of its work group keep: one all-gather per
    work group for the call (:func:`dist_optim.partition.start_all_gather_parts`), issued
    asynchronously; the stored ones where they are whole. ``flag``: this rank's NaN/Inf flag
    (:meth:`dist_optim.base.DistOptimizer._gradients_ok`), carried to every rank where a work
    group is the whole job (then ``carries_flag``, and ``flag_sum`` after ``wait()``): the check
    then needs no all-reduce of its own. Counts the bytes gathered in ``stats["projector_bytes"]``."""
    return ProjectorGathering(items, stats, flag)


def gather_projectors(items: Sequence[Item], stats: collections.Counter[str]) -> None:
    """:func:`start_gather_projectors`, waited for."""
    start_gather_projectors(items, stats, None).wait()


def _align(it: Item, eight_bit: Callable[[Item], bool]) -> int:
    return bnb.BLOCKSIZE if eight_bit(it) else 1


def project_all(items: Sequence[Item], stats: collections.Counter[str], eight_bit: Callable[[Item], bool]) -> None:
    """Every item's low-rank gradient: this rank's partial sum (its pieces times the whole
    projectors, ``item.proj``), summed over the ranks that hold pieces of the matrix, each rank
    receiving its partition of the sum (``item.low``, :func:`dist_optim.partition.reduce_scatter_parts`:
    an all-to-all per group and stage, added in rank order), so that the sum does not depend on the
    other items of the call (the caller's buckets). ``eight_bit(item)``: its moments are 8-bit (their
    partitions hold whole blocks). Counts the bytes summed in ``stats["sum_bytes"]``."""
    requests = []
    for it in items:
        assert it.proj is not None, "gather the projectors first"
        low = project(it.grad, it.layout, it.side, int(it.group["rank"]), *it.proj)
        requests.append((low, it.layout.sum_groups, _align(it, eight_bit), it.replicas))
        if it.layout.sum_groups:
            stats["sum_bytes"] += low.numel() * low.element_size()
    for it, part in zip(items, reduce_scatter_parts(requests)):
        it.low = part


def gather_steps(
    items: Sequence[Item], parts: Sequence[torch.Tensor], eight_bit: Callable[[Item], bool]
) -> list[torch.Tensor]:
    """The whole normalised low-rank steps of ``items`` (of their low-rank shapes) from every
    rank's partition (``parts``, as :func:`project_all` gave the gradients): the inverse collectives
    (:func:`dist_optim.partition.all_gather_parts`), the same bytes as the partial sums' all-gather."""
    requests = [
        (part, it.layout.sum_groups + it.replicas, low_rank_numel(it), _align(it, eight_bit))
        for it, part in zip(items, parts)
    ]
    out = []
    for it, whole in zip(items, all_gather_parts(requests)):
        out.append(whole.view(low_rank_shape(it.layout.full_shape, it.side, int(it.group["rank"]))))
    return out


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
