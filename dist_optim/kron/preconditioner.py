"""Kron's preconditioner math on whole local tensors, no communication: what a parameter's owner
computes (Li 2015, 2018; kron_torch's ``Kron``). See :mod:`dist_optim.kron` for the formulas.

The contractions are matrix products along one dim at a time instead of kron_torch's einsum, and
they skip what the structure makes known (:mod:`dist_optim.structured`: the zero half of the
upper-triangular factors, the mirrored half of the Gram matrices): the same math, fp32 rounding
differs (~1e-7 relative).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..structured import gram, matmul_triangular, upper_times_upper
from .options import precond_dtype
from .state import factors as stored_factors
from .state import has_factors, store_factors
from .structure import FactorPlan

__all__ = [
    "CLIP_RMS",
    "initial_factors",
    "apply_factors",
    "apply_inverse_transposed",
    "update_factors",
    "update_scalar_factor",
    "balance",
    "precondition",
    "clip_rms",
    "owner_direction",
]

#: The RMS the preconditioned direction is clipped to (kron_torch's).
CLIP_RMS = 1.1


def initial_factors(
    plan: FactorPlan, init_scale: float, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """``init_scale ** (1 / ndim)`` times identity per factor (a diagonal one as a vector), so that
    their Kronecker product starts at ``init_scale`` times identity."""
    ndim = len(plan.shape)
    scale = init_scale ** (1 / ndim) if ndim else init_scale
    out = []
    for shape, d in zip(plan.factor_shapes(), plan.diag or (True,)):
        if d:
            out.append(torch.full(shape, scale, dtype=dtype, device=device))
        else:
            out.append(scale * torch.eye(shape[0], dtype=dtype, device=device))
    return out


def _times_upper_t(rows: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``rows @ q.T`` for an upper-triangular ``q`` (only the triangle is read: half the flops)."""
    return matmul_triangular(rows, q.T, upper=False)


def _times_upper_t_upper(rows: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``rows @ q.T @ q`` for an upper-triangular ``q``."""
    return matmul_triangular(matmul_triangular(rows, q.T, upper=False), q)


def _along(t: torch.Tensor, dim: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Apply ``fn`` to the rows of ``t`` seen as a matrix whose columns index ``dim``."""
    moved = t.movedim(dim, -1)
    shape = moved.shape
    out = fn(moved.reshape(-1, shape[-1])).reshape(shape)
    return out.movedim(-1, dim)


def _scale_along(t: torch.Tensor, dim: int, vec: torch.Tensor) -> torch.Tensor:
    view = [1] * t.dim()
    view[dim] = vec.numel()
    return t * vec.view(view)


def apply_factors(t: torch.Tensor, factors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``(Q_1 (x) ... (x) Q_d) t``: each factor applied to the vectors along its dim."""
    for dim, q in enumerate(factors):
        if q.dim() < 2:
            t = _scale_along(t, dim, q)
        else:
            t = _along(t, dim, functools.partial(_times_upper_t, q=q))
    return t


def apply_inverse_transposed(t: torch.Tensor, factors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``(Q_1^-T (x) ... (x) Q_d^-T) t`` by triangular solves (in fp32)."""
    for dim, q in enumerate(factors):
        if q.dim() < 2:
            t = _scale_along(t, dim, q.reciprocal())
        else:
            # A row r of the moved tensor becomes r Q^-1, i.e. the column Q^-T r^T.
            def solve(rows: torch.Tensor, q: torch.Tensor = q) -> torch.Tensor:
                out = torch.linalg.solve_triangular(q.float(), rows.float(), upper=True, left=False)
                return out.to(q.dtype)

            t = _along(t, dim, solve)
    return t


def _gram(t: torch.Tensor, dim: int, diagonal: bool) -> torch.Tensor:
    """Contraction of ``t`` with itself over every dim but ``dim``: the matrix ``T T^T`` of its
    mode-``dim`` unfolding ``T``, or only its diagonal."""
    rows = t.movedim(dim, 0).reshape(t.shape[dim], -1)
    return (rows * rows).sum(1) if diagonal else gram(rows)


def _spectral_lower_bound(sym: torch.Tensor, max_abs: torch.Tensor) -> torch.Tensor:
    """A cheap lower bound of the spectral norm of a symmetric matrix: one power-iteration step
    started from its column of largest norm (computed on ``sym / max_abs`` for range)."""
    scaled = sym / max_abs
    col = torch.argmax((scaled * scaled).sum(0))
    x = scaled.index_select(1, col.reshape(1)).reshape(-1) @ scaled
    x = x / x.norm()
    return (scaled @ x).norm() * max_abs


def update_factors(
    factors: list[torch.Tensor], g: torch.Tensor, v: torch.Tensor, precond_lr: float, tiny: torch.Tensor
) -> None:
    """One step of the whitening fit on the Lie group (Li 2018), in place. ``g`` already carries
    the probe noise; every factor's step uses the ``A``/``B`` of the factors before the step.
    Triangular factors take the normalised step ``triu(T1 - T2) / max(lb||T1 + T2||_2, tiny) Q``,
    diagonal ones ``(T1 - T2) / max(max|T1 + T2|, tiny) * Q``."""
    a = apply_factors(g, factors)
    b = apply_inverse_transposed(v, factors)
    lr = torch.tensor(precond_lr, dtype=g.dtype, device=g.device)
    for dim, q in enumerate(factors):
        diagonal = q.dim() < 2
        ga, gb = _gram(a, dim, diagonal), _gram(b, dim, diagonal)
        diff, total = (ga - gb) * lr, ga + gb
        max_abs = total.abs().max()
        if diagonal:
            q.sub_(diff * q / max_abs.clamp(min=tiny))
        else:
            bound = torch.where(max_abs > 0, _spectral_lower_bound(total, max_abs), max_abs).clamp(min=tiny)
            # Only diff's upper triangle enters: triu(diff) @ Q with Q upper triangular.
            q.sub_(upper_times_upper(diff.div_(bound), q))


def update_scalar_factor(
    q: torch.Tensor, g: torch.Tensor, v: torch.Tensor, precond_lr: float, tiny: torch.Tensor
) -> None:
    """:func:`update_factors` for a 0-dim tensor's one scalar factor (kron_torch fails there)."""
    a, b = q * g, v / q
    ga, gb = a * a, b * b
    lr = torch.tensor(precond_lr, dtype=g.dtype, device=g.device)
    q.sub_((ga - gb) * lr * q / (ga + gb).abs().clamp(min=tiny))


def balance(factors: list[torch.Tensor]) -> None:
    """Rescale the factors to a common max-abs (their geometric mean); the product is unchanged."""
    norms = torch.stack([q.abs().max() for q in factors])
    target = norms.log().mean().exp()
    torch._foreach_mul_(factors, list((target / norms).unbind()))


def precondition(factors: Sequence[torch.Tensor], g: torch.Tensor) -> torch.Tensor:
    """``(Q_1^T Q_1 (x) ... (x) Q_d^T Q_d) g``."""
    if g.dim() == 0:
        return factors[0] * factors[0] * g
    for dim, q in enumerate(factors):
        if q.dim() < 2:
            g = _scale_along(g, dim, q * q)
        else:
            g = _along(g, dim, functools.partial(_times_upper_t_upper, q=q))
    return g.contiguous()


def clip_rms(u: torch.Tensor) -> torch.Tensor:
    """``u *= min(1, 1.1 / (rms(u) + 1e-12))``, in place."""
    rms = u.square().mean().sqrt()
    return u.mul_(torch.clamp(CLIP_RMS / (rms + 1e-12), max=1.0))


def owner_direction(
    state: dict[str, Any],
    group: dict[str, Any],
    plan: FactorPlan,
    full_m: torch.Tensor,
    full_g: torch.Tensor,
    probe: torch.Tensor | None,
    do_balance: bool,
) -> torch.Tensor:
    """On the owner, from the whole momentum (and gradient): debias, (balance,) update the
    factors when a probe is given, precondition, clip. Makes the factors at the first call."""
    dtype = precond_dtype(group)
    if not has_factors(state):
        store_factors(state, initial_factors(plan, group["precond_init_scale"], dtype, full_m.device))
    factors = stored_factors(state, plan)
    b1 = group["b1"]
    debiased = (full_m / (1 - b1 ** int(state["step"]))).to(dtype).reshape(plan.shape)
    if group["momentum_into_precond_update"]:
        fit = debiased
    else:  # a copy: never write into the user's gradient (kron_torch does)
        fit = full_g.to(dtype, copy=True).reshape(plan.shape)
    if do_balance and len(plan.shape) > 1:
        balance(factors)
    if probe is not None:
        eps = torch.tensor(torch.finfo(torch.float32).eps, dtype=fit.dtype, device=fit.device)
        fit.add_(eps.sqrt() * fit.abs().mean() * probe)
        tiny = torch.tensor(torch.finfo(dtype).tiny, dtype=dtype, device=fit.device)
        if plan.shape:
            update_factors(factors, fit, probe, group["precond_lr"], tiny)
        else:
            update_scalar_factor(factors[0], fit, probe, group["precond_lr"], tiny)
    # kron_torch preconditions the noised debiased momentum (its update adds the probe noise in
    # place); the same here when the fit target is the momentum.
    u = precondition(factors, debiased)
    if group["clip_update_rms"]:
        clip_rms(u)
    return u
