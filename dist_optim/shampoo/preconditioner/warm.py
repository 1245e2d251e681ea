"""The warm refresh's criteria (``root_inverse="warm"``, ``eigenbasis="warm"``): for every factor
of a batch of blocks, whether its previous eigenvectors still diagonalise it
(:func:`~dist_optim.kernels.matrix_functions.warm_criteria`), decided with one host read for the batch.

On a GPU a host read waits for every kernel queued before it, so a refresh that read one
criterion per factor stalled the host once per factor (73 times a refresh on the bench set of
``bench/shampoo_vs_meta.py``, which makes one batch: now once).
:func:`~dist_optim.shampoo.preconditioner.block_directions` computes the criteria of the blocks
whose factors and bases are whole in state for the whole batch; a packed block (unpacked into
scratch one block at a time) or one with quantised bases (decoded into scratch) reads its own,
once per block, in its refresh. The criterion of a factor is the same tensor computation either
way, so the decisions and the results do not depend on the batching. A factor whose criterion
keeps its eigenvectors needs nothing more (:func:`eigen`): its target is never built (the
criterion multiplies the factor itself).
"""

from __future__ import annotations

from typing import Any

import torch

from ...kernels import matrix_functions
from ...kernels.matrix_functions import WarmCriterion, WarmEigh
from ..options import WARM
from ..state import BlockState

__all__ = ["takes", "target", "criteria", "eigen"]


def takes(group: dict[str, Any], first: bool) -> bool:
    """Whether this refresh of ``group``'s blocks is warm: ``eigenbasis="warm"`` (SOAP) or
    ``root_inverse="warm"`` (Shampoo), after the ``first`` refresh (which has no previous
    eigenvectors and goes to ``eigh``)."""
    mode = group["eigenbasis"] if group["eigenvalue_correction"] else group["root_inverse"]
    return mode == WARM and not first


def target(factor: torch.Tensor, scale: float, group: dict[str, Any]) -> torch.Tensor:
    """The matrix a refresh decomposes, a fresh tensor: SOAP's ``scale L_k`` symmetrised (as
    :func:`~dist_optim.kernels.matrix_functions.eigenbasis` does, so that a recomputation is ``"eigh"``'s
    basis bit for bit), Shampoo's damped ``scale L_k + epsilon I``."""
    a = factor * scale
    if group["eigenvalue_correction"]:
        return matrix_functions.symmetric_part(a)
    a.diagonal().add_(group["epsilon"])
    return a


def criteria(blocks: list[tuple[BlockState, float]], group: dict[str, Any]) -> list[list[WarmCriterion]]:
    """The criterion of every factor of the ``(state, scale)`` blocks against its basis
    (``bs.bases``: decoded ones for quantised bases), per block, with one host read in all. The
    :func:`target` is not formed (:class:`~dist_optim.kernels.matrix_functions.Shifted`: the criterion
    comes from the factor's product with the basis): a kept factor never builds it. The factor is
    exactly symmetric here (mirrored by
    :func:`~dist_optim.shampoo.preconditioner.factors.refresh_scale`), so SOAP's symmetrised
    ``scale L_k`` is ``scale L_k``."""
    shift = 0.0 if group["eigenvalue_correction"] else group["epsilon"]
    pairs = (
        (matrix_functions.Shifted(f, scale, shift), q) for bs, scale in blocks for f, q in zip(bs.factors, bs.bases)
    )
    flat = iter(matrix_functions.warm_criteria(pairs, group["refresh_tolerance"]))
    return [[next(flat) for _ in bs.factors] for bs, _ in blocks]


def eigen(
    factor: torch.Tensor, scale: float, group: dict[str, Any], start: tuple[torch.Tensor, WarmCriterion] | None
) -> WarmEigh:
    """The eigendecomposition a refresh makes of ``factor``'s :func:`target`: ``eigh``'s without a
    warm ``start`` (a first refresh, or ``root_inverse="eigh"`` with quantised eigenvectors), else
    :func:`~dist_optim.kernels.matrix_functions.warm_eigh`'s from the start's ``(basis, criterion)``. A
    kept factor's result is its criterion's own, the target not built a second time."""
    if start is not None and start[1].keep:
        return start[1].kept(start[0])
    a = target(factor, scale, group)
    if start is None:
        lam, q = matrix_functions.symmetric_eigh(a)
        return WarmEigh(lam, q, None, 0, True)
    basis, criterion = start
    return matrix_functions.warm_eigh(
        a,
        basis,
        tolerance=group["refresh_tolerance"],
        max_iterations=group["refresh_iterations"],
        criterion=criterion,
    )
