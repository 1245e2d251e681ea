"""SOAP's preconditioner of one block: Adam in the eigenbasis of the factors, the basis refreshed
from them (the SOAP section of the package docstring)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...kernels import matrix_functions
from ..blocking import apply_each_dim
from ..state import BlockState, Scratch
from . import warm
from .factors import average_weight
from .grafting import Moments

__all__ = ["refresh_bases", "direction"]


def refresh_bases(
    bs: BlockState,
    scale: float,
    group: dict[str, Any],
    first: bool,
    keep: Callable[[int, torch.Tensor, torch.Tensor], None],
    criteria: list[matrix_functions.WarmCriterion] | None = None,
) -> None:
    """``Q_k`` from ``A = scale L_k`` by ``eigenbasis`` (``first``: the refresh at the start step,
    which ``"qr-eigh-start"``, ``"qr-lifted"`` and ``"warm"`` make by ``eigh``); a refresh that is not finite keeps
    the previous basis and counts in ``failures``. ``"qr-eigh-start"`` and ``"warm"`` permute ``S``
    with the columns they reorder. A first
    moment kept in the eigenbasis is rotated into the new one, ``Mr <- Mr x_k (Q_k'^T Q_k)``, so
    that it stays ``M x_k Q_k'^T``: the parameter-basis moment, exactly in exact arithmetic.

    ``keep(k, new, ok)`` (the block's form: :meth:`.forms.BlockForms.keeper`) keeps a new basis
    where ``ok`` and leaves in ``bs.bases[k]`` what is kept (quantised bases: decoded again, so that
    the rotation of the first moment uses the bases the steps use); a basis kept as it is
    (``"warm"`` within its tolerance) is not kept again, so that codes do not drift by repeated
    quantisation.

    ``"warm"``'s criteria are the caller's (``criteria``, one per factor, read for a batch of
    blocks at once: :mod:`.warm`) or read here for the block's factors at once."""
    failures, s = bs.failures, bs.exp_avg_sq
    assert failures is not None and s is not None
    mode = group["eigenbasis"]
    if not warm.takes(group, first):
        criteria = None
    elif criteria is None:
        (criteria,) = warm.criteria([(bs, scale)], group)
    previous = [q.clone() for q in bs.bases] if bs.exp_avg_eigen is not None else []
    for k, (factor, q) in enumerate(zip(bs.factors, bs.bases)):
        perm = None
        try:
            if criteria is not None:  # "warm" after the first refresh
                q_new, perm, ok = _warm_basis(warm.eigen(factor, scale, group, (q, criteria[k])))
            elif mode == "qr":
                q_new, ok = matrix_functions.qr_algorithm_step(factor * scale, q, group["epsilon"])
            elif mode == "qr-lifted":  # heavyball's: eigh at the first refresh, then lifted power steps
                a = factor * scale
                if first:
                    q_new, ok = matrix_functions.lifted_eigh_start(a)
                else:
                    q_new, ok = matrix_functions.lifted_qr_step(a, q, group["epsilon"])
            elif mode in ("eigh", "eigh-ascending") or first:
                q_new, ok = matrix_functions.eigenbasis(factor * scale, descending=mode != "eigh-ascending")
            else:  # "qr-eigh-start" after its first refresh
                q_new, perm, ok = matrix_functions.qr_power_step(factor * scale, q)
        except torch.linalg.LinAlgError:
            q_new, perm, ok = q, None, torch.zeros((), dtype=torch.bool)
        if q_new is not q:
            keep(k, q_new, ok)
        if perm is not None:
            s.copy_(torch.where(ok, s.index_select(k, perm), s))
        failures.add_((~ok).to(failures.dtype))
    m = bs.exp_avg_eigen
    if m is not None and any(_changed(old, q) for old, q in zip(previous, bs.bases)):
        back = apply_each_dim(m.to(s.dtype), previous, transpose=True)
        m.copy_(apply_each_dim(back, bs.bases, transpose=False))


def _changed(old: torch.Tensor, new: torch.Tensor) -> bool:
    """Whether a refresh replaced a basis. Meta tensors (the planner's simulation) hold no values:
    counted as replaced, so that a plan includes the moment's rotation."""
    return old.is_meta or not torch.equal(old, new)


def _warm_basis(eig: matrix_functions.WarmEigh) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``eigenbasis="warm"`` after the first refresh, from the warm-started eigendecomposition
    ``eig`` of the symmetrised ``scale L_k`` (:func:`.warm.eigen`): a recomputed basis in
    :func:`~dist_optim.kernels.matrix_functions.eigenbasis`'s convention (decreasing eigenvalues,
    canonical signs), as ``"eigh"`` makes it. Returns the basis, the permutation of the current
    basis's columns (for ``S``; None: none) and whether it is finite."""
    q = eig.eigenvectors
    if eig.recomputed:
        q = matrix_functions.canonical_signs(q.flip(-1))
    return q, eig.perm, matrix_functions.all_finite(q)


def direction(
    bs: BlockState,
    moments: Moments | None,
    g: torch.Tensor,
    group: dict[str, Any],
    t: int,
    out: torch.Tensor,
    scratch: Scratch,
) -> None:
    """``S <- b2 S + (1 - b2) Gr^2`` with ``Gr = G x_k Q_k^T``, then
    ``P = (Mhat x_k Q_k^T) / (sqrt(S / (1 - b2^t)) + epsilon)`` rotated back with ``x_k Q_k``, into
    ``out``, to be grafted to ``||D||`` (computed from ``out`` before this call) by
    :func:`.grafting.scale_directions` when grafting is configured. A block without
    preconditioner has no basis: Adam in the identity basis.

    ``moments`` None: the first moment is kept in the eigenbasis (``bs.exp_avg_eigen``,
    :func:`~dist_optim.shampoo.state.keeps_moment_in_eigenbasis`), ``Mr <- b1 Mr + (1 - b1) Gr``,
    and ``Mhat x_k Q_k^T = Mr / (1 - b1^t)``: the rotation of ``Mhat`` is saved.

    The block-sized temporaries are ``scratch``'s (slots ``"rot"``, ``"left"``, ``"den"``), reused
    across blocks and steps, and ``S`` is updated by one fused ``addcmul``."""
    pdt = group["preconditioner_dtype"]
    mats = bs.bases
    s = bs.exp_avg_sq
    assert s is not None

    def buf(slot: str) -> torch.Tensor:
        return scratch.get(s.shape, pdt, s.device, slot)

    def in_rot(x: torch.Tensor) -> torch.Tensor:
        # Without bases apply_each_dim returns its input (the gradient or the moment itself),
        # which the division below must not overwrite.
        rot = buf("rot")
        return x if x.data_ptr() == rot.data_ptr() else rot.copy_(x)

    gr = apply_each_dim(g.to(pdt), mats, transpose=False, out=buf("rot"), tmp=buf("left"))
    if group.get("soap_step") == "heavyball":
        num, den = _heavyball_adam(bs, gr, group, t, in_rot, buf("den"))
    else:
        num, den = _adam(bs, moments, gr, group, t, in_rot, buf)
    num.div_(den)
    back = apply_each_dim(num, mats, transpose=True, out=out if out.dtype == pdt else None, tmp=buf("left"))
    if back.data_ptr() != out.data_ptr():
        out.copy_(back)


def _adam(
    bs: BlockState,
    moments: Moments | None,
    gr: torch.Tensor,
    group: dict[str, Any],
    t: int,
    in_rot: Callable[[torch.Tensor], torch.Tensor],
    buf: Callable[[str], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`direction`'s numerator and denominator (``num`` in scratch slot ``"rot"``)."""
    b1, b2 = group["betas"]
    pdt = group["preconditioner_dtype"]
    mats, s = bs.bases, bs.exp_avg_sq
    assert s is not None
    if b2 == 1:
        s.addcmul_(gr, gr)
    else:
        s.mul_(b2).addcmul_(gr, gr, value=1 - b2)
    bc2 = 1 - b2**t if (group["use_bias_correction"] and b2 < 1) else 1.0
    den = torch.div(s, bc2, out=buf("den")).sqrt_().add_(group["epsilon"])
    if moments is not None:
        num = in_rot(apply_each_dim(moments.mhat().to(pdt), mats, transpose=False, out=buf("rot"), tmp=buf("left")))
    elif b1 > 0:
        m = bs.exp_avg_eigen
        assert m is not None
        m.mul_(b1).add_(gr, alpha=1 - b1)
        bc1 = 1 - b1**t if group["use_bias_correction"] else 1.0
        num = torch.div(m, bc1, out=buf("rot"))
    else:
        num = in_rot(gr)
    return num, den


def _heavyball_adam(
    bs: BlockState,
    gr: torch.Tensor,
    group: dict[str, Any],
    t: int,
    in_rot: Callable[[torch.Tensor], torch.Tensor],
    den_buf: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """heavyball's Adam (``soap_step="heavyball"``, :mod:`.heavyball`): ``Mr`` and ``S`` kept as
    bias-corrected averages, ``X <- X + w (x - X)`` with ``w = (1 - b) / (1 - b^(t-1))`` (its
    ``adam_`` counts from the step after the seed), and ``P = Mr / max(sqrt(S), epsilon)`` (its
    ``eps_sqrt``: epsilon floors the root instead of adding to it)."""
    b1, b2 = group["betas"]
    s = bs.exp_avg_sq
    assert s is not None
    w2 = average_weight(b2, t - 1)
    s.mul_(1 - w2).addcmul_(gr, gr, value=w2)
    den = torch.sqrt(s, out=den_buf).clamp_min_(group["epsilon"])
    m = bs.exp_avg_eigen
    if b1 > 0 and m is not None:
        w1 = average_weight(b1, t - 1)
        m.mul_(1 - w1).add_(gr, alpha=w1)
        return in_rot(m), den
    return in_rot(gr), den
