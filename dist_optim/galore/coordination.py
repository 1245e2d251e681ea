"""Who computes what, and the collectives of a GaLore step (every one in :mod:`dist_optim.comm`,
owners from :mod:`dist_optim.sharding.owners`); the arithmetic is :mod:`.projection`'s and :mod:`.adamw`'s.

* :func:`plan_refresh`: one SVD owner per matrix in its work group (balanced by
  :func:`.projection.svd_cost`), planned once by the owner runtime (:mod:`dist_optim.sharding.runtime`);
* :func:`refresh`: one run of the owner runtime: bucket by bucket (``bucket_bytes`` of full
  gradients), the refreshing gradients to their SVD owners (pieces routed: one all-to-all per work
  group), the SVDs, each rank's partition of the projectors from their owners (one all-to-all per
  work group);
* :func:`start_gather_projectors`: a bucket's whole projectors from the work groups' partitions (one
  all-gather per work group, :mod:`dist_optim.sharding.partition`), issued asynchronously so that it travels
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
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import comm
from ..layout import ParamLayout
from ..sharding.owners import Task
from ..sharding.partition import (
    all_gather_parts,
    live_groups,
    partition_span,
    reduce_scatter_parts,
    start_all_gather_parts,
)
from ..sharding.runtime import OwnedWork, OwnerRuntime, Transport
from ..states import bnb
from .adamw import plain_moments_8bit
from .geometry import low_rank_shape, projector_shapes
from .projection import new_projectors, project, svd_cost
from .state import GaLoreMatrix, low_rank_numel, stored_projectors

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
    owners: OwnerRuntime, params: Sequence[torch.Tensor], items: Sequence[tuple[ParamLayout, tuple[int, ...]]]
) -> list[Task]:
    """One SVD task per GaLore matrix (``(layout, full shape)``, every GaLore parameter of the optimizer
    in its order, whether it has a gradient this step or not): one box, the whole matrix, its owner
    balanced by :func:`.projection.svd_cost` over the matrix's work group. Pure."""
    whole = [tuple((0, n) for n in shape) for _, shape in items]
    return owners.plan(
        params, [(layout, shape, [box], [svd_cost(shape)]) for (layout, shape), box in zip(items, whole)]
    )


@dataclasses.dataclass(eq=False)
class _Refresh:
    """A refreshing matrix in the owner runtime: its step item, and its previous projectors'
    partitions (kept where the owner's SVD fails)."""

    item: GaLoreMatrix
    old: dict[str, Any] = dataclasses.field(default_factory=dict)


def refresh(
    owners: OwnerRuntime,
    items: list[GaLoreMatrix],
    projector_dtype: Callable[[torch.dtype], torch.dtype],
    stats: collections.Counter[str],
    bucket_bytes: int | None,
) -> None:
    """New projectors from the SVDs of the full gradients of ``items`` (their tasks: :func:`plan_refresh`),
    one run of the owner runtime (:meth:`dist_optim.sharding.runtime.OwnerRuntime.run`): bucket by bucket
    (:func:`dist_optim.sharding.budget.buckets` of the full gradients' bytes), each rank's pieces of the
    bucket's gradients to the SVD owners (one ``all_to_all`` per work group; a matrix whose pieces
    have no route is gathered whole instead), the owners' SVDs, each rank's partition of the
    projectors from their owner (one ``all_to_all`` per work group; with whether the owner's SVD
    succeeded), the full gradients dropped before the projectors travel. Counts the bytes moved in
    ``stats`` (``route_bytes``: pieces sent to owners; ``gather_bytes``; ``scatter_bytes``: whole
    projectors an owner sends out) and the refresh step."""
    stats["refresh_steps"] += 1

    def prepare(bucket: Sequence[GaLoreMatrix]) -> list[OwnedWork[_Refresh]]:
        return [OwnedWork(_Refresh(it), owners.tasks[it.param], [it.grad], it.grad.dtype) for it in bucket]

    def compute(works: list[OwnedWork[_Refresh]]) -> None:
        for w in works:
            _svd(w, projector_dtype)

    def deliver(works: list[OwnedWork[_Refresh]]) -> None:
        for w in works:
            it = w.entry.item
            moved = it.layout.full_numel * it.grad.element_size()
            if w.transport == Transport.ROUTED and not it.layout.is_local:
                stats["route_bytes"] += it.grad.numel() * it.grad.element_size()
            elif w.transport == Transport.GATHERED and not it.layout.is_local:
                stats["gather_bytes"] += moved
            if w.transport != Transport.HERE:
                stats["scatter_bytes"] += sum(t.numel() * t.element_size() for t in w.outputs)
                _keep_partitions(it, w.parts[:-1], w.parts[-1], w.entry.old)
            w.outputs = []

    sizes = [it.layout.full_numel * it.grad.element_size() for it in items]
    owners.run(items, sizes, prepare, compute, deliver, comm_dtype=None, budget=bucket_bytes, partitions=True)


def _svd(w: OwnedWork[_Refresh], projector_dtype: Callable[[torch.dtype], torch.dtype]) -> None:
    """A matrix's new projectors: computed in its state where this rank alone holds it; otherwise,
    on its owner, the whole projectors and whether the SVD succeeded (one value per rank, so that
    each receives it with its partition), and on every rank the partitions to fill."""
    it = w.entry.item
    dtype = projector_dtype(it.grad.dtype)
    owned = w.owned.get(0)
    grad = None if owned is None else owned[0].reshape(it.layout.full_shape)
    rank, shape, device = int(it.group["rank"]), it.layout.full_shape, it.grad.device
    if w.transport == Transport.HERE:
        new_projectors(it.state, it.side, shape, rank, dtype, device, grad, False)
        return
    w.entry.old = {k: it.state.pop(k) for k in _projector_shapes(it) if k in it.state}
    if grad is not None:
        tensors, ok = new_projectors(it.state, it.side, shape, rank, dtype, device, grad, True)
        tensors.append(torch.full((w.task.work.size,), float(ok), dtype=dtype, device=device))
        w.outputs = tensors
    numels = [math.prod(s) for s in _projector_shapes(it).values()]
    w.parts = [_empty_part(numel, it.proj_groups, dtype, device) for numel in numels]
    w.parts.append(torch.empty(1, dtype=dtype, device=device))


def _projector_shapes(it: GaLoreMatrix) -> dict[str, tuple[int, int]]:
    return projector_shapes(it.layout.full_shape, it.side, int(it.group["rank"]))


def _empty_part(numel: int, groups: tuple[Any, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    lo, hi = partition_span(numel, groups)
    return torch.empty(hi - lo, dtype=dtype, device=device)


def _keep_partitions(it: GaLoreMatrix, parts: Sequence[torch.Tensor], ok: torch.Tensor, old: dict[str, Any]) -> None:
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

    def __init__(
        self, items: Sequence[GaLoreMatrix], stats: collections.Counter[str], flag: torch.Tensor | None
    ) -> None:
        requests: list[tuple[torch.Tensor, tuple[Any, ...], int, int]] = []
        self._where: list[tuple[GaLoreMatrix, str, tuple[int, int]]] = []
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
    items: Sequence[GaLoreMatrix], stats: collections.Counter[str], flag: torch.Tensor | None = None
) -> ProjectorGathering:
    """Every item's whole projectors (``item.proj``, in the gradient's dtype, set by the returned
    object's ``wait()``) from the partitions the ranks of its work group keep: one all-gather per
    work group for the call (:func:`dist_optim.sharding.partition.start_all_gather_parts`), issued
    asynchronously; the stored ones where they are whole. ``flag``: this rank's NaN/Inf flag
    (:meth:`dist_optim.base.DistOptimizer._gradients_ok`), carried to every rank where a work
    group is the whole job (then ``carries_flag``, and ``flag_sum`` after ``wait()``): the check
    then needs no all-reduce of its own. Counts the bytes gathered in ``stats["projector_bytes"]``."""
    return ProjectorGathering(items, stats, flag)


def gather_projectors(items: Sequence[GaLoreMatrix], stats: collections.Counter[str]) -> None:
    """:func:`start_gather_projectors`, waited for."""
    start_gather_projectors(items, stats, None).wait()


def _align(it: GaLoreMatrix, eight_bit: Callable[[GaLoreMatrix], bool]) -> int:
    return bnb.BLOCKSIZE if eight_bit(it) else 1


def project_all(
    items: Sequence[GaLoreMatrix], stats: collections.Counter[str], eight_bit: Callable[[GaLoreMatrix], bool]
) -> None:
    """Every item's low-rank gradient: this rank's partial sum (its pieces times the whole
    projectors, ``item.proj``), summed over the ranks that hold pieces of the matrix, each rank
    receiving its partition of the sum (``item.low``, :func:`dist_optim.sharding.partition.reduce_scatter_parts`:
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
    items: Sequence[GaLoreMatrix], parts: Sequence[torch.Tensor], eight_bit: Callable[[GaLoreMatrix], bool]
) -> list[torch.Tensor]:
    """The whole normalised low-rank steps of ``items`` (of their low-rank shapes) from every
    rank's partition (``parts``, as :func:`project_all` gave the gradients): the inverse collectives
    (:func:`dist_optim.sharding.partition.all_gather_parts`), the same bytes as the partial sums' all-gather."""
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
