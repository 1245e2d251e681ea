"""Muon's Newton-Schulz orthogonalization (K. Jordan et al., 2024, "Muon: An optimizer for hidden
layers in neural networks", kellerjordan.github.io/posts/muon) on one local matrix, and its cost as
torch's ``FlopCounterMode`` counts it (the owners' cost model, :mod:`dist_optim.muon`).

Deviations from the formula as written: in fp32/fp64 (:data:`REORDERED_DTYPES`) every product
known to be symmetric is computed one off-diagonal block at a time
(:func:`~dist_optim.kernels.structured.symmetric_product`); and, opt-in in every dtype
(``gram_space=True``, ``DistributedMuon(ns_gram_space=True)``), a wide matrix iterates in Gram
space, restarted every :data:`GRAM_SPACE_RESTART_EVERY` iterations
(:func:`newton_schulz_gram_space`), which is faster and somewhat less accurate (its accuracy:
:data:`GRAM_SPACE_RESTART_EVERY`), and the other matrices take the blocked symmetric products in
bfloat16/float16 too (:func:`reorders`). Otherwise bfloat16/float16 iterations keep the formula's
order (torch.optim.Muon's, so that its conversions compute exactly what it does).

On a GPU, where a Muon step of small matrices is bound by the host's kernel launches rather than
by the products, :func:`newton_schulz_many` iterates the matrices of one shape together, one
batched product per product of the formula: the same formula, in the batched kernels' rounding.
The CPU does the same in :data:`CPU_BATCHED_DTYPES` (bfloat16), whose batched products are
faster there (:func:`iterates_batched`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from .replay import replayable
from .structured import blocked, symmetric_product

__all__ = [
    "Coefficients",
    "GRAM_SPACE_RATIO",
    "REORDERED_DTYPES",
    "SYMMETRIC_MIN_SIZE",
    "BATCH_BYTES",
    "CPU_BATCHED_DTYPES",
    "iterates_batched",
    "newton_schulz",
    "newton_schulz_batched",
    "newton_schulz_gram_space",
    "newton_schulz_many",
    "newton_schulz_flops",
    "reorders",
    "symmetric_product_flops",
    "takes_gram_space",
]

Coefficients = tuple[float, float, float]

#: With ``gram_space=True``, a wide ``m x n`` matrix (``n >= GRAM_SPACE_RATIO * m``) iterates in Gram
#: space. Counting every symmetric product at 3/4 of a general one (one halving), five iterations
#: of the formula cost ``17.5 m^2 n + 7.5 m^3`` flops and Gram space (blocks of 3 and 2)
#: ``7 m^2 n + 21 m^3``: they cross at ``n = 1.3 m``; 2 leaves a margin (Llama's shapes are square
#: or at least 2.7 wide).
GRAM_SPACE_RATIO = 2.0
#: Gram space restarts from ``X`` (``X_k = Q_k X_0`` and a fresh ``A``) after this many iterations
#: (:func:`gram_space_blocks`; 5 iterations: blocks of 3 and 2). Without restarts the rounding
#: carried through a block grows to many times the formula's error on low-rank and ill-conditioned
#: momenta (the failure the Gram Newton-Schulz authors restart for); with them it stays within a
#: small factor of the formula's error in fp32 and near it in bf16/fp16, the bounds
#: tests/unit/test_muon.py asserts (``GRAM_SPACE_ERROR_FACTOR``, ``HALF_GRAM_STRESS_FACTOR``).
#: Every 2 iterations is more accurate but multiplies more (``12 m^2 n + 22 m^3`` multiply-adds over
#: 5 iterations instead of ``8 m^2 n + 28 m^3``, m <= n, more at a Llama MLP's aspect). Errors by
#: shape and dtype: ``bench/ns_accuracy.py``.
GRAM_SPACE_RESTART_EVERY = 3
#: Only fp32/fp64 iterations are reordered by default (symmetric products): in bfloat16
#: (torch.optim.Muon's and KellerJordan's iteration dtype) the formula's own order is kept, so
#: conversions from them compute exactly what they do; ``gram_space=True``, opt-in, reorders every
#: dtype (:func:`reorders`).
REORDERED_DTYPES = (torch.float32, torch.float64)
#: Diagonal blocks of a symmetric product halve down to this size (Muon's products are one-off,
#: unlike Kron's, so its own value): on one CPU thread 128 was about the fastest at 512 to 1024
#: sides (larger blocks save fewer flops, smaller ones lose them to call overhead); on two threads
#: the sizes tie. Measured once, not benched (the default path's time: ``bench/ns_accuracy.py --speed``).
SYMMETRIC_MIN_SIZE = 128
#: Matrices of more bytes than this, in a reordered iteration (:func:`reorders`), update
#: ``X <- a X + P X`` in place, one block of columns at a time (:data:`IN_PLACE_BLOCK_BYTES` per
#: block's product), instead of allocating a new ``X`` per iteration: the owner of a 70B MLP
#: matrix (8192 x 28672, 0.94 GB in fp32) holds one ``X`` and the ``m x m`` products, not two
#: ``X`` (part of the step-memory budget, :mod:`dist_optim.sharding.budget`). Below it, one ``addmm`` (the
#: fastest on small matrices).
IN_PLACE_MIN_BYTES = 64 * 2**20
#: The bytes of one column block's product in the in-place update (a block has at least one column).
IN_PLACE_BLOCK_BYTES = 32 * 2**20
#: The most bytes of one batch of :func:`newton_schulz_many` (its matrices stacked in their own
#: dtype; the iteration then holds the stack in the iteration's dtype, its Gram matrices and the
#: next stack): a bound on what batching adds to the step's transient memory, far below the
#: default ``bucket_bytes`` (256 MiB). A matrix of more than half of it goes alone: its products
#: are large enough to keep a GPU busy without company.
BATCH_BYTES = 32 * 2**20
#: Iteration dtypes in which the CPU (and the planner's meta tensors, which follow it) also iterates
#: a step's matrices in batches (:func:`iterates_batched`). bfloat16 keeps the formula's plain products
#: (:func:`reorders`), so batching loses no blocked product there, and one batched ``bmm`` per
#: product beats per-matrix ``mm`` for small bf16 matrices on a CPU, because a single ``mm`` barely
#: uses the second thread (the bf16 step in batches and per matrix: ``bench/vs_heavyball.py --only
#: muon``). float16 gains nothing at these sides, and fp32 would give up its blocked symmetric
#: products (fewer flops: :func:`newton_schulz_flops`, ``blocked``) for no gain: both stay per
#: matrix (measured once, not benched).
CPU_BATCHED_DTYPES = (torch.bfloat16,)


def takes_gram_space(rows: int, cols: int, steps: int, gram_space: bool) -> bool:
    """Whether :func:`newton_schulz` iterates a ``rows x cols`` matrix in Gram space: only when
    asked, with more than one iteration and ``max >= GRAM_SPACE_RATIO * min``, in every dtype."""
    m, n = min(rows, cols), max(rows, cols)
    return gram_space and steps > 1 and n >= GRAM_SPACE_RATIO * m


def reorders(dtype: torch.dtype, gram_space: bool) -> bool:
    """Whether :func:`newton_schulz` computes its symmetric products one off-diagonal block at a
    time (:func:`~dist_optim.kernels.structured.symmetric_product`) in ``dtype``: always in fp32/fp64
    (:data:`REORDERED_DTYPES`), in every dtype with ``gram_space=True`` (the opt-in reordering:
    Gram space for wide matrices, these products for the rest)."""
    return gram_space or dtype in REORDERED_DTYPES


@replayable
def newton_schulz(
    c: torch.Tensor,
    coefficients: Sequence[Coefficients],
    eps: float,
    eps_form: str = "max",
    dtype: torch.dtype | None = None,
    gram_space: bool = False,
    overwrite: bool = False,
) -> torch.Tensor:
    """The orthogonalized 2-D ``c``: normalised by its Frobenius norm, then one quintic
    Newton-Schulz iteration ``X <- a X + (b A + c A A) X`` (``A = X X^T``) per ``(a, b, c)`` in
    ``coefficients``, on the wide orientation (``X`` transposed when ``m > n``, so that ``A`` is
    the smaller Gram matrix), in ``dtype`` (default ``c``'s). A new tensor and ``c`` unchanged,
    unless ``overwrite`` (``c`` is the caller's scratch, e.g. a block an owner received): then
    ``c`` is normalised in place and, reordered (:func:`reorders`) above
    :data:`IN_PLACE_MIN_BYTES`, iterated in place and returned (one matrix held instead of two).

    In fp32/fp64 (:data:`REORDERED_DTYPES`) the symmetric products ``A = X X^T`` and ``A A`` are
    computed one off-diagonal block at a time (:func:`~dist_optim.kernels.structured.symmetric_product`):
    the formula in exact arithmetic, and as accurate in rounding: tests/unit/test_muon.py asserts
    that one fp32 step lands within 2x the plain formula's own fp32 distance to the formula run in
    float64, on 512-1536 wide gradients of rank 8, with singular values log-spaced over 1..1e-6, and
    Gaussian (larger shapes: ``bench/ns_accuracy.py``). With
    ``gram_space=True`` a wide matrix (:func:`takes_gram_space`) iterates in Gram space instead
    (:func:`newton_schulz_gram_space`, its accuracy there), and in bfloat16/float16 the others
    take the same blocked products, ``b A + c A A`` one ``addmm`` per block (rounded once, as the
    formula's ``addmm`` rounds it): tests/unit/test_muon.py asserts at most 1.1x the plain formula's
    relative Frobenius distance to float64 in that dtype (bit-equal where the kernels round each
    block's dot products as the whole product's).
    Otherwise in bfloat16/float16 the formula is computed in its own order."""
    converted = dtype is not None and dtype != c.dtype  # then x is a new tensor
    x = c.to(dtype) if converted else c
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    norm = x.norm()
    scale = norm.clamp(min=eps) if eps_form == "max" else norm + eps
    # In place where x is not the caller's (a dtype conversion made it) or the caller allows it.
    x = x.div_(scale) if overwrite or converted else x / scale
    if takes_gram_space(x.size(0), x.size(1), len(coefficients), gram_space):
        start = 0
        for length in gram_space_blocks(len(coefficients)):
            x = newton_schulz_gram_space(x, coefficients[start : start + length])
            start += length
    elif not reorders(x.dtype, gram_space):
        for a, b, cc in coefficients:
            gram = x @ x.T
            # b A + c A A and a X + B X in one kernel each, as torch.optim.Muon computes them.
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=cc)
            x = torch.addmm(x, poly, x, beta=a)
    else:
        in_place = x.numel() * x.element_size() > IN_PLACE_MIN_BYTES  # x is this call's own tensor
        for a, b, cc in coefficients:
            gram = symmetric_product(x, x.T, SYMMETRIC_MIN_SIZE)
            if x.dtype in REORDERED_DTYPES:
                # A separate scale and sum: one addmm per block was less accurate on small blocks.
                poly = symmetric_product(gram, gram, SYMMETRIC_MIN_SIZE).mul_(cc).add_(gram, alpha=b)
            else:
                # One rounding per element, as the formula's addmm: two roundings fail the bound of
                # test_half_precision_reordered_formula_rounds_as_the_formula (tests/unit/test_muon.py).
                poly = symmetric_product(gram, gram, SYMMETRIC_MIN_SIZE, add=(gram, b, cc))
            del gram
            x = _update_by_columns_(x, poly, a) if in_place else torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def iterates_batched(t: torch.Tensor, dtype: torch.dtype | None = None, gram_space: bool = False) -> bool:
    """Whether :func:`newton_schulz_many` iterates matrices like ``t`` in batches, in ``dtype``
    (default ``t``'s) with ``gram_space``: where products are one kernel each
    (:func:`~dist_optim.kernels.structured.blocked` is False: a GPU), so that a step's launches, not its
    flops, bound it; and elsewhere (the CPU, and the planner's meta tensors, which follow it) in
    :data:`CPU_BATCHED_DTYPES` when the iteration keeps the formula's plain products (not
    :func:`reorders`), where the batched products are faster. Otherwise each matrix iterates on
    its own, with its blocked products."""
    if not blocked(t):
        return True
    iterated = t.dtype if dtype is None else dtype
    return iterated in CPU_BATCHED_DTYPES and not reorders(iterated, gram_space)


def newton_schulz_many(
    cs: Sequence[torch.Tensor],
    coefficients: Sequence[Coefficients],
    eps: float,
    eps_form: str = "max",
    dtype: torch.dtype | None = None,
    gram_space: bool = False,
    overwrite: bool = False,
    batch: bool | None = None,
) -> list[torch.Tensor]:
    """:func:`newton_schulz` of each 2-D matrix of ``cs`` (the same options for all), in order.
    With ``batch`` (default: :func:`iterates_batched` of each matrix with the options, so a GPU's matrices
    and the CPU's bfloat16 iterations) the matrices of one shape in the wide orientation, dtype and
    device (on the CPU also of one orientation: tall ones stack as they are and iterate the
    stack's transposed view) are iterated together by
    :func:`newton_schulz_batched`, in batches of at most :data:`BATCH_BYTES`; a matrix that
    iterates in Gram space (:func:`takes_gram_space`), one of more than half of
    :data:`BATCH_BYTES`, and one without a partner go through :func:`newton_schulz` (``overwrite``
    applies to these). Without ``batch`` this is :func:`newton_schulz` per matrix, bit for bit."""
    out: list[torch.Tensor | None] = [None] * len(cs)
    alone: list[int] = []
    kinds: dict[tuple[Any, ...], list[list[int]]] = {}
    for i, c in enumerate(cs):
        rows, cols = c.shape
        nbytes = c.numel() * c.element_size()
        batched = iterates_batched(c, dtype, gram_space) if batch is None else batch
        if not batched or takes_gram_space(rows, cols, len(coefficients), gram_space) or 2 * nbytes > BATCH_BYTES:
            alone.append(i)
            continue
        # A tall matrix joins the wide ones of its transposed shape only where a stack is one kernel
        # (a GPU): on a CPU a transposing copy into the stack costs many times a plain one.
        stored_tall = rows > cols and blocked(c)
        runs = kinds.setdefault((min(rows, cols), max(rows, cols), c.dtype, c.device, stored_tall), [[]])
        if (len(runs[-1]) + 1) * nbytes > BATCH_BYTES:
            runs.append([])
        runs[-1].append(i)
    for (m, n, held, device, stored_tall), runs in kinds.items():
        for run in runs:
            if len(run) == 1:
                alone += run
                continue
            # Stacked in the iteration's dtype by the copies themselves (no stack in the matrices'
            # own dtype first), tall ones in their own orientation where stored_tall.
            stack = torch.empty(
                (len(run), n, m) if stored_tall else (len(run), m, n),
                dtype=held if dtype is None else dtype,
                device=device,
            )
            tall = [cs[i].size(0) > cs[i].size(1) for i in run]
            for k, (i, t) in enumerate(zip(run, tall)):
                stack[k].copy_(cs[i].T if t and not stored_tall else cs[i])
            x = newton_schulz_batched(stack.mT if stored_tall else stack, coefficients, eps, eps_form, dtype)
            for k, (i, t) in enumerate(zip(run, tall)):
                out[i] = x[k].T if t else x[k]
    for i in alone:
        out[i] = newton_schulz(cs[i], coefficients, eps, eps_form, dtype, gram_space, overwrite)
    assert all(x is not None for x in out)  # every matrix went alone or into one run
    return out  # type: ignore[return-value]


@replayable
def newton_schulz_batched(
    x: torch.Tensor,
    coefficients: Sequence[Coefficients],
    eps: float,
    eps_form: str = "max",
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The formula of :func:`newton_schulz` on each wide matrix ``x[k]`` of a ``K x m x n`` stack
    (``m <= n``; ``x`` is the caller's scratch and may be overwritten), one batched product per
    product of the formula: ``b A + c A A`` one ``baddbmm`` in bfloat16/float16 (rounded once, as
    the formula's ``addmm``), a product, scale and sum in fp32/fp64 (as :func:`newton_schulz`
    computes it there), each matrix normalised by its own Frobenius norm. Products are never
    blocked (the path of :func:`iterates_batched`: a GPU, and bfloat16 on the CPU, whose per-matrix
    iteration takes no blocked product either). The result's ``[k]`` is
    :func:`newton_schulz` of ``x[k]`` in exact arithmetic, in the batched kernels' rounding
    (tests/unit/test_muon_batches.py holds each matrix to the per-matrix iteration's own distance to
    float64)."""
    if dtype is not None and dtype != x.dtype:
        x = x.to(dtype)
    norm = torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True)
    x = x.div_(norm.clamp_(min=eps) if eps_form == "max" else norm.add_(eps))
    for a, b, cc in coefficients:
        gram = torch.bmm(x, x.mT)
        if x.dtype in REORDERED_DTYPES:
            poly = torch.bmm(gram, gram).mul_(cc).add_(gram, alpha=b)
        else:
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=cc)
        del gram
        x = torch.baddbmm(x, poly, x, beta=a)
    return x


def _update_by_columns_(x: torch.Tensor, poly: torch.Tensor, a: float) -> torch.Tensor:
    """``x <- a x + poly x`` in place, a block of columns at a time: every column of the result
    depends on its own column of ``x`` only, so each block is overwritten once computed. The same
    products as one ``addmm`` (each element the same length-``m`` dot product), computed per block."""
    m, n = x.shape
    cols = max(1, IN_PLACE_BLOCK_BYTES // max(1, m * x.element_size()))
    for start in range(0, n, cols):
        block = x[:, start : start + cols]
        block.copy_(torch.addmm(block, poly, block, beta=a))
    return x


def gram_space_blocks(steps: int) -> list[int]:
    """The iterations of each Gram-space block (:func:`newton_schulz_gram_space`) of ``steps``
    iterations: a restart from ``X`` after every :data:`GRAM_SPACE_RESTART_EVERY` (the last block
    shorter)."""
    every = GRAM_SPACE_RESTART_EVERY
    return [min(every, steps - start) for start in range(0, steps, every)]


@replayable
def newton_schulz_gram_space(x: torch.Tensor, coefficients: Sequence[Coefficients]) -> torch.Tensor:
    """The iterations of :func:`newton_schulz` on a normalised wide ``x`` (``m x n``, ``n >= 2m``),
    computed in ``m x m`` space (one block: :func:`newton_schulz` restarts from the result), as in
    the Gram Newton-Schulz of Dao AI Lab (2026, dao-lab.ai/blog/2026/gram-newton-schulz): opt-in
    (``DistributedMuon(ns_gram_space=True)``), since it is less accurate than the formula.

    Every ``P_k = a I + B_k``, ``B_k = b A_k + c A_k^2``, is a polynomial in ``A_0 = X_0 X_0^T``,
    so they commute: ``X_k = Q_k X_0`` with ``Q_k = P_k Q_{k-1}`` and ``A_{k+1} = P_k (P_k A_k)``.
    Each update is one ``addmm`` of ``B_k`` (``Q <- a Q + B Q``, ``A <- a A + B A``), never a
    product with ``P_k`` formed: ``a I + B_k`` rounded to bfloat16 loses the diagonal of ``B_k``
    below the spacing of ``a`` (3.4: 1/64), which left the result further from the formula than
    these updates do on Gaussian momenta (measured once, not benched). Only ``Q_1 = P_1`` is formed (a
    block of one iteration is the formula's own ``a X + B X``). Every ``m x m`` product here is of
    commuting symmetric matrices, hence symmetric, and is computed as one
    (:func:`~dist_optim.kernels.structured.symmetric_product`), as is ``A_0``. Flops:
    :func:`newton_schulz_flops`.

    Equal in exact arithmetic, not in rounding: the formula recomputes ``A`` from ``X`` every
    iteration, while here the rounding of ``A_0`` and of each update is carried through the block;
    the restarts (:func:`gram_space_blocks`) bound it. Accuracy: :data:`GRAM_SPACE_RESTART_EVERY`.

    With the option on, the other matrices take blockwise symmetric products in bf16/fp16 too
    (:func:`reorders`; ``bench/ns_accuracy.py --dtype bf16 --shapes 512x512 --speed`` times them). On a
    CPU with AMX, whose bf16 products are fast, those cost more than they save
    (``bench/vs_heavyball.py --only muon``, docs/benchmarks.md): leave the option off there."""
    gram = symmetric_product(x, x.T, SYMMETRIC_MIN_SIZE)
    q: torch.Tensor | None = None
    last = len(coefficients) - 1
    for k, (a, b, cc) in enumerate(coefficients):
        poly = symmetric_product(gram, gram, SYMMETRIC_MIN_SIZE, add=(gram, b, cc))
        if q is None:
            if k == last:
                return torch.addmm(x, poly, x, beta=a)
            q = poly.clone()
            q.diagonal().add_(a)
        else:
            q = symmetric_product(poly, q, SYMMETRIC_MIN_SIZE, add=(q, a, 1.0))
        if k < last:
            half = symmetric_product(poly, gram, SYMMETRIC_MIN_SIZE, add=(gram, a, 1.0))
            gram = symmetric_product(poly, half, SYMMETRIC_MIN_SIZE, add=(half, a, 1.0))
    assert q is not None
    return q @ x


@functools.lru_cache(maxsize=4096)
def symmetric_product_flops(size: int, min_size: int) -> int:
    """The flops ``FlopCounterMode`` counts for ``symmetric_product(a, b, min_size)`` with ``a`` of
    shape ``size x k``, per unit of ``k`` (multiply by ``k``): the recursion of
    :func:`~dist_optim.kernels.structured.symmetric_product`, ``T(s) = 2 s^2`` at or below ``min_size``,
    else ``T(h) + T(s - h) + 2 h (s - h)`` with ``h = s // 2``. The fraction ``T(s) / 2 s^2`` of an
    unblocked ``mm`` is 1 up to ``min_size``, then 3/4, 5/8, 9/16, ... per doubling, tending to 1/2."""
    if size <= min_size:
        return 2 * size * size
    h = size // 2
    return symmetric_product_flops(h, min_size) + symmetric_product_flops(size - h, min_size) + 2 * h * (size - h)


def newton_schulz_flops(
    rows: int, cols: int, steps: int, dtype: torch.dtype, gram_space: bool = False, blocked: bool = True
) -> float:
    """The floating-point operations of :func:`newton_schulz` on a ``rows x cols`` matrix with
    ``steps`` iterations in ``dtype``, exactly as torch's ``FlopCounterMode`` counts them (2 per
    multiply-add of every matrix product) on the path it takes: the owners' cost model
    (:func:`dist_optim.sharding.placement.assign_owners`), so owners balance the work that runs.
    ``blocked``: whether the symmetric products take their blocked forms, as on the CPU (and meta
    tensors); on a GPU each is one ``mm`` (:func:`dist_optim.kernels.structured.blocked` of the matrix is
    False), and ``T = 2 m^2`` below.

    With ``m <= n`` the sides and ``T = symmetric_product_flops(m, SYMMETRIC_MIN_SIZE)`` (``2 m^2``
    unblocked, ``f 2 m^2`` blocked, ``f`` = 5/8 at ``m = 512``, 9/16 at 1024):

    * bfloat16/float16 by default (plain products): ``steps (4 m^2 n + 2 m^3)``;
    * fp32/fp64, and every dtype with ``gram_space=True`` (:func:`reorders`), the formula with
      blocked symmetric products ``A = X X^T`` (``n T``) and ``A A`` (``m T``) and the general
      ``P X`` (``2 m^2 n``): ``steps (n T + m T + 2 m^2 n)``, i.e.
      ``(1 + f) / 2`` of the unblocked ``4 m^2 n`` and ``f`` of ``2 m^3``: the blocking runs
      0.75x the unblocked count at 512 x 512, 0.78x at 512 x 1376, 0.75x at 1024 x 2752;
    * Gram space (:func:`takes_gram_space`, every dtype), per block of ``L`` iterations
      (:func:`gram_space_blocks`): ``A`` (``n T``), the final ``Q X`` (``2 m^2 n``) and ``4 L - 3``
      symmetric ``m x m`` products: ``n T + 2 m^2 n + (4 L - 3) m T`` (a block of one is the
      formula's iteration, the same count). 5 iterations in blocks of 3 and 2, unblocked:
      ``8 m^2 n + 28 m^3``, 0.78x the formula's ``20 m^2 n + 10 m^3`` at ``n = 2.7 m`` and 0.67x at
      ``n = 4 m``; blocked, 0.70x the fp32 formula's count at 512 x 1376 (bfloat16: 0.55x its plain
      formula's)."""
    m, n = min(rows, cols), max(rows, cols)
    t = float(symmetric_product_flops(m, SYMMETRIC_MIN_SIZE if blocked else m))
    if takes_gram_space(rows, cols, steps, gram_space):
        return sum(n * t + 2.0 * m * m * n + (4 * length - 3) * m * t for length in gram_space_blocks(steps))
    if not reorders(dtype, gram_space):
        return steps * (4.0 * m * m * n + 2.0 * float(m) ** 3)
    return steps * (n * t + m * t + 2.0 * m * m * n)
