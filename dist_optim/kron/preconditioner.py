"""Kron's preconditioner math on whole local tensors, no communication: what a parameter's owner
computes (Li 2015, 2018; kron_torch's ``Kron``). See :mod:`dist_optim.kron` for the formulas.

The contractions are matrix products along one dim at a time instead of kron_torch's einsum, and
they skip what the structure makes known (:mod:`dist_optim.kernels.structured`: the zero half of the
upper-triangular factors, the mirrored half of the Gram matrices): the same math, fp32 rounding
differs (~1e-7 relative).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..kernels.dtypes import accumulation_dtype
from ..kernels.multi_tensor import scale_
from ..kernels.structured import gram, gram_update_, matmul_triangular, symmetrize_, upper_times_upper
from . import variant
from .blocks import Blocks, block_plan, factor_block
from .options import precond_dtype
from .state import FactorScratch, factor_form, has_factors, store_factors, store_whole, whole_factors
from .structure import FactorPlan

__all__ = [
    "CLIP_RMS",
    "initial_factors",
    "apply_factors",
    "apply_inverse_transposed",
    "step_factor",
    "fit_factors",
    "update_scalar_factor",
    "balance",
    "precondition",
    "clip_rms",
    "owner_direction",
    "gradient_scale",
    "moment_scale",
    "initial_scale",
]

#: The RMS the preconditioned direction is clipped to (kron_torch's).
CLIP_RMS = 1.1


@functools.lru_cache(maxsize=256)
def constant(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(value, dtype, device)``, made once per value, dtype and device (never written
    to): the same rounding as kron_torch's per-step scalars, without their cost on a GPU, where
    each ``torch.tensor`` of a Python number copies from pageable host memory and waits for the
    device (most of Kron's host waits in a step on a GPU, as ``torch.cuda.set_sync_debug_mode``
    shows)."""
    return torch.tensor(value, dtype=dtype, device=device)


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


def gradient_scale(g: torch.Tensor) -> float:
    """``mean(|g|^4)^(-1/8)`` in float64 (Li's psgd_torch initial scale: the first preconditioned
    gradient ``s^2 g`` then has a fourth-moment RMS of 1); 1.0 where that is not a finite positive
    number (a gradient of zeros, or non-finite values)."""
    return moment_scale(float(g.detach().double().abs().pow(4).mean()))


def moment_scale(mean_fourth: float) -> float:
    """:func:`gradient_scale` from the gradient's ``mean(|g|^4)`` (of several gradients together:
    :mod:`dist_optim.kron.init_scale`)."""
    scale = mean_fourth ** (-1 / 8) if mean_fourth > 0 else math.inf
    return scale if math.isfinite(scale) and scale > 0 else 1.0


def initial_scale(group: dict[str, Any], moment: float) -> float:
    """The automatic initial scale of a group's factors (``precond_init_scale=None``) from
    ``moment``, a :func:`gradient_scale` or :func:`moment_scale`:
    ``(precond_init_scale_scale * moment) ** precond_init_scale_power``."""
    return (group["precond_init_scale_scale"] * moment) ** group["precond_init_scale_power"]


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


def apply_inverse_transposed(t: torch.Tensor, factors: Sequence[torch.Tensor], wide: bool = False) -> torch.Tensor:
    """``(Q_1^-T (x) ... (x) Q_d^-T) t`` by triangular solves (in fp32, as kron_torch; ``wide``: in
    the factors' dtype where wider, as heavyball)."""
    for dim, q in enumerate(factors):
        if q.dim() < 2:
            t = _scale_along(t, dim, q.reciprocal())
        else:
            solve_dtype = accumulation_dtype(q.dtype) if wide else torch.float32

            # A row r of the moved tensor becomes r Q^-1, i.e. the column Q^-T r^T.
            def solve(rows: torch.Tensor, q: torch.Tensor = q, dt: torch.dtype = solve_dtype) -> torch.Tensor:
                out = torch.linalg.solve_triangular(q.to(dt), rows.to(dt), upper=True, left=False)
                return out.to(q.dtype)

            t = _along(t, dim, solve)
    return t


def _gram(t: torch.Tensor, dim: int, diagonal: bool) -> torch.Tensor:
    """Contraction of ``t`` with itself over every dim but ``dim``: the matrix ``T T^T`` of its
    mode-``dim`` unfolding ``T``, or only its diagonal."""
    rows = t.movedim(dim, 0).reshape(t.shape[dim], -1)
    return (rows * rows).sum(1) if diagonal else gram(rows)


def _spectral_lower_bound_(sym: torch.Tensor, max_abs: torch.Tensor) -> torch.Tensor:
    """A cheap lower bound of the spectral norm of a symmetric matrix: one power-iteration step
    started from its column of largest norm (computed on ``sym / max_abs`` for range, in place:
    ``sym`` is consumed)."""
    scaled = sym.div_(max_abs)
    col = torch.argmax((scaled * scaled).sum(0))
    x = scaled.index_select(1, col.reshape(1)).reshape(-1) @ scaled
    x = x / x.norm()
    return (scaled @ x).norm() * max_abs


def step_factor(q: torch.Tensor, grams: list[torch.Tensor], precond_lr: float, tiny: torch.Tensor) -> None:
    """One factor's step of the whitening fit on the Lie group (Li 2018), in place, from
    ``grams = [T1, T2]`` (``T1 = A_(k) A_(k)^T``, ``T2 = B_(k) B_(k)^T``; diagonal factors: the
    diagonals), which it consumes (the list is emptied, ``T1`` overwritten by ``T1 - T2``, so that
    they are freed as soon as they are used). Triangular factors take the normalised step
    ``triu(T1 - T2) / max(lb||T1 + T2||_2, tiny) Q``, diagonal ones
    ``(T1 - T2) / max(max|T1 + T2|, tiny) * Q``."""
    ga, gb = grams
    grams.clear()
    total = ga + gb
    diff = ga.sub_(gb)
    del ga, gb
    diff.mul_(constant(precond_lr, diff.dtype, diff.device))
    max_abs = torch.maximum(total.max(), total.min().neg())  # max|T1 + T2| without a temporary
    if q.dim() < 2:
        q.sub_(diff * q / max_abs.clamp(min=tiny))
        return
    bound = torch.where(max_abs > 0, _spectral_lower_bound_(total, max_abs), max_abs).clamp(min=tiny)
    del total
    # Only diff's upper triangle enters: triu(diff) @ Q with Q upper triangular.
    q.sub_(upper_times_upper(diff.div_(bound), q))


def fit_factors(factors: list[torch.Tensor], ab: list[torch.Tensor], precond_lr: float, tiny: torch.Tensor) -> None:
    """Every factor's step (:func:`step_factor`) from ``ab = [A, B]`` of the factors before the
    step, ``A = (Q_1 (x) ...) G`` with ``G`` carrying the probe noise and ``B = (Q_1^-T (x) ...) V``;
    ``ab`` is emptied once the last factor's statistics are taken, so that A and B are freed
    before its step."""
    for dim, q in enumerate(factors):
        diagonal = q.dim() < 2
        ga, gb = _gram(ab[0], dim, diagonal), _gram(ab[1], dim, diagonal)
        if dim == len(factors) - 1:
            ab.clear()
        grams = [ga, gb]
        del ga, gb
        step_factor(q, grams, precond_lr, tiny)


def update_scalar_factor(
    q: torch.Tensor, g: torch.Tensor, v: torch.Tensor, precond_lr: float, tiny: torch.Tensor
) -> None:
    """:func:`fit_factors` for a 0-dim tensor's one scalar factor (kron_torch fails there)."""
    a, b = q * g, v / q
    ga, gb = a * a, b * b
    lr = constant(precond_lr, g.dtype, g.device)
    q.sub_((ga - gb) * lr * q / (ga + gb).abs().clamp(min=tiny))


def balance(factors: list[torch.Tensor]) -> None:
    """Rescale the factors to a common max-abs (their geometric mean); the product is unchanged."""
    norms = torch.stack([q.abs().max() for q in factors])
    target = norms.log().mean().exp()
    scale_(factors, list((target / norms).unbind()))


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
    probes: Iterator[torch.Tensor] | None,
    do_balance: bool,
    overwrite: bool = False,
    scratch: FactorScratch | None = None,
    rounding: Callable[[], torch.Generator] | None = None,
    step: int = 0,
    init_scale: float | None = None,
) -> torch.Tensor:
    """On the owner, from the whole momentum (and gradient): debias, (balance,) update the
    factors when probes are given, precondition, clip. Makes the factors at the first call, at
    ``init_scale`` where given (a scale shared by same-shape parameters,
    :mod:`dist_optim.kron.init_scale`), else at ``precond_init_scale`` or from the first gradient.

    ``probes`` is :func:`~dist_optim.kron.blocks.draw_probe`'s. A large tensor with a diagonal
    factor is worked on in blocks along that factor's dim (:func:`~dist_optim.kron.blocks.block_plan`,
    :mod:`dist_optim.kron.blocks`); ``overwrite``: ``full_m`` is the caller's scratch buffer,
    which that path turns into the direction. With ``use_symmetric_packing`` and/or
    ``preconditioner_bits=8`` the triangular factors are unpacked and/or dequantised whole into
    ``scratch`` for the step and stored back (packed, quantised) when it changed them; quantised
    with stochastic rounding from ``rounding()`` (:func:`~dist_optim.kron.state.store_whole`;
    without it, to nearest). ``step``: the optimizer's step (1-based), for ``variant="heavyball"``
    (:mod:`.variant`)."""
    dtype = precond_dtype(group)
    form = factor_form(group)
    if not has_factors(state):
        scale = group["precond_init_scale"] if init_scale is None else init_scale
        if scale is None:
            # The first momentum debiased is the first gradient (the owner may hold only the
            # momentum: momentum_into_precond_update routes no gradient).
            b1 = group["b1"]
            first = int(state["step"])
            if variant.heavy(group):  # the average's first value: the gradient times its weight
                first_g = full_m.double() / variant.momentum_weight(b1, step)
            else:
                first_g = full_m.double() / (1 - b1**first) if b1 > 0 else full_m
            scale = initial_scale(group, gradient_scale(first_g))
        store_factors(state, initial_factors(plan, scale, dtype, full_m.device), plan, form)
        if variant.heavy(group):
            state[variant.LOWER_BOUND] = torch.zeros(
                len(plan.diag or (True,)), dtype=torch.float64, device=full_m.device
            )
    factors = whole_factors(state, plan, form, scratch)
    if variant.heavy(group):
        u = _heavy_direction(state, group, plan, factors, full_m, full_g, probes)
        if form.compact and probes is not None:
            store_whole(state, plan, factors, form, rounding() if rounding is not None and form.quantized else None)
        return u
    u = _direction(state, group, plan, factors, full_m, full_g, probes, do_balance, overwrite)
    # Only update and balancing steps change factors: the others store nothing (quantised: the
    # codes of a factor no step changed are never rounded again).
    if form.compact and (probes is not None or (do_balance and len(plan.shape) > 1)):
        store_whole(state, plan, factors, form, rounding() if rounding is not None and form.quantized else None)
    return u


def _direction(
    state: dict[str, Any],
    group: dict[str, Any],
    plan: FactorPlan,
    factors: list[torch.Tensor],
    full_m: torch.Tensor,
    full_g: torch.Tensor,
    probes: Iterator[torch.Tensor] | None,
    do_balance: bool,
    overwrite: bool,
) -> torch.Tensor:
    """:func:`owner_direction`'s math on the whole ``factors`` (updated in place)."""
    dtype = precond_dtype(group)
    if do_balance and len(plan.shape) > 1:
        balance(factors)
    blocks = block_plan(plan, dtype)
    if blocks is not None:
        return _blocked_direction(factors, group, plan, full_m, full_g, probes, blocks, overwrite, state)
    scale = 1 - group["b1"] ** int(state["step"])
    if overwrite and full_m.dtype == dtype:  # the same values, in the caller's scratch buffer
        debiased = full_m.div_(scale).reshape(plan.shape)
    else:
        debiased = (full_m / scale).to(dtype).reshape(plan.shape)
    if group["momentum_into_precond_update"]:
        fit = debiased
    else:  # a copy: never write into the user's gradient (kron_torch does)
        fit = full_g.to(dtype, copy=True).reshape(plan.shape)
    if probes is not None:
        probe = next(probes)
        eps = constant(torch.finfo(torch.float32).eps, fit.dtype, fit.device)
        fit.add_(eps.sqrt() * fit.abs().mean() * probe)
        tiny = constant(torch.finfo(dtype).tiny, dtype, fit.device)
        if plan.shape:
            ab = [apply_factors(fit, factors), apply_inverse_transposed(probe, factors)]
            del probe, fit  # A and B are what the fit needs from here on
            fit_factors(factors, ab, group["precond_lr"], tiny)
        else:
            update_scalar_factor(factors[0], fit, probe, group["precond_lr"], tiny)
    # kron_torch preconditions the noised debiased momentum (its update adds the probe noise in
    # place); the same here when the fit target is the momentum.
    u = precondition(factors, debiased)
    if group["clip_update_rms"]:
        clip_rms(u)
    return u


def _heavy_direction(
    state: dict[str, Any],
    group: dict[str, Any],
    plan: FactorPlan,
    factors: list[torch.Tensor],
    full_m: torch.Tensor,
    full_g: torch.Tensor,
    probes: Iterator[torch.Tensor] | None,
) -> torch.Tensor:
    """:func:`owner_direction`'s math for ``variant="heavyball"`` (:mod:`.variant`): the momentum is
    the bias-corrected average already; fit (balanced, noised copy, running lower bounds), then
    precondition the un-noised average and clip with the trust region."""
    dtype = precond_dtype(group)
    u = full_m.to(dtype, copy=True).reshape(plan.shape)
    if probes is not None:
        fit = u if group["momentum_into_precond_update"] else full_g.to(dtype).reshape(plan.shape)
        parts = list(probes)  # a large tensor's probe comes in blocks (:func:`.blocks.draw_probe`)
        blocks = block_plan(plan, dtype)
        probe = torch.cat(parts, dim=blocks.dim) if blocks is not None and len(parts) > 1 else parts[0]
        noised = variant.noised(fit, probe, group["dampening"])
        variant.balance_all(factors)
        if plan.shape:
            a, b = apply_factors(noised, factors), apply_inverse_transposed(probe, factors, wide=True)
        else:
            a, b = factors[0] * noised, probe / factors[0]
        del noised, probe
        variant.fit_factors(factors, state[variant.LOWER_BOUND], a, b, group)
    u = precondition(factors, u)
    if group["clip_update_rms"]:
        variant.trust_region_clip_(u)
    return u


def _new_sums(a: torch.Tensor, b: torch.Tensor, k: int, diagonal: bool, blocked: bool, n: int) -> list[torch.Tensor]:
    """Zero accumulators of ``T1``, ``T2`` of factor ``k`` (the blocked dim's: per index, ``n``)."""
    size = n if blocked else a.shape[k]
    shape = (size,) if diagonal else (size, size)
    return [torch.zeros(shape, dtype=a.dtype, device=a.device), torch.zeros(shape, dtype=b.dtype, device=b.device)]


def _add_sums(
    sums: list[torch.Tensor], a: torch.Tensor, b: torch.Tensor, k: int, diagonal: bool, span: tuple[int, int] | None
) -> None:
    """One block's part of factor ``k``'s ``T1``, ``T2``: the blocked dim's rows ``span`` written,
    the others' added in place (a triangular factor's lower triangle: :func:`gram_update_`)."""
    for acc, t in zip(sums, (a, b)):
        rows = t.movedim(k, 0).reshape(t.shape[k], -1)
        if span is not None:
            acc[span[0] : span[1]] = (rows * rows).sum(1)
        elif diagonal:
            acc.add_((rows * rows).sum(1))
        else:
            gram_update_(acc, rows, 1.0, 1.0)


def _blocked_direction(
    factors: list[torch.Tensor],
    group: dict[str, Any],
    plan: FactorPlan,
    full_m: torch.Tensor,
    full_g: torch.Tensor,
    probes: Iterator[torch.Tensor] | None,
    blocks: Blocks,
    overwrite: bool,
    state: dict[str, Any],
) -> torch.Tensor:
    """:func:`owner_direction`'s work in blocks along ``blocks.dim`` (a diagonal factor's): the
    same steps, with ``mean|G|`` and the other factors' statistics summed over the blocks."""
    dtype = precond_dtype(group)
    m = full_m.reshape(plan.shape)
    g = full_g.reshape(plan.shape)
    scale = 1 - group["b1"] ** int(state["step"])
    into_m = group["momentum_into_precond_update"]
    dim, spans = blocks.dim, blocks.spans()
    in_place = overwrite and m.dtype == dtype and m.is_contiguous()
    out = m if in_place else torch.empty(plan.shape, dtype=dtype, device=m.device)

    def cut(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        return t.narrow(dim, lo, hi - lo)

    def debiased(lo: int, hi: int) -> torch.Tensor:
        return (cut(m, lo, hi) / scale).to(dtype)

    def fit_block(lo: int, hi: int) -> torch.Tensor:
        return debiased(lo, hi) if into_m else cut(g, lo, hi).to(dtype, copy=True)

    if probes is None:
        for lo, hi in spans:
            cut(out, lo, hi).copy_(precondition(factor_block(factors, dim, lo, hi), debiased(lo, hi)))
    else:
        abs_sum = torch.stack([fit_block(lo, hi).abs().sum(dtype=torch.float64) for lo, hi in spans]).sum()
        eps = constant(torch.finfo(torch.float32).eps, dtype, m.device)
        noise = eps.sqrt() * (abs_sum / math.prod(plan.shape)).to(dtype)
        # The blocked dim's factor statistics are per index: each block fills its own. The
        # others' are sums over every index of the blocked dim, accumulated in place (a square
        # factor's T1 and T2 are as large as the factor).
        sums: list[list[torch.Tensor]] = []
        for i, (lo, hi) in enumerate(spans):
            probe = next(probes)
            d = debiased(lo, hi)
            fit = d if into_m else fit_block(lo, hi)
            fit.add_(noise * probe)
            cut(out, lo, hi).copy_(d)  # the noised debiased momentum where it is the fit target, as whole
            part = factor_block(factors, dim, lo, hi)
            a, b = apply_factors(fit, part), apply_inverse_transposed(probe, part)
            del probe, d, fit
            if i == 0:
                sums = [_new_sums(a, b, k, q.dim() < 2, k == dim, plan.shape[dim]) for k, q in enumerate(factors)]
            for k, q in enumerate(factors):
                _add_sums(sums[k], a, b, k, q.dim() < 2, (lo, hi) if k == dim else None)
        tiny = constant(torch.finfo(dtype).tiny, dtype, m.device)
        for q, grams in zip(factors, sums):
            if q.dim() >= 2:
                for t in grams:
                    symmetrize_(t)
                # The loop's name held T2, which step_factor frees after one use: at 70B the
                # embedding's 8192 x 8192 T2 (0.27 GB) stayed alive through the spectral bound.
                del t
            step_factor(q, grams, group["precond_lr"], tiny)
        for lo, hi in spans:
            cut(out, lo, hi).copy_(precondition(factor_block(factors, dim, lo, hi), cut(out, lo, hi)))
    if group["clip_update_rms"]:
        sumsq = torch.stack([cut(out, lo, hi).square().sum(dtype=torch.float64) for lo, hi in spans]).sum()
        rms = (sumsq / out.numel()).sqrt().to(dtype)
        out.mul_(torch.clamp(CLIP_RMS / (rms + 1e-12), max=1.0))
    return out
