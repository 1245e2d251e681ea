"""Who computes what, and the collectives of a GaLore step (every one in :mod:`dist_optim.comm`,
owners from :mod:`dist_optim.owners`); the arithmetic is :mod:`.projection`'s and :mod:`.adamw`'s.

* :func:`refresh`: the full gradients of the refreshing parameters (one bucketed
  ``comm.gather_full``), one SVD owner per matrix in its work group (balanced by
  :func:`.projection.svd_cost`), the projectors shared with the work group (``share_results``: one
  all-gather per work group);
* :func:`project_all`: every rank's partial low-rank gradients summed over the ranks that hold
  pieces of each matrix (one :class:`~dist_optim.comm.SumBucket`, one all-reduce per group);
* :func:`shared_absmax`: the absmax of every 8-bit block of plain parameters held in pieces,
  max-reduced over their holders (one :class:`~dist_optim.comm.MaxBucket`).

Every rank calls these with the same items in the same order, so the collectives match.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch

from .. import bnb_states as bnb
from .. import comm
from ..layout import ParamLayout
from ..owners import WorkGroup, assign, share_results
from .adamw import plain_moments_8bit
from .projection import new_projectors, project, svd_cost
from .state import Item, stored_projectors

__all__ = ["refresh", "project_all", "shared_absmax"]


def refresh(
    items: list[Item],
    work_of: Callable[[ParamLayout], WorkGroup],
    projector_dtype: Callable[[torch.dtype], torch.dtype],
    stats: collections.Counter[str],
) -> None:
    """New projectors from the SVDs of the full gradients: gather, owners compute, share. Counts
    the bytes moved in ``stats`` (``gather_bytes``, ``share_bytes``) and the refresh step."""
    gathered = comm.gather_full([(it.layout, it.grad) for it in items])
    stats["refresh_steps"] += 1
    for it, full in zip(items, gathered):
        if not it.layout.is_local:
            stats["gather_bytes"] += full.numel() * full.element_size()
        it.full_grad = full

    # One owner per SVD in the matrix's work group; the projectors then go to its other ranks.
    owners = assign([(work_of(it.layout), svd_cost(it.layout.full_shape)) for it in items])
    results = []
    for it, owner in zip(items, owners):
        tensors = new_projectors(
            it.state,
            it.side,
            it.layout.full_shape,
            int(it.group["rank"]),
            projector_dtype(it.grad.dtype),
            it.grad.device,
            it.full_grad if owner.mine else None,
            shared=owner.shared,
        )
        results.append((owner, tensors))
    share_results(results)
    stats["share_bytes"] += sum(
        t.numel() * t.element_size() for owner, tensors in results if owner.shared for t in tensors
    )
    for it in items:
        it.full_grad = None


def project_all(items: list[Item], stats: collections.Counter[str]) -> None:
    """Every item's low-rank gradient (``item.low``), whole on every rank that holds a piece of it;
    counts the bytes all-reduced in ``stats["sum_bytes"]``."""
    bucket = comm.SumBucket()
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
