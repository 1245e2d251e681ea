"""heavyball's SOAP step (``soap_step="heavyball"``): the step of ``heavyball.SOAP`` and
``heavyball.KLSOAP`` (heavyball 3.2.1, ``chainable.scale_by_soap``), with Vyas et al.'s order
(Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using Adam", arXiv:2409.11321, their
Algorithm 1 and code): a block's direction comes from the bases of the previous step, and only
then do the factors take the step's gradient and, on a refresh step, the bases change. That is
what the reference code means by "we never use the current gradients in the projection".

* A parameter's first step (``t == 0`` here: :func:`step_count`) only seeds: each factor is set to
  ``G_(k) G_(k)^T`` and its basis made from it by the first refresh (``eigenbasis``'s start); no
  direction, the caller leaves the parameter as it is (heavyball's ``general_guard`` skip).
* Later steps, ``t = n`` the optimizer's step count: Adam in the bases, its moments kept as
  bias-corrected averages ``X <- X + w (x - X)``, ``w = (1 - b) / (1 - b^(n-1))`` (heavyball's
  ``adam_`` at ``step - 1``: the seeding step is not Adam's), ``P = Mr / max(sqrt(S), epsilon)``
  (:func:`dist_optim.shampoo.preconditioner.soap.direction`); then each factor
  ``L <- L + w (G_(k) G_(k)^T - L)`` with ``w`` of ``shampoo_beta`` at ``n``, already its
  bias-corrected average (a refresh reads it unscaled); KL-SOAP's statistics for matrices
  (Lin et al. 2025, arXiv:2509.03378, heavyball's ``update_ggt_kl``); then the refresh where
  :func:`refreshes` says.

The counts are the optimizer's (every ``step`` call), not the parameter's: heavyball counts the
steps of the group, so a parameter that missed a step is corrected as if it had not. The products
of the statistics are heavyball's own (``einsum`` on a leading batch axis), so that in float64 the
factors, and from them the bases, are heavyball's bit for bit: a factor seeded by one Gram matrix
of a non-square gradient is rank deficient, and the basis of its null space is made of the
matrix's last bits (:func:`dist_optim.kernels.matrix_functions.lifted_eigh_start`).
"""

from __future__ import annotations

import string
from typing import Any

import torch

from ..blocking import Block
from ..state import BlockState, Scratch
from . import soap
from .factors import average_weight, factor_beta
from .forms import BlockForms

__all__ = ["refreshes", "step_count", "update_statistics", "block_directions"]

_AXES = string.ascii_lowercase


# heavyball's running sum of 1 / precondition_frequency, per probability: (steps, sum after them).
_RUNNING: dict[float, tuple[int, float]] = {}


def _running_sum(prob: float, n: int) -> float:
    k, total = _RUNNING.get(prob, (0, 0.0))
    if k > n:
        k, total = 0, 0.0
    while k < n:
        k, total = k + 1, total + prob
    _RUNNING[prob] = (k, total)
    return total


def refreshes(n: int, frequency: int) -> bool:
    """Whether heavyball refreshes the bases at the optimizer's step ``n`` (``psgd_should_update``
    with probability ``1 / frequency``): when the running float sum of ``1 / frequency`` over the
    steps passes an integer. That is every ``frequency``-th step where the sum is exact (a power of
    two), and drifts off it elsewhere (with 10, the 11th step is the first refresh)."""
    prob = 1 / frequency
    before = _running_sum(prob, n - 1)
    return int(before + prob) > int(before)


def step_count(param_steps: int, optimizer_steps: int) -> int:
    """The ``t`` of a parameter's step in heavyball's SOAP step: 0 on its first step (which seeds),
    else the optimizer's step count."""
    return 0 if param_steps <= 1 else optimizer_steps


def _gram(g: torch.Tensor, k: int) -> torch.Tensor:
    """``G_(k) G_(k)^T`` by heavyball's ``update_ggt`` einsum (a leading batch axis of one)."""
    axes = _AXES[: g.dim()]
    b = axes[k]
    return torch.einsum(f"...{axes},...{axes.replace(b, b.upper())}->...{b + b.upper()}", g[None], g[None])[0]


def _kl_grams(g: torch.Tensor, bs: BlockState, epsilon: float) -> list[torch.Tensor]:
    """KL-SOAP's statistics of a matrix block (heavyball's ``update_ggt_kl``): ``L_0``'s from
    ``G Q_1 diag(1 / (d_1 lam_1)) Q_1^T G^T``, ``L_1``'s likewise from ``G^T`` and ``Q_0``, with
    ``lam_j = max(diag(Q_j^T L_j Q_j), epsilon)`` of the factors before this step's update."""
    g3 = g[None]
    infos = []
    for k, (factor, q) in enumerate(zip(bs.factors, bs.bases)):
        q3 = q[None]
        eig = torch.einsum("...ji,...jk,...ki->...i", q3, factor[None], q3)
        proj = torch.einsum("...ji,...jk->...ik" if k == 0 else "...ij,...jk->...ik", g3, q3)
        infos.append((proj, eig.clamp_min(epsilon).reciprocal() / g.shape[k]))
    return [torch.einsum("...ik,...k,...jk->...ij", proj, scale, proj)[0] for proj, scale in reversed(infos)]


def update_statistics(bs: BlockState, block: Block, g: torch.Tensor, group: dict[str, Any], t: int) -> None:
    """The factors' update of one block (module docstring): seeded with the Gram matrices at
    ``t == 0``, else averaged with weight :func:`average_weight` of ``shampoo_beta`` (``betas[1]``
    when None) at ``t``; KL-SOAP's statistics for matrix blocks past the seed, heavyball's plain
    ones for other orders (as heavyball, whose KL update takes matrices only)."""
    grams = (
        _kl_grams(g, bs, group["epsilon"])
        if t > 0 and group["kl_statistics"] and block.order == 2
        else [_gram(g, k) for k in range(block.order)]
    )
    if t == 0:
        for factor, gram in zip(bs.factors, grams):
            factor.copy_(gram)
        return
    w = average_weight(factor_beta(group), t)
    for factor, gram in zip(bs.factors, grams):
        factor.copy_(factor * (1 - w) + gram * w)


def block_directions(
    bss: list[BlockState],
    blocks: list[Block],
    gs: list[torch.Tensor],
    outs: list[torch.Tensor],
    group: dict[str, Any],
    t: int,
    scratch: Scratch,
) -> list[torch.Tensor | None]:
    """The step of a batch of blocks at ``t`` (module docstring): each block's direction into its
    ``out`` from the bases it holds, then its factors' update and, at the seed or where
    :func:`refreshes`, its bases' refresh (the first moment rotated into them). A seeding batch has
    no directions (None each; ``out`` zeroed, for callers that hand it on)."""
    pdt = group["preconditioner_dtype"]
    seed = t == 0
    refresh = seed or refreshes(t, group["precondition_frequency"])
    for bs, block, g, out in zip(bss, blocks, gs, outs):
        if seed:
            out.zero_()
        else:
            soap.direction(bs, None, g, group, t, out, scratch)
        if block.precondition:
            update_statistics(bs, block, g.to(pdt), group, t)
            if refresh:
                soap.refresh_bases(bs, 1.0, group, seed, BlockForms.of(block, group).keeper(bs, bs))
    return [None if seed else out for out in outs]
