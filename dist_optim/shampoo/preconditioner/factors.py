"""The Kronecker factors of a step's blocks: their statistics and the steps that refresh what is
computed from them (step 2 and the schedule of step 4 of the package docstring).

With ``kl_statistics`` (Lin et al. 2025, "Understanding and Improving Shampoo and SOAP via
Kullback-Leibler Minimization", arXiv:2509.03378) a factor's statistic is the gradient's second
moment along its dim with the other dims whitened by the current estimate of their factors:
KL-Shampoo's by the roots (:func:`kl_gradient`), KL-SOAP's by the inverse factors in SOAP's basis,
``Q_j diag(lam_j)^-1 Q_j^T`` (:func:`kl_soap_whiteners`), the eigenvalues estimated in that basis.
"""

from __future__ import annotations

from typing import Any

import torch

from ...kernels import structured
from ..blocking import Block, kept_triangle
from ..state import BlockState

__all__ = [
    "update_statistics",
    "refresh_scale",
    "factor_bias_correction",
    "factor_beta",
    "average_weight",
    "kl_gradient",
    "kl_soap_whiteners",
]


def update_statistics(blocks: list[tuple[BlockState, Block, torch.Tensor]], group: dict[str, Any], t: int) -> None:
    """``L_k <- b2 L_k + (1 - b2) G_(k) G_(k)^T`` for every factor of the ``(state, block,
    gradient)`` triples, every ``statistics_compute_steps`` steps (one triangle of large factors,
    :func:`~dist_optim.shampoo.blocking.kept_triangle`), all of them in one
    :func:`~dist_optim.kernels.structured.gram_updates_` call; with ``kl_statistics``, ``G`` preconditioned
    along the other dims: KL-Shampoo by the block's current roots (:func:`kl_gradient`), KL-SOAP
    (with ``eigenvalue_correction``) by :func:`kl_soap_whiteners`, all read before any factor of the
    step is updated."""
    if t % group["statistics_compute_steps"] != 0:
        return
    b2 = factor_beta(group)
    pdt = group["preconditioner_dtype"]
    kl = group["kl_statistics"]
    soap = group["eigenvalue_correction"]
    cs, rows = [], []
    for bs, block, g in blocks:
        gp = g.to(pdt)
        whiteners = kl_soap_whiteners(bs, block, group, t) if kl and soap else None
        for k, factor in enumerate(bs.factors):
            cs.append(kept_triangle(factor, block.order, k))
            if whiteners is not None:
                x = kl_gradient(gp, whiteners, k, symmetric=False)
            else:
                x = kl_gradient(gp, bs.roots, k) if kl else gp
            rows.append(_unfolding(x, k))
    structured.gram_updates_(cs, rows, b2, 1.0 if b2 == 1 else 1 - b2)


def kl_gradient(g: torch.Tensor, mats: list[torch.Tensor], k: int, symmetric: bool = True) -> torch.Tensor:
    """``G x_{j != k} M_j^T`` (dim ``j`` of ``G`` contracted with dim 0 of ``M_j``): the gradient
    preconditioned along every dim but ``k``, whose Gram matrix along ``k`` is the KL statistic of
    factor ``k``: ``M_j`` KL-Shampoo's (symmetric) roots, or KL-SOAP's whiteners
    (``symmetric=False``, :func:`kl_soap_whiteners`). A matrix's is one product (``G M_1`` or
    ``M_0^T G``); a vector's is ``G`` itself."""
    if g.dim() == 2:
        if k == 0:
            return torch.mm(g, mats[1])
        return torch.mm(mats[0] if symmetric else mats[0].T, g)
    x = g
    for j in range(g.dim()):  # contract the leading dim and append it at the end: dims cycle back
        x = x.movedim(0, -1) if j == k else torch.tensordot(x, mats[j], dims=([0], [0]))
    return x


def kl_soap_whiteners(bs: BlockState, block: Block, group: dict[str, Any], t: int) -> list[torch.Tensor]:
    """KL-SOAP's ``W_j = Q_j diag(d_j lam_j)^(-1/2)`` of every factor of a block (none for a
    vector, whose statistic has no other dim), so that :func:`kl_gradient` along ``k`` gives
    ``L_k``'s statistic ``G_(k) (x_{j != k} Q_j diag(lam_j)^-1 Q_j^T) G_(k)^T / prod_{j != k} d_j``:
    Lin et al.'s ``G S_b^-1 G^T / d_b`` with ``S_b`` the other factor as SOAP knows it, its basis
    ``Q_j`` of the last refresh (the identity before the first) and its eigenvalues in that basis.

    ``lam_j = max(diag(Q_j^T A_j Q_j), epsilon)`` with ``A_j`` the factor as it is before this
    step's statistics, bias-corrected as at a refresh (``1 / (1 - b2^n)``, ``n`` factor updates so
    far). That is the estimate with an outdated eigenbasis of the paper's code, which keeps an EMA
    of ``diag(Q_j^T Delta_j Q_j)`` beside the factor (the same while ``Q_j`` is kept), here read
    off the factor itself at every statistics step, as NVIDIA's emerging-optimizers and heavyball
    do: no state of its own, nothing to carry across a refresh (docs/optimizers.md, "KL-SOAP").
    At the first statistics update there is no factor to estimate from: ``lam_j = 1`` (``S_j =
    I``), so that the first statistics are SOAP's own, as the authors' code and heavyball seed their
    factors (a zero factor clamped to ``epsilon``, NVIDIA's start, would scale them by ``1 /
    epsilon`` and leave the later ones, about ``epsilon^2`` of them, no weight for many steps).

    A factor larger than :data:`~dist_optim.kernels.structured.MIN_SIZE` keeps one triangle
    current between refreshes: it is mirrored here first (what a refresh does; packed factors come
    unpacked whole)."""
    if block.order == 1:
        return []
    n = t // group["statistics_compute_steps"] - 1  # factor updates before this one
    scale = factor_bias_correction(group, n)
    out = []
    for k, (factor, q) in enumerate(zip(bs.factors, bs.bases)):
        d = factor.shape[0]
        if n == 0:
            out.append(q * d**-0.5)
            continue
        a = structured.mirror_lower_(kept_triangle(factor, block.order, k))
        lam = (q * torch.mm(a, q)).sum(0).mul_(scale).clamp_min_(group["epsilon"])
        out.append(q * lam.mul_(d).rsqrt_())
    return out


def refresh_scale(bs: BlockState, block: Block, group: dict[str, Any], t: int, start: int) -> float | None:
    """On a refresh step (``t == start``, then every ``precondition_frequency`` steps, once the
    factors have an update): every factor's kept triangle mirrored onto the other (at every size:
    a factor updated whole, small or on a GPU, may round its two triangles apart; the mirror is
    the form a packed factor holds, :mod:`dist_optim.shampoo.state`), and the scale of their bias
    correction ``1 / (1 - b2^n)`` returned (``n`` factor updates so far); None on other steps."""
    n = t // group["statistics_compute_steps"]  # factor updates so far
    if not (n > 0 and (t == start or (t > start and t % group["precondition_frequency"] == 0))):
        return None
    for k, factor in enumerate(bs.factors):
        structured.mirror_lower_(kept_triangle(factor, block.order, k))
    return factor_bias_correction(group, n)


def factor_beta(group: dict[str, Any]) -> float:
    """The factors' EMA coefficient: ``shampoo_beta`` (Vyas et al.'s name), ``betas[1]`` when None."""
    beta = group.get("shampoo_beta")
    return group["betas"][1] if beta is None else beta


def factor_bias_correction(group: dict[str, Any], n: int) -> float:
    """``1 / (1 - b2^n)``, the bias correction of factors after ``n`` updates (1 before any, or
    without ``use_bias_correction``): what a refresh and KL-SOAP's eigenvalue estimates scale by."""
    b2 = factor_beta(group)
    return 1.0 / (1 - b2**n) if (n > 0 and group["use_bias_correction"] and b2 < 1) else 1.0


def average_weight(beta: float, n: int) -> float:
    """``(1 - beta) / (1 - beta^n)``: the weight of the ``n``-th value in a bias-corrected average
    (1 at ``n = 1``), the form in which ``soap_step="heavyball"`` keeps its factors and moments
    (:mod:`.heavyball`). Written as heavyball's ``1 - beta_debias(beta, n)``, so that in float64
    the factors' averages round as heavyball's, bit for bit."""
    return 1 - (1 - (1 - beta) / (1 - beta**n))


def _unfolding(g: torch.Tensor, k: int) -> torch.Tensor:
    """``G_(k)``: dim ``k`` of ``g`` as rows, the others flattened as columns (a matrix's own rows or
    its transpose, without the general form's two view operations)."""
    if g.dim() <= 2:
        return g.unsqueeze(1) if g.dim() == 1 else g if k == 0 else g.T
    return g.movedim(k, 0).reshape(g.shape[k], -1)
