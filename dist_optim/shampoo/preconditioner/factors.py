"""The Kronecker factors of a step's blocks: their statistics and the steps that refresh what is
computed from them (step 2 and the schedule of step 4 of the package docstring)."""

from __future__ import annotations

from typing import Any

import torch

from ...kernels import structured
from ..blocking import Block, kept_triangle
from ..state import BlockState

__all__ = ["update_statistics", "refresh_scale", "kl_gradient"]


def update_statistics(blocks: list[tuple[BlockState, Block, torch.Tensor]], group: dict[str, Any], t: int) -> None:
    """``L_k <- b2 L_k + (1 - b2) G_(k) G_(k)^T`` for every factor of the ``(state, block,
    gradient)`` triples, every ``statistics_compute_steps`` steps (one triangle of large factors,
    :func:`~dist_optim.shampoo.blocking.kept_triangle`), all of them in one
    :func:`~dist_optim.kernels.structured.gram_updates_` call; with ``kl_statistics``, ``G`` preconditioned
    along the other dims by the block's current roots (:func:`kl_gradient`)."""
    if t % group["statistics_compute_steps"] != 0:
        return
    b2 = group["betas"][1]
    pdt = group["preconditioner_dtype"]
    kl = group["kl_statistics"]
    cs, rows = [], []
    for bs, block, g in blocks:
        gp = g.to(pdt)
        for k, factor in enumerate(bs.factors):
            cs.append(kept_triangle(factor, block.order, k))
            rows.append(_unfolding(kl_gradient(gp, bs.roots, k) if kl else gp, k))
    structured.gram_updates_(cs, rows, b2, 1.0 if b2 == 1 else 1 - b2)


def kl_gradient(g: torch.Tensor, roots: list[torch.Tensor], k: int) -> torch.Tensor:
    """``G x_{j != k} R_j``: the gradient preconditioned along every dim but ``k`` by its (symmetric)
    root, whose Gram matrix along ``k`` is KL-Shampoo's statistic of factor ``k``. A matrix's is
    one product (``G R_1`` or ``R_0 G``); a vector's is ``G`` itself."""
    if g.dim() == 2:
        return torch.mm(g, roots[1]) if k == 0 else torch.mm(roots[0], g)
    x = g
    for j in range(g.dim()):  # contract the leading dim and append it at the end: dims cycle back
        x = x.movedim(0, -1) if j == k else torch.tensordot(x, roots[j], dims=([0], [0]))
    return x


def refresh_scale(bs: BlockState, block: Block, group: dict[str, Any], t: int, start: int) -> float | None:
    """On a refresh step (``t == start``, then every ``precondition_frequency`` steps, once the
    factors have an update): every factor's kept triangle mirrored onto the other (at every size:
    a factor updated whole, small or on a GPU, may round its two triangles apart; the mirror is
    the form a packed factor holds, :mod:`dist_optim.shampoo.state`), and the scale of their bias
    correction ``1 / (1 - b2^n)`` returned (``n`` factor updates so far); None on other steps."""
    b2 = group["betas"][1]
    n = t // group["statistics_compute_steps"]  # factor updates so far
    if not (n > 0 and (t == start or (t > start and t % group["precondition_frequency"] == 0))):
        return None
    for k, factor in enumerate(bs.factors):
        structured.mirror_lower_(kept_triangle(factor, block.order, k))
    return 1.0 / (1 - b2**n) if (group["use_bias_correction"] and b2 < 1) else 1.0


def _unfolding(g: torch.Tensor, k: int) -> torch.Tensor:
    """``G_(k)``: dim ``k`` of ``g`` as rows, the others flattened as columns (a matrix's own rows or
    its transpose, without the general form's two view operations)."""
    if g.dim() <= 2:
        return g.unsqueeze(1) if g.dim() == 1 else g if k == 0 else g.T
    return g.movedim(k, 0).reshape(g.shape[k], -1)
