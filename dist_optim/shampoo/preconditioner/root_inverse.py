"""Shampoo's root-inverse preconditioner of one block: roots refreshed from the factors, and the
preconditioned direction (steps 4 and 5 of the package docstring)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...kernels import matrix_functions
from ..blocking import apply_each_dim
from ..options import WARM
from ..state import BlockState, Scratch
from . import warm
from .grafting import Moments

__all__ = ["refresh_roots", "refresh_eigen", "product"]


def refresh_roots(
    bs: BlockState,
    order: int,
    scale: float,
    group: dict[str, Any],
    first: bool = False,
    criteria: list[matrix_functions.WarmCriterion] | None = None,
    scratch: Scratch | None = None,
) -> None:
    """``R_k = (scale L_k + epsilon I)^(-exponent_multiplier / r)``; a root that is not finite or
    whose iteration error exceeds ``inverse_failure_threshold`` keeps the previous one and counts
    in ``failures``. A root is stored as the mirror of its lower triangle (the products that make
    it round its two triangles apart by an ulp or so), the form a packed root holds
    (:mod:`dist_optim.shampoo.state`): every method returns it so
    (:func:`~dist_optim.kernels.matrix_functions.inverse_root_from_eigen`, or the iterations'
    ``(X + X^T) / 2``). ``root_inverse="warm"``: from :func:`~dist_optim.kernels.matrix_functions.warm_eigh`
    of the damped factor started from the block's previous eigenvectors ``Q_k`` (kept with the
    root), except at the ``first`` refresh, which has none (``Q_k = I``) and goes to ``eigh`` at
    once: testing the identity and taking QR steps from it would only add to the ``eigh`` that
    nearly always follows. The warm criteria are the caller's (``criteria``, one per factor, read
    for a batch of blocks at once: :mod:`.warm`) or read here for the block's factors at once. A
    warm root and its ``Q diag(s)`` are made in ``scratch`` (slot ``"refresh"``) before the root
    replaces the stored one, where it is given."""
    failures = bs.failures
    assert failures is not None
    root, mult = matrix_functions.exponent_for(order, group["exponent_override"], group["exponent_multiplier"])
    is_warm = group["root_inverse"] == WARM
    if not warm.takes(group, first):
        criteria = None  # the first refresh goes to eigh
    elif criteria is None:
        (criteria,) = warm.criteria([(bs, scale)], group)
    for k, (factor, r_k) in enumerate(zip(bs.factors, bs.roots)):
        try:
            if is_warm:
                start = None if criteria is None else (bs.bases[k], criteria[k])
                eig = warm.eigen(factor, scale, group, start)
                work = None
                if scratch is not None:
                    q_k = eig.eigenvectors
                    root_k, scaled_k = scratch.split([q_k.shape, q_k.shape], q_k.dtype, q_k.device, "refresh")
                    work = (root_k, scaled_k)
                x, q, ok = _warm_root(eig, bs.bases[k], mult / root, group, work)
                if q is not bs.bases[k]:  # kept eigenvectors are the basis itself
                    torch.where(ok, q.to(r_k.dtype), bs.bases[k], out=bs.bases[k])
            else:
                x, err, ok = matrix_functions.matrix_inverse_root(
                    factor * scale,
                    root,
                    group["epsilon"],
                    group["root_inverse"],
                    exponent_multiplier=mult,
                    order=group["higher_order_degree"],
                    overwrite=True,  # a fresh product of a factor mirrored by the caller
                )
                ok = ok & (err <= group["inverse_failure_threshold"])
        except torch.linalg.LinAlgError:
            x, ok = r_k, torch.zeros((), dtype=torch.bool)
        torch.where(ok, x.to(r_k.dtype), r_k, out=r_k)
        failures.add_((~ok).to(failures.dtype))


def refresh_eigen(
    bs: BlockState,
    order: int,
    scale: float,
    group: dict[str, Any],
    first: bool,
    keep: Callable[[int, torch.Tensor, torch.Tensor], None],
) -> None:
    """:func:`refresh_roots` for quantised eigenvectors (``preconditioner_bits`` 8 or 4): the
    eigenpairs ``(lam, Q_k)`` of ``scale L_k + epsilon I`` by ``eigh``, or with
    ``root_inverse="warm"`` after the ``first`` refresh by :func:`~dist_optim.kernels.matrix_functions.warm_eigh`
    from the block's decoded eigenvectors ``bs.bases``, and the root's eigenvalues ``s_k = lam'^-alpha``
    (:func:`~dist_optim.kernels.matrix_functions.inverse_root_spectrum`, the root ``eigh`` makes being
    ``Q_k diag(s_k) Q_k^T``) into ``bs.spectra[k]`` and, through ``keep(k, Q_k, ok)`` (the block's
    form: :meth:`.forms.BlockForms.keeper`), its eigenvectors, which are not kept again where the
    warm refresh kept them (their codes do not drift by repeated quantisation); a refresh that is
    not finite (``ok`` false) or fails keeps the previous pair and counts in ``failures``. The warm
    criteria of the block's factors are read at once (:mod:`.warm`: its bases are decoded into
    scratch one block at a time, so not for the whole batch)."""
    failures = bs.failures
    assert failures is not None
    root, mult = matrix_functions.exponent_for(order, group["exponent_override"], group["exponent_multiplier"])
    epsilon = group["epsilon"]
    is_warm = warm.takes(group, first)
    criteria = warm.criteria([(bs, scale)], group)[0] if is_warm else None
    for k, factor in enumerate(bs.factors):
        try:
            start = None if criteria is None else (bs.bases[k], criteria[k])
            eig = warm.eigen(factor, scale, group, start)
            lam, q = eig.eigenvalues, eig.eigenvectors
        except torch.linalg.LinAlgError:
            failures.add_(1)
            continue
        s = matrix_functions.inverse_root_spectrum(lam, epsilon, mult / root)
        ok = matrix_functions.all_finite(s) & matrix_functions.all_finite(q)
        spectrum = bs.spectra[k]
        torch.where(ok, s.to(spectrum.dtype), spectrum, out=spectrum)
        if not (is_warm and q is bs.bases[k]):
            keep(k, q, ok)
        failures.add_((~ok).to(failures.dtype))


def _warm_root(
    eig: matrix_functions.WarmEigh,
    basis: torch.Tensor,
    alpha: float,
    group: dict[str, Any],
    work: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``a^-alpha`` of the damped ``a = A + epsilon I`` (:func:`.warm.target`) from its
    eigendecomposition ``eig`` (:func:`.warm.eigen`: warm-started from ``basis``, or ``eigh``'s on
    a first refresh), its eigenvectors and whether both are finite; the root in ``work``'s first
    tensor where it is given. Recomputed by ``eigh``, the root is bit for bit
    ``root_inverse="eigh"``'s."""
    x = matrix_functions.inverse_root_from_eigen(eig.eigenvalues, eig.eigenvectors, group["epsilon"], alpha, work)
    ok = matrix_functions.all_finite(x)
    if eig.eigenvectors is not basis:  # kept only if the criterion computed from it was finite
        ok = ok & matrix_functions.all_finite(eig.eigenvectors)
    return x, eig.eigenvectors, ok


def product(bs: BlockState, moments: Moments, group: dict[str, Any], out: torch.Tensor, scratch: Scratch) -> None:
    """``Mhat x_0 R_0 x_1 R_1 ...`` before its bias correction and grafting (``mom`` for ``Mhat``)
    into ``out``; :func:`.grafting.scale_directions` finishes the direction."""
    pdt = group["preconditioner_dtype"]
    x = moments.mom.to(pdt)
    tmp = scratch.get(x.shape, pdt, x.device, "left")
    p = apply_each_dim(x, bs.roots, transpose=False, out=out if pdt == out.dtype else None, tmp=tmp)
    if p is not out:
        out.copy_(p)
