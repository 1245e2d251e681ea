"""The preconditioners: per-block math on local tensors, no communication.

:func:`block_direction` is one block's step on its owner: the moments and grafting state
(:mod:`.grafting`), the factors' statistics and refresh schedule (:mod:`.factors`), then the
root-inverse Shampoo direction (:mod:`.root_inverse`) or SOAP's (:mod:`.soap`). It reads and
updates a typed :class:`~dist_optim.shampoo.state.BlockState`; where the block came from and where
its direction goes is the optimizer's business (:mod:`dist_optim.shampoo.routing`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..blocking import Block
from ..options import start_step
from ..state import (
    BlockState,
    Scratch,
    keeps_moment_in_eigenbasis,
    quantises_bases,
    store_packed,
    unpacked,
)
from . import quantized, root_inverse, soap
from .factors import update_factors
from .grafting import update_moments, updates_in_kernel

__all__ = ["block_direction"]


def block_direction(
    bs: BlockState,
    block: Block,
    g: torch.Tensor,
    group: dict[str, Any],
    t: int,
    step: torch.Tensor,
    scratch: Scratch,
    out: torch.Tensor | None = None,
    apply_to: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One block's state update and search direction ``P`` (before decoupled decay and momentum)
    at the parameter's step ``t`` (``step``: its counter tensor), written into ``out`` (a
    contiguous tensor of the block's shape and the gradient's dtype, e.g. reused scratch;
    allocated when None) and returned. ``out`` is never state or the gradient: the caller updates
    it in place.

    ``apply_to``: the block of the parameter, when the caller applies the update itself. If the
    step's direction is the grafting direction alone (before ``start_preconditioning_step``, or a
    block without preconditioner) and it is Adam's, whose fused kernel can also make the update
    ``W <- W - lr (D + weight_decay W)`` in the same pass, the update is made there and None is
    returned (the caller then has nothing left to apply).

    ``bs`` holds the moments the step updates: 8-bit ones (``optim_bits=8``) as their fp32 values,
    read and stored quantised again by the caller (:func:`~dist_optim.shampoo.state.step_state`);
    quantised eigenvectors (``preconditioner_bits``) are refreshed and decoded by
    :func:`.quantized.refreshed`."""
    assert not bs.absmax, "8-bit moments are read as fp32 values first (state.step_state)"
    return _direction(bs, block, g, group, t, step, scratch, out, apply_to)


def _direction(
    bs: BlockState,
    block: Block,
    g: torch.Tensor,
    group: dict[str, Any],
    t: int,
    step: torch.Tensor,
    scratch: Scratch,
    out: torch.Tensor | None,
    apply_to: torch.Tensor | None,
) -> torch.Tensor | None:
    """:func:`block_direction` on the moments' values."""
    if not g.is_contiguous():  # a block of a parameter split along a later dim
        g = scratch.get(g.shape, g.dtype, g.device, "grad").copy_(g)
    if out is None:
        out = torch.empty(block.shape, dtype=g.dtype, device=g.device)
    is_soap = group["eigenvalue_correction"]
    start = start_step(group)
    if apply_to is not None and (is_soap or (block.precondition and t >= start) or not updates_in_kernel(group)):
        apply_to = None
    # SOAP keeps the reference formula's rounding (see grafting.update_moments); without grafting
    # its first moment lives in the eigenbasis and soap.direction updates it.
    moments = None
    if not (is_soap and keeps_moment_in_eigenbasis(group)):
        moments = update_moments(bs, g, group, t, step, out, not is_soap, apply_to)
    if block.precondition:
        stored = bs
        packed = group["use_symmetric_packing"]
        if packed:  # the math on whole matrices (scratch), packed back below
            bs = unpacked(stored, block, scratch, roots=not is_soap and t >= start)
        scale = update_factors(bs, block, g, group, t, start)
        if quantises_bases(block, group):  # the refresh, and the whole bases / roots the step uses
            bs = quantized.refreshed(stored, bs, block, group, t, start, scale, scratch)
        elif scale is not None and is_soap:
            soap.refresh_bases(bs, scale, group, first=(t == start))
        elif scale is not None:
            root_inverse.refresh_roots(bs, block.order, scale, group, first=(t == start))
        if packed:
            if t % group["statistics_compute_steps"] == 0:
                store_packed(stored.factors, bs.factors, block.order, factors=True)
            if scale is not None and stored.roots:
                store_packed(stored.roots, bs.roots, block.order, factors=False)
    if is_soap:
        return soap.direction(bs, moments, g, group, t, out, scratch)
    assert moments is not None
    if not block.precondition or t < start:
        return None if moments.applied else moments.graft_direction(out)
    return root_inverse.direction(bs, moments, group, out, scratch)
