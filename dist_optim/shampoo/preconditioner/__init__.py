"""The preconditioners: per-block math on local tensors, no communication.

:func:`block_directions` is a batch of blocks' steps on their owner: the moments and grafting
state (:mod:`.grafting`), the factors' statistics and refresh schedule (:mod:`.factors`), then
the root-inverse Shampoo direction (:mod:`.root_inverse`) or SOAP's (:mod:`.soap`). It reads and
updates each block's typed :class:`~dist_optim.shampoo.state.BlockState`; where the blocks came
from and where their directions go is the optimizer's business
(:mod:`dist_optim.shampoo.owners`).

The work goes in phases over the whole batch, each element-wise phase one call over lists (the
fused Adam kernel, ``torch._foreach_*`` norms and scaling) and the matrix products block by
block: a step's fixed cost per block, in Python and kernel launches, is what a GPU cannot hide
behind the products of small blocks. One block is the batch of one; the blocks' results do not
depend on how they are batched.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ...kernels.matrix_functions import WarmCriterion
from ..blocking import Block
from ..options import start_step
from ..state import BlockState, Scratch, keeps_moment_in_eigenbasis
from . import heavyball, quantized, root_inverse, soap, warm
from .factors import refresh_scale, update_statistics
from .forms import BlockForms
from .grafting import Moments, graft_norms, scale_directions, update_moments_all, updates_in_kernel

__all__ = ["Job", "block_directions"]


@dataclass
class Job:
    """One block's part of :func:`block_directions`: its state, its gradient, its parameter's
    step counter tensor (``step``), ``out`` (a contiguous tensor of the block's shape and the
    gradient's dtype, e.g. reused scratch, never state or the gradient: the direction is written
    there and the caller updates it in place) and ``apply_to``: the block of the parameter, when
    the caller applies the update itself.

    ``bs`` holds the moments the step updates: 8-bit ones (``optim_bits=8``) as their fp32
    values, read and stored quantised again by the caller
    (:func:`~dist_optim.shampoo.state.step_state`); packed and quantised preconditioner matrices
    (``use_symmetric_packing``, ``preconditioner_bits``) are decoded whole for the math and stored
    back after it by the block's forms (:mod:`.forms`)."""

    bs: BlockState
    block: Block
    g: torch.Tensor
    step: torch.Tensor
    out: torch.Tensor
    apply_to: torch.Tensor | None = None


def block_directions(jobs: list[Job], group: dict[str, Any], t: int, scratch: Scratch) -> list[torch.Tensor | None]:
    """Each block's state update and search direction ``P`` (before decoupled decay and
    momentum), all of one param ``group`` at the parameters' step ``t``: ``job.out``, or None
    where the update was made on ``job.apply_to``. That is where the step's direction is the
    grafting direction alone (before ``start_preconditioning_step``, or a block without
    preconditioner) and it is Adam's, whose fused kernel can also make the update
    ``W <- W - lr (D + weight_decay W)`` in the same pass. ``soap_step="heavyball"`` has its own
    step (:mod:`.heavyball`), None for every block of a seeding batch (``t == 0``)."""
    assert all(not j.bs.absmax for j in jobs), "8-bit moments are read as fp32 values first (state.step_state)"
    if group.get("soap_step") == "heavyball":  # its own order: direction, then statistics and refresh
        gs = [j.g if j.g.is_contiguous() else j.g.contiguous() for j in jobs]
        outs = [j.out for j in jobs]
        return heavyball.block_directions([j.bs for j in jobs], [j.block for j in jobs], gs, outs, group, t, scratch)
    is_soap = group["eigenvalue_correction"]
    start = start_step(group)
    # A block of a parameter split along a later dim has a strided gradient: copied, each to its
    # own part of one scratch buffer, as the phases below read every block's gradient in turn.
    strided = [i for i, j in enumerate(jobs) if not j.g.is_contiguous()]
    gs = [j.g for j in jobs]
    if strided:
        first = jobs[strided[0]].g
        copies = scratch.split([jobs[i].g.shape for i in strided], first.dtype, first.device, "grad")
        for i, c in zip(strided, copies):
            gs[i] = c.copy_(jobs[i].g)
    outs = [j.out for j in jobs]
    preconditioned = [is_soap or (j.block.precondition and t >= start) for j in jobs]
    in_kernel = not is_soap and updates_in_kernel(group)
    apply_tos = [j.apply_to if in_kernel and not pre else None for j, pre in zip(jobs, preconditioned)]
    moments: list[Moments | None] = [None] * len(jobs)
    # SOAP keeps the reference formula's rounding (see grafting.update_moments); without grafting
    # its first moment lives in the eigenbasis and soap.direction updates it.
    if not (is_soap and keeps_moment_in_eigenbasis(group)):
        moments = list(
            update_moments_all([j.bs for j in jobs], gs, group, t, [j.step for j in jobs], outs, not is_soap, apply_tos)
        )
    shaped = [i for i, pre in enumerate(preconditioned) if pre]
    norm_ds = None
    if group["grafting_config"] is not None and shaped:  # ||D||, before the products overwrite out
        norm_ds = graft_norms([moments[i] for i in shaped], [outs[i] for i in shaped])  # type: ignore[misc]
    forms = [BlockForms.of(j.block, group) for j in jobs]
    # Factors updated in place have their statistics and refresh scales made for the whole batch;
    # packed ones are unpacked into scratch one block at a time, in _preconditioner_step.
    batched = [j.block.precondition and f.in_place for j, f in zip(jobs, forms)]
    update_statistics([(j.bs, j.block, g) for j, g, b in zip(jobs, gs, batched) if b], group, t)
    scales = [refresh_scale(j.bs, j.block, group, t, start) if b else None for j, b in zip(jobs, batched)]
    criteria = _warm_criteria(jobs, forms, scales, group, t == start)
    for i, job in enumerate(jobs):
        bs = job.bs
        if job.block.precondition:
            bs = _preconditioner_step(job, forms[i], gs[i], group, t, start, scratch, scales[i], criteria[i])
        if is_soap:
            soap.direction(bs, moments[i], gs[i], group, t, outs[i], scratch)
        elif preconditioned[i]:
            root_inverse.product(bs, moments[i], group, outs[i], scratch)  # type: ignore[arg-type]
    # One group at one step: one bias correction for the batch (SOAP's products apply their own).
    lead = moments[0]
    scale_directions([outs[i] for i in shaped], 1.0 if is_soap or lead is None else lead.m_div, norm_ds)
    directions: list[torch.Tensor | None] = []
    for i, m in enumerate(moments):
        if preconditioned[i]:
            directions.append(outs[i])
        else:
            assert m is not None
            directions.append(None if m.applied else m.graft_direction(outs[i]))
    return directions


def _warm_criteria(
    jobs: list[Job], forms: list[BlockForms], scales: list[float | None], group: dict[str, Any], first: bool
) -> list[list[WarmCriterion] | None]:
    """On a warm refresh, the criteria of the blocks whose factors and bases are whole in state
    (in place, not coded), with one host read for the batch (:mod:`.warm`); None for the others, which
    read their own in their refresh."""
    found: list[list[WarmCriterion] | None] = [None] * len(jobs)
    if not warm.takes(group, first):
        return found
    whole = [
        (i, job.bs, s) for i, (job, f, s) in enumerate(zip(jobs, forms, scales)) if s is not None and not f.eigenpairs
    ]
    for (i, _, _), c in zip(whole, warm.criteria([(bs, s) for _, bs, s in whole], group)):
        found[i] = c
    return found


def _preconditioner_step(
    job: Job,
    forms: BlockForms,
    g: torch.Tensor,
    group: dict[str, Any],
    t: int,
    start: int,
    scratch: Scratch,
    scale: float | None,
    criteria: list[WarmCriterion] | None,
) -> BlockState:
    """A preconditioned block's factor statistics and refresh scale where its factors are not
    updated in place (the others' were made for the whole batch before: ``scale``, and on a warm
    refresh the ``criteria``) and, on a refresh step, its roots or bases; returns the state its
    direction reads. The math runs on the whole matrices of one decode (``forms``: packed ones
    unpacked and coded ones decoded into ``scratch``, until the next block's step reuses it),
    stored back by one encode after it."""
    block, stored = job.block, job.bs
    is_soap = group["eigenvalue_correction"]
    # KL-Shampoo's statistics read the roots from the first step (the identity until the first
    # refresh); roots kept as eigenpairs are made from the bases from the start step on.
    roots = not is_soap and (t >= start or group["kl_statistics"])
    bs = forms.decode(stored, block, scratch, roots=roots, bases=is_soap or t >= start)
    if not forms.in_place:
        update_statistics([(bs, block, g)], group, t)
        scale = refresh_scale(bs, block, group, t, start)
    if scale is not None:
        first = t == start
        if is_soap:
            soap.refresh_bases(bs, scale, group, first, forms.keeper(stored, bs), criteria)
        elif forms.eigenpairs:
            root_inverse.refresh_eigen(bs, block.order, scale, group, first, forms.keeper(stored, bs))
        else:
            root_inverse.refresh_roots(bs, block.order, scale, group, first, criteria, scratch)
    forms.encode(stored, bs, block, factors=t % group["statistics_compute_steps"] == 0, roots=scale is not None)
    if forms.eigenpairs and t >= start:
        bs = dataclasses.replace(bs, roots=quantized.roots(bs, block, scratch))
    return bs
