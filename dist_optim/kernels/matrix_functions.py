"""Matrix functions shared by the preconditioned optimizers (Shampoo, SOAP, Kron).

Everything here works on one symmetric positive semi-definite matrix at a time and does no
communication:

* :func:`matrix_inverse_root`: ``(A + eps I)^(-alpha)`` by a symmetric eigendecomposition, by the
  coupled Newton iteration (Higham, "Functions of Matrices", 2008, §7.3; Guo & Higham 2006), or by
  a higher-order coupled iteration built from the binomial series of ``(I - E)^(-1/p)`` (the
  family Meta's Shampoo calls "higher-order coupled iterations"). Each returns the root, an error
  estimate and a success flag, so callers can keep the previous root when one fails (Anil et al.
  2020, "Scalable Second Order Optimization for Deep Learning", arXiv:2002.09018).
* :func:`eigenbasis`, :func:`qr_algorithm_step` and :func:`qr_power_step`: the eigenbasis of a
  factor, computed exactly or refreshed by one warm-started QR step (Vyas et al. 2024, "SOAP:
  Improving and Stabilizing Shampoo using Adam", arXiv:2409.11321): Meta's step
  (:func:`qr_algorithm_step`) or Vyas et al.'s (:func:`qr_power_step`); heavyball's power step on
  the lifted factor (:func:`lifted_qr_step`, started by :func:`lifted_eigh_start`).
* :func:`warm_eigh`: an eigendecomposition warm-started from the previous eigenvectors, skipped
  while they still diagonalise the matrix within a tolerance (tested by :func:`residual_ratio`
  from one product ``A Q``), else refined by QR-algorithm steps, else recomputed by ``eigh`` (the
  refresh of ``root_inverse="warm"`` / ``eigenbasis="warm"``).

Success flags and errors are tensors; nothing here synchronises with the host except the early
exit of the iterative methods (one scalar read per iteration) and the warm refresh's criterion
(one read for all the matrices given to :func:`warm_criteria`: the Shampoo and SOAP refreshes give
it a batch of blocks' factors at a time), and these run only when a root is refreshed, every
``precondition_frequency`` steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

import torch

from .replay import replayable
from .structured import symmetric_product

__all__ = [
    "ROOT_METHODS",
    "matrix_inverse_root",
    "eigenbasis",
    "qr_algorithm_step",
    "qr_power_step",
    "lifted_eigh_start",
    "lifted_qr_step",
    "canonical_signs",
    "symmetric_part",
    "all_finite",
    "column_major",
    "symmetric_eigh",
    "off_diagonal_ratio",
    "warm_eigh",
    "warm_criteria",
    "residual_ratio",
    "Shifted",
    "WarmCriterion",
    "WarmEigh",
    "inverse_root_from_eigen",
    "inverse_root_spectrum",
]

ROOT_METHODS = ("eigh", "coupled_newton", "higher_order")


def symmetric_part(a: torch.Tensor) -> torch.Tensor:
    """``(A + A^T) / 2``: exactly ``A`` when ``A`` is exactly symmetric."""
    return (a + a.T) * 0.5


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """Whether every entry of ``t`` is finite, a 0-d bool tensor (no host read): from the
    smallest and largest entry in one reduction (NaN propagates through both, an infinity is one
    of them), far faster than ``torch.isfinite(t).all()``'s three elementwise passes and
    temporaries (measured once, not benched)."""
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    if column_major(t):  # the same entries in memory order: a transposed read is many times slower
        t = t.mT
    lo, hi = torch.aminmax(t)
    return torch.isfinite(lo) & torch.isfinite(hi)


def column_major(t: torch.Tensor) -> bool:
    """Whether ``t`` (a matrix or a batch of them) is laid out column by column, as LAPACK returns
    ``eigh``'s eigenvectors, and not also row by row (a vector or a 1 x 1 matrix is both)."""
    return t.dim() >= 2 and not t.is_contiguous() and t.mT.is_contiguous()


@replayable
def symmetric_eigh(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.linalg.eigh(a)`` of an exactly symmetric ``a`` (every caller's: a symmetrised matrix,
    a mirrored factor, or one of these scaled and damped), bit for bit: ``a`` is handed over as its
    transpose, the same matrix, when that is column-major, LAPACK's layout, so that the copy
    ``eigh`` makes of its input into the eigenvector buffer is a straight one, not a transposed one
    (the straight copy is several times cheaper on the CPU; ``torch.profiler``, measured once,
    not benched).
    The eigenvectors are column-major either way; their consumers read them in that order
    (:func:`all_finite`, :func:`inverse_root_from_eigen`)."""
    return torch.linalg.eigh(a.mT if a.is_contiguous() else a)


@replayable
def matrix_inverse_root(
    matrix: torch.Tensor,
    root: float,
    epsilon: float,
    method: str = "eigh",
    *,
    exponent_multiplier: float = 1.0,
    max_iterations: int = 100,
    tolerance: float | None = None,
    order: int = 3,
    overwrite: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(matrix + epsilon I)^(-exponent_multiplier / root)`` of a symmetric PSD matrix.

    The matrix is symmetrised first (``(A + A^T) / 2``) unless ``overwrite``: the caller's matrix is
    then exactly symmetric already (Shampoo's factors after ``structured.symmetrize_``; the
    symmetrised copy would equal it bit for bit) and may be overwritten, so no copy is made (two
    block-sized temporaries less per root, a visible part of a refresh on the CPU).

    ``eigh``: ``lam, Q = eigh(A + eps I)``; if ``min(lam) < eps`` (round-off made the damped matrix
    less definite than it should be) all eigenvalues are shifted up by ``eps - min(lam)``; the
    result is ``Q diag(lam^-alpha) Q^T``. The error is 0 (the method is exact up to round-off).

    ``coupled_newton`` (order 2) and ``higher_order`` (``order`` >= 3) iterate ``X_k -> A^(-1/p)``
    with ``M_k = X_k^p A -> I``: ``T = sum_{j<order} c_j (I - M)^j`` with ``c_j`` the binomial-series
    coefficients of ``(1 - x)^(-1/p)``, ``X <- X T``, ``M <- T^p M``; started from ``M_0 = z A``,
    ``X_0 = z^(1/p) I``. They need an integer ``p = root`` and ``exponent_multiplier == 1``. The
    error is ``max |M - I|``; iteration stops when it is below ``tolerance``, after
    ``max_iterations``, or when it has not improved for 8 iterations (the best iterate is kept).

    Returns ``(root_inverse, error, ok)`` where ``ok`` is a 0-d bool tensor: the result is finite
    (callers compare ``error`` with their own failure threshold).
    """
    if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"matrix_inverse_root: expected a square matrix, got shape {tuple(matrix.shape)}")
    n = matrix.shape[0]
    a = matrix if overwrite else symmetric_part(matrix)
    if method == "eigh":
        alpha = exponent_multiplier / root
        a.diagonal().add_(epsilon)  # a is a fresh tensor or the caller's to overwrite
        lam, q = symmetric_eigh(a)
        x = inverse_root_from_eigen(lam, q, epsilon, alpha)
        error = torch.zeros((), dtype=a.dtype, device=a.device)
        return x, error, all_finite(x)
    if method not in ("coupled_newton", "higher_order"):
        raise ValueError(f"root_inverse must be one of {ROOT_METHODS}, got {method!r}")
    eye = torch.eye(n, dtype=a.dtype, device=a.device)
    p = int(round(root))
    if p != root or p < 1 or exponent_multiplier != 1.0:
        raise ValueError(
            f"root_inverse={method!r} needs an integer root and exponent_multiplier=1 "
            f"(got root {root}, exponent_multiplier {exponent_multiplier}); use root_inverse='eigh'"
        )
    q_order = 2 if method == "coupled_newton" else max(3, int(order))
    if tolerance is None:
        tolerance = 1e-10 if a.dtype == torch.float64 else 1e-5
    damped = a + epsilon * eye
    # Binomial-series coefficients of (1 - x)^(-1/p): c_0 = 1, c_j = c_{j-1} (1/p + j - 1) / j.
    coeffs = [1.0]
    for j in range(1, q_order):
        coeffs.append(coeffs[-1] * (1.0 / p + j - 1) / j)
    if q_order == 2:
        z = (1.0 + p) / (2.0 * torch.linalg.matrix_norm(damped))  # Higham's scaling for Newton
    else:
        z = 1.0 / torch.linalg.matrix_norm(damped)  # eigenvalues of M_0 in (0, 1]: the series converges
    m = damped * z
    x = eye * z.pow(1.0 / p)
    error = (m - eye).abs().max()
    best_x, best_err, stale = x, error, 0
    for _ in range(max_iterations):
        # One scalar read per iteration (amortised: roots are refreshed every few steps). The
        # iteration converges for any SPD matrix from this start (Guo & Higham 2006), but the error
        # need not decrease monotonically early on: keep the best iterate, stop on stagnation.
        if not bool(best_err > tolerance) or stale >= 8:
            break
        e = eye - m
        t = eye * coeffs[-1]
        for c in reversed(coeffs[:-1]):  # Horner: t = c_0 I + e (c_1 I + e (c_2 I + ...))
            t = c * eye + e @ t
        x = x @ t
        m = symmetric_part(torch.linalg.matrix_power(t, p) @ m)
        error = (m - eye).abs().max()
        if not bool(torch.isfinite(error)):
            break
        if bool(error < best_err):
            best_x, best_err, stale = x, error, 0
        else:
            stale += 1
    x = symmetric_part(best_x)
    return x, best_err, all_finite(x) & torch.isfinite(best_err)


def inverse_root_from_eigen(
    lam: torch.Tensor,
    q: torch.Tensor,
    epsilon: float,
    alpha: float,
    work: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``Q diag(lam'^-alpha) Q^T`` from the eigenpairs of a damped matrix ``A + epsilon I``, with
    ``lam' = lam + max(0, epsilon - min(lam))``: round-off that made the damped matrix less
    definite than ``epsilon`` is undone by shifting every eigenvalue up (:func:`matrix_inverse_root`'s
    ``eigh`` method and :func:`warm_eigh`'s callers share this). Exactly symmetric: the mirror of
    its lower triangle (``structured.symmetric_product(..., mirrored=True)``), the form a stored
    root takes. ``work``: two contiguous tensors of ``q``'s shape and dtype, for the result and
    ``Q diag(lam'^-alpha)``, made here without them (the result is the first; a caller's reused
    ones save the page faults of fresh block-sized tensors on the CPU). ``Q diag(lam'^-alpha)``
    takes ``q``'s layout, in the work tensor or a fresh one alike: column-major for ``eigh``'s
    eigenvectors (:func:`column_major`; a transposed pass into a row-major one is many times
    slower on the CPU), row-major for a kept basis. So the products, and the root's bits, do not
    depend on who made the work tensors."""
    if work is None:
        work = (q.new_empty(q.shape), q.new_empty(q.shape))
    scaled_out = work[1].mT if column_major(q) else work[1]
    scaled = torch.mul(q, inverse_root_spectrum(lam, epsilon, alpha), out=scaled_out)
    return symmetric_product(scaled, q.T, mirrored=True, out=work[0])


def inverse_root_spectrum(lam: torch.Tensor, epsilon: float, alpha: float) -> torch.Tensor:
    """``lam'^-alpha``: the eigenvalues of :func:`inverse_root_from_eigen`'s result (``lam'`` the
    shifted ``lam``), which quantised eigenvectors keep beside them (:mod:`dist_optim.states.lowbit`)."""
    lam = lam + (epsilon - lam.min()).clamp(min=0)
    return lam.pow(-alpha)


def canonical_signs(q: torch.Tensor) -> torch.Tensor:
    """Flip columns of ``q`` so that each column's entry of largest magnitude is positive.

    Eigenvectors are defined up to sign; a fixed convention makes bases comparable between runs
    and precisions (the optimizer's result does not depend on it)."""
    idx = q.abs().argmax(dim=0, keepdim=True)
    signs = torch.sign(torch.gather(q, 0, idx))
    signs = torch.where(signs == 0, torch.ones_like(signs), signs)
    return q * signs


def eigenbasis(matrix: torch.Tensor, descending: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvectors of a symmetric matrix, columns in decreasing eigenvalue order (Vyas et al.'s
    SOAP flips ``eigh``'s) or, with ``descending=False``, in ``eigh``'s increasing order (Meta's
    ``EighEigendecompositionConfig``), canonical signs, and whether the result is finite. SOAP's
    second moment stays in the basis's coordinates across a refresh, so the order is part of the
    algorithm."""
    _, q = symmetric_eigh(symmetric_part(matrix))
    q = canonical_signs(q.flip(-1) if descending else q)
    return q, all_finite(q)


def qr_algorithm_step(matrix: torch.Tensor, basis: torch.Tensor, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the QR algorithm on ``matrix + epsilon I``, warm-started from the orthonormal
    ``basis``: Meta's ``QREigendecompositionConfig(max_iterations=1)``, the basis refresh of its
    ``DefaultSOAPConfig`` (facebookresearch/optimizers, ``matrix_functions.py``, ``qr_algorithm``).

    ``B = Q^T (A + epsilon I) Q``, ``Q' R = qr(B)``, ``Q <- Q Q'``; then the columns are sorted by
    their estimated eigenvalues ``diag(R Q')`` (``= diag(Q'^T B Q')``) in increasing order, a
    stable sort. Signs are LAPACK's, not normalised (as Meta's). Meta skips the QR decomposition
    when ``B`` is exactly diagonal (its default tolerance is 0); LAPACK's Householder QR of a
    diagonal matrix is ``Q' = I``, so the result is the same without that test and its host read.
    ``matrix`` must be symmetric (the caller's factors are mirrored before a refresh).

    Returns ``(new basis, ok)``, ``ok`` a 0-d bool tensor: the basis is finite.
    """
    a = matrix + epsilon * torch.eye(matrix.shape[0], dtype=matrix.dtype, device=matrix.device)
    b = basis.T @ a @ basis
    q, r = torch.linalg.qr(b)
    estimates = torch.einsum("ij,ji->i", r, q)  # diag(R Q') without the product
    new = (basis @ q)[:, torch.sort(estimates, stable=True).indices]
    return new, all_finite(new)


def qr_power_step(matrix: torch.Tensor, basis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One warm-started power iteration on ``matrix`` from the orthonormal ``basis``, as Vyas et
    al.'s SOAP code refreshes its bases after the first (``eigh``) one.

    The columns of ``basis`` are first sorted by their Rayleigh quotients ``diag(Q^T A Q)``
    (decreasing), then ``Q' R = qr(A Q)`` (mathematically the same as ``Q qr(Q^T A Q)``), with
    ``R``'s diagonal made non-negative so the factorisation is unique. Returns ``(new basis,
    permutation applied to the columns, ok)``; callers permute whatever they store in the
    rotated coordinates with the same permutation.
    """
    a = symmetric_part(matrix)
    # A Q serves both the quotients and the power step (its columns permuted): one product where
    # a three-operand einsum and a second product cost more than the QR itself.
    aq = a @ basis
    estimates = (basis * aq).sum(0)
    perm = torch.argsort(estimates, descending=True, stable=True)
    q_new, r = torch.linalg.qr(aq[:, perm])
    signs = torch.sign(torch.diagonal(r))
    signs = torch.where(signs == 0, torch.ones_like(signs), signs)
    q_new = q_new * signs
    return q_new, perm, all_finite(q_new)


#: What heavyball adds to a factor's diagonal before its first ``eigh`` (``_stable_symmetric_basis``).
LIFTED_EIGH_SHIFT = 1e-30


def lifted_eigh_start(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """heavyball's first basis of a factor (``utils.get_orthogonal_matrix``): the eigenvectors of
    ``matrix + 1e-30 I`` in decreasing eigenvalue order, with LAPACK's signs (not made canonical:
    :func:`lifted_qr_step` carries every column's sign on, so that the bases stay heavyball's).
    ``matrix`` is used as it is, not symmetrised: a factor seeded with one Gram matrix is rank
    deficient, and which basis ``eigh`` gives its null space depends on the matrix's last bits.
    Returns ``(basis, ok)``."""
    eye = torch.eye(matrix.shape[-1], dtype=matrix.dtype, device=matrix.device)
    q = torch.linalg.eigh(matrix + LIFTED_EIGH_SHIFT * eye).eigenvectors.flip(-1).contiguous()
    return q, all_finite(q)


def lifted_qr_step(matrix: torch.Tensor, basis: torch.Tensor, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """heavyball's basis refresh (``utils.get_orthogonal_matrix_QR``, heavyball 3.2.1): one power
    step ``qr((A + c I) Q)`` from the orthonormal ``basis`` ``Q``, the lift ``c = max(floor,
    min(64 d eps_dtype, 1/8)) max_j |e_j|`` with ``e = diag(Q^T A Q)``. A factor of a
    rank-deficient Gram (a few steps of a non-square gradient) has a null space whose power step
    would otherwise be rounding noise; lifted, those columns stay close to their previous ones.

    The QR runs on the columns sorted by decreasing ``e`` (Gram-Schmidt from the dominant
    eigenvector, as Vyas et al.'s step), ``R``'s diagonal made non-negative, and each result goes
    back to its column's place: no permutation of what is kept in the rotated coordinates (unlike
    :func:`qr_power_step`). The products are heavyball's own (``einsum`` on a leading batch axis),
    so that in float64 the bases are heavyball's bit for bit, null spaces included. ``matrix`` is
    used as it is. Returns ``(new basis, ok)``."""
    m, q_old = matrix[None], basis[None]
    gram_basis = m @ q_old
    eig = torch.einsum("...ij,...ij->...j", q_old, gram_basis)
    magnitude = eig.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(m.dtype).tiny)
    noise = min(64 * m.shape[-1] * torch.finfo(m.dtype).eps, 0.125)
    lift = torch.maximum(
        torch.as_tensor(floor, dtype=m.dtype, device=m.device), torch.as_tensor(noise, dtype=m.dtype, device=m.device)
    )
    work = gram_basis + (lift * magnitude).unsqueeze(-1) * q_old
    index = torch.argsort(eig, descending=True).unsqueeze(-2).expand_as(work)
    orthogonal, triangular = torch.linalg.qr(work.gather(-1, index))
    signs = triangular.diagonal(dim1=-2, dim2=-1).sign()
    signs = torch.where(signs != 0, signs, torch.ones_like(signs))
    q = work.scatter(-1, index, orthogonal * signs.unsqueeze(-2))[0]
    return q, all_finite(q)


def off_diagonal_ratio(b: torch.Tensor) -> torch.Tensor:
    """``||B - diag(B)||_F / ||B||_F`` (0 for a zero matrix), a 0-d tensor.

    With ``B = Q^T A Q`` for an orthonormal ``Q`` this is the relative error of the approximation
    ``A' = Q diag(B) Q^T``: ``||A - A'||_F = ||B - diag(B)||_F`` and ``||B||_F = ||A||_F`` (the
    criterion of Meta's ``EigendecompositionConfig.tolerance``)."""
    total = torch.linalg.vector_norm(b)
    diag = torch.linalg.vector_norm(torch.diagonal(b))
    off = (total.square() - diag.square()).clamp(min=0).sqrt()
    return torch.where(total > 0, off / total, torch.zeros_like(total))


class WarmEigh(NamedTuple):
    """What :func:`warm_eigh` returns."""

    eigenvalues: torch.Tensor  # diag(Q^T A Q) (eigh's eigenvalues after a recomputation)
    eigenvectors: torch.Tensor  # Q, orthonormal columns (kept: the caller's basis tensor itself)
    perm: torch.Tensor | None  # the columns of ``basis`` were reordered by this before QR steps (None: not)
    iterations: int  # QR-algorithm steps taken (0: the previous eigenvectors were kept)
    recomputed: bool  # the tolerance was not met after ``max_iterations`` steps: ``eigh`` made the result

    @property
    def kept(self) -> bool:
        """The previous eigenvectors were kept as they are (the eigenvectors are the basis given)."""
        return self.iterations == 0 and not self.recomputed


class Shifted(NamedTuple):
    """``scale M + shift I`` for a symmetric ``M``, the matrix a refresh decomposes, given to
    :func:`residual_ratio` (and :func:`warm_criteria`) without being formed: a block-sized tensor
    and its pass less per factor; the criterion is computed from ``M Q``, ``A Q`` never formed."""

    matrix: torch.Tensor
    scale: float = 1.0
    shift: float = 0.0


def residual_ratio(
    matrix: torch.Tensor | Shifted, basis: torch.Tensor, work: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d, rho)`` for a symmetric ``A`` and an orthonormal ``Q``: ``d = diag(Q^T A Q)``, the
    column dot products ``d_i = q_i . (A q_i)``, and ``rho = ||A Q - Q diag(d)||_F / ||A||_F`` (0
    for a zero ``A``).

    For an orthonormal ``Q``, ``||A Q - Q diag(d)||_F = ||Q^T A Q - diag(d)||_F = ||A - Q diag(d)
    Q^T||_F`` and ``||A||_F = ||Q^T A Q||_F``: ``rho`` is :func:`off_diagonal_ratio` of ``B = Q^T A
    Q`` and the relative error of ``A' = Q diag(d) Q^T``, computed from one product ``A Q`` and
    O(n^2) elementwise work instead of the second (symmetric) product that forms ``B``. The
    denominator is ``||A||_F`` itself (what the accuracy statement of :func:`warm_eigh` is about;
    ``||B||_F`` equals it up to the rounding of ``Q``'s orthonormality). The residual is formed
    explicitly, not as ``||A Q||_F^2 - ||d||^2``, whose cancellation in fp32 is as large as the
    squared ratio at tolerances near 1e-3.

    ``A`` may be given as :class:`Shifted` ``(M, s, e)``: its criterion is ``M``'s scaled, from one
    product ``M Q``. With ``d_M = diag(Q^T M Q)``, ``d = s d_M + e`` (``q_i . q_i = 1``) and ``A Q -
    Q diag(d) = s (M Q - Q diag(d_M))``: the shift, which moves no eigenvector, drops out of the
    residual. ``||A||_F^2 = s^2 ||M||_F^2 + e (2 s tr M + n e)`` (exact for a symmetric ``M``; the
    last term is not negative for a positive semi-definite one). ``work``: two contiguous tensors
    of ``basis``'s shape and dtype, for ``M Q`` and the products of the dot products, made here
    without them (a fresh block-sized tensor costs page faults on the CPU: :func:`warm_criteria`
    reuses them)."""
    m, scale, shift = matrix if isinstance(matrix, Shifted) else (matrix, 1.0, 0.0)
    if work is None:  # the same layouts as given ones: the bits do not depend on who made them
        work = (basis.new_empty(basis.shape), basis.new_empty(basis.shape))
    mq = torch.mm(m, basis, out=work[0])
    d = torch.mul(basis, mq, out=work[1]).sum(0)
    # In place: a fresh block-sized temporary costs page faults on the CPU (state.Scratch).
    off = torch.linalg.vector_norm(mq.addcmul_(basis, d, value=-1))
    total = torch.linalg.vector_norm(m)
    if isinstance(matrix, Shifted):
        off = off * abs(scale)
        d = d * scale + shift
        shifted = shift * (2 * scale * torch.diagonal(m).sum() + m.shape[0] * shift)
        total = torch.hypot(total * abs(scale), shifted.clamp(min=0).sqrt())
    return d, torch.where(total > 0, off / total.clamp(min=torch.finfo(total.dtype).tiny), 0.0)


class WarmCriterion(NamedTuple):
    """:func:`warm_eigh`'s criterion for one ``(matrix, basis)`` pair, as :func:`warm_criteria`
    returns it."""

    eigenvalues: torch.Tensor  # d = diag(Q^T A Q)
    keep: bool  # rho <= tolerance: the basis is kept, d are the eigenvalues

    def kept(self, basis: torch.Tensor) -> WarmEigh:
        """:func:`warm_eigh`'s result for a pair whose criterion keeps ``basis`` (its
        eigenvalues the criterion's ``d``): it needs no more of the matrix, so a caller holding
        the criterion need not build the matrix again."""
        assert self.keep, "the criterion does not keep the basis"
        return WarmEigh(self.eigenvalues, basis, None, 0, False)


def warm_criteria(
    pairs: Iterable[tuple[torch.Tensor | Shifted, torch.Tensor]], tolerance: float
) -> list[WarmCriterion]:
    """:func:`warm_eigh`'s criterion (:func:`residual_ratio`, ``rho <= tolerance``) for every
    ``(matrix, basis)`` pair, with one host read for all of them: on a GPU each read waits for
    the device to finish what was queued, so a refresh that read per factor stalled the host once
    per factor. Each comparison is made in its pair's own dtype (the tolerance rounded to it, as
    a tensor comparison does), so a pair's decision does not depend on the others."""
    # Consumed one pair at a time: a caller's generator then holds one matrix, not all of them.
    # The work tensors of one shape serve every pair of that shape (the d are fresh vectors).
    works: dict[tuple[tuple[int, ...], torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
    found = []
    for matrix, basis in pairs:
        key = (tuple(basis.shape), basis.dtype, basis.device)
        if key not in works:
            works[key] = (basis.new_empty(basis.shape), basis.new_empty(basis.shape))
        found.append(residual_ratio(matrix, basis, works[key]))
    if not found:
        return []
    keeps = torch.stack([ratio <= tolerance for _, ratio in found]).tolist()
    return [WarmCriterion(d, bool(keep)) for (d, _), keep in zip(found, keeps)]


def warm_eigh(
    matrix: torch.Tensor,
    basis: torch.Tensor,
    *,
    tolerance: float,
    max_iterations: int,
    criterion: WarmCriterion | None = None,
) -> WarmEigh:
    """The eigendecomposition of an exactly symmetric positive semi-definite ``matrix`` (a refresh's
    target) warm-started from an orthonormal ``basis`` (the previous refresh's eigenvectors).

    With ``d = diag(Q^T A Q)`` (column dot products) and ``rho = ||A Q - Q diag(d)||_F / ||A||_F``
    (:func:`residual_ratio`: the off-diagonal ratio of ``B = Q^T A Q`` without forming ``B``): if
    ``rho <= tolerance`` the result is ``(d, Q)``: the previous eigenvectors are kept and only the
    eigenvalues are re-estimated. Otherwise, with ``max_iterations > 0``, ``B`` is formed and its
    columns sorted by decreasing ``diag(B)`` (stable; ``perm``), since the unshifted QR algorithm
    orders eigenvalues decreasingly and would first undo any other order (from ``eigh``'s
    increasing order a step made the ratio of a perturbed factor several times larger), then steps
    of the QR algorithm on ``B`` follow until :func:`off_diagonal_ratio` ``(B) <= tolerance`` or
    ``max_iterations`` were taken: ``Q' R = qr(B)`` (``R``'s diagonal made non-negative, so that a
    basis that already diagonalises ``A`` maps to itself), ``B <- R Q'``, ``Q <- Q Q'``. If the
    tolerance is still not met, ``torch.linalg.eigh(A)`` is the result (by :func:`symmetric_eigh`),
    as it returns it (increasing eigenvalues, LAPACK's signs: a root made from it is bit for bit
    :func:`matrix_inverse_root`'s).

    Meta's ``distributed_shampoo`` has the two halves separately: ``EighEigendecompositionConfig(
    tolerance)`` skips ``eigh`` while the criterion holds (``max_iterations=0`` here), and
    ``QREigendecompositionConfig(max_iterations, tolerance)`` takes QR steps without sorting first
    and never recomputes; its criterion forms ``B`` (two products, ours one). Accuracy: whenever no
    recomputation happens, ``||A - Q diag(d) Q^T||_F <= tolerance ||A||_F`` up to the rounding of
    ``A Q`` and of ``Q``'s orthonormality (kept: ``rho``; after QR steps: the ratio of the ``B``
    they end with, relative to ``||B||_F``); ``tolerance=0`` recomputes unless ``A Q = Q diag(d)``
    exactly. One host read for the criterion (refreshes only), none where the caller gives the
    ``criterion`` of this pair (from :func:`warm_criteria`, which reads many at once), one per QR
    step.
    """
    if criterion is None:
        (criterion,) = warm_criteria([(matrix, basis)], tolerance)
    if criterion.keep:
        return criterion.kept(basis)
    if max_iterations > 0 and (stepped := _qr_steps(matrix, basis, tolerance, max_iterations)) is not None:
        return stepped
    lam, vectors = symmetric_eigh(matrix)
    return WarmEigh(lam, vectors, None, max_iterations, True)


def _qr_steps(matrix: torch.Tensor, basis: torch.Tensor, tolerance: float, max_iterations: int) -> WarmEigh | None:
    """:func:`warm_eigh`'s QR-algorithm steps on ``B = Q^T A Q`` (columns first sorted by
    decreasing ``diag(B)``): the result once :func:`off_diagonal_ratio` ``(B) <= tolerance``, None
    if ``max_iterations`` steps did not get there."""
    b = symmetric_product(basis.T, matrix @ basis)
    perm = torch.argsort(torch.diagonal(b), descending=True, stable=True)
    b = b[perm][:, perm]
    q = basis[:, perm]
    for iterations in range(1, max_iterations + 1):
        step, r = torch.linalg.qr(b)
        signs = torch.sign(torch.diagonal(r))
        signs = torch.where(signs == 0, torch.ones_like(signs), signs)
        step = step * signs
        b = (r * signs[:, None]) @ step
        q = q @ step
        if bool(off_diagonal_ratio(b) <= tolerance):
            return WarmEigh(torch.diagonal(b).clone(), q, perm, iterations, False)
    return None


def exponent_for(order: int, override: float, multiplier: float) -> tuple[float, float]:
    """``(root, exponent_multiplier)`` for a factor of a tensor block of ``order`` dims: the root
    is ``2 * order`` (Gupta et al. 2018) unless ``override`` is non-zero."""
    root = float(override) if override else 2.0 * order
    if not math.isfinite(root) or root <= 0:
        raise ValueError(f"exponent_override must be a positive number or 0, got {override}")
    return root, float(multiplier)
