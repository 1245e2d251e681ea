"""Kron's owner work on a large tensor one block at a time (the step-memory budget covers an
owner's work on one tensor too). Local tensors only, no communication.

When a dim of a tensor has a *diagonal* factor (a Llama embedding or LM head, 32000 x 8192, whose
vocabulary dim exceeds ``max_size_triangular``; the MLP matrices 28672 x 8192 and 8192 x 28672),
every step of the algorithm but two acts on each index of that dim on its own: debiasing, the
probe noise, ``A = (Q_1 (x) ...) G`` and ``B = (Q_1^-T (x) ...) V`` (the diagonal factor scales
along its dim, the others act within each index of it), that factor's statistics (a sum within
each index) and the preconditioning. The two that are not: ``mean|G|`` (summed block by block
first) and the other factors' statistics ``A_(k) A_(k)^T`` (accumulated over the blocks in place,
:func:`dist_optim.kernels.structured.gram_update_`). So the owner works through ``ROW_BLOCK_BYTES`` of the
tensor at a time along that dim (dim 0 if it is diagonal, else the largest diagonal dim) and holds,
besides the momentum it received, the direction (written into the received momentum when that
buffer is the owner's own and in the preconditioner dtype: no second full-size tensor), the
factors' statistics and one block's temporaries. The probe is drawn block by block too, and a
non-owner drawing to keep the sequential generator in step draws and discards one chunk at a time
(:func:`probe_chunks`: the same calls on every rank).

Arithmetic (Llama-2-70B, fp32; the planner's figures in docs/planner.md): on the owner of an MLP
matrix (28672 x 8192, 0.94 GB a full-size tensor; the 8192 side triangular) the received
momentum (0.94 GB, the direction written into it), the triangular factor's two statistics
(``T1``, ``T2``, 0.27 GB each), about six block temporaries of 32 MiB, and in the factor's step
``T1 - T2``, ``T1 + T2`` and the product with the factor (0.27 GB each, the momentum still held):
about 1.8 GB. Whole-tensor work on it held about eight full-size temporaries (7.5 GB). A
square 8192 x 8192 matrix (both factors triangular, 0.27 GB) is worked on whole: its
statistics are as large as the tensor, and its peak is five tensors of its size besides the
received momentum (debiased in place): ``A``, ``B``, ``T1 - T2``, ``T1 + T2`` and one
temporary of the spectral bound (1.3 GB). With ``use_symmetric_packing`` the owner also holds its
triangular factors unpacked whole (reused scratch, :class:`~dist_optim.kron.state.FactorScratch`:
0.27 GB for the 8192 side): that is the irreducible working set, since a factor acts whole within
every block, and it is no larger than the factor's statistics ``T1``, ``T2`` the fit holds anyway.

Deviations: the two sums over blocks are added in another order than over the whole tensor (fp32
rounding, ~1e-7 relative); a single device takes the same path (the choice depends only on the
full shape and dtype), so every layout gets the same result. The probe of a block along dim ``d``
is drawn in the order of the tensor with ``d`` moved to the front: for ``d = 0`` (rows) the same
numbers as one whole draw on the CPU generator (each block a multiple of 16 elements, tested),
for ``d > 0`` the same numbers in another arrangement than kron_torch's one draw (same
distribution). CUDA's Philox generator draws other numbers per call than at once, so on a GPU the
probes of tensors above ``ROW_BLOCK_MIN_BYTES`` differ from kron_torch's (same distribution).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .structure import FactorPlan

__all__ = [
    "ROW_BLOCK_MIN_BYTES",
    "ROW_BLOCK_BYTES",
    "Blocks",
    "block_plan",
    "probe_chunks",
    "draw_probe",
    "discard_probe",
    "factor_block",
]

#: Tensors of at least this many bytes (in the preconditioner dtype) with a diagonal factor are
#: worked on in blocks along that factor's dim, and their probes drawn in chunks.
ROW_BLOCK_MIN_BYTES = 64 * 2**20
#: The bytes of one block (rounded to whole slices, at least 16 elements) and of one probe chunk.
ROW_BLOCK_BYTES = 32 * 2**20


@dataclass(frozen=True)
class Blocks:
    """Blocks of ``size`` indices along dim ``dim`` (which has a diagonal factor) of a tensor of
    ``n`` indices along it."""

    dim: int
    size: int
    n: int

    def spans(self) -> list[tuple[int, int]]:
        """The ``[lo, hi)`` index ranges of the blocks."""
        return [(lo, min(lo + self.size, self.n)) for lo in range(0, self.n, self.size)]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _large(shape: Sequence[int], dtype: torch.dtype) -> bool:
    return math.prod(shape) * _itemsize(dtype) >= ROW_BLOCK_MIN_BYTES


def block_plan(plan: FactorPlan, dtype: torch.dtype) -> Blocks | None:
    """How the owner works on a tensor of ``plan`` in ``dtype``: in blocks along its first dim
    with a diagonal factor (dim 0 if it has one, else the largest such dim), or None when whole
    (small, a vector, no diagonal factor, or one block would hold it all). Each block holds a
    multiple of 16 elements: the probe's chunks (:func:`probe_chunks`) are the blocks."""
    shape = plan.shape
    if len(shape) < 2 or not any(plan.diag) or not _large(shape, dtype):
        return None
    diagonal = [d for d in range(len(shape)) if plan.diag[d]]
    dim = 0 if plan.diag[0] else max(diagonal, key=lambda d: (shape[d], -d))
    inner = math.prod(shape) // shape[dim]
    if inner == 0:
        return None
    step = 16 // math.gcd(inner, 16)
    size = max(step, ROW_BLOCK_BYTES // (inner * _itemsize(dtype)) // step * step)
    return Blocks(dim, size, shape[dim]) if size < shape[dim] else None


def _moved(shape: Sequence[int], dim: int) -> tuple[int, ...]:
    """``shape`` with ``dim`` moved to the front."""
    return (shape[dim],) + tuple(shape[:dim]) + tuple(shape[dim + 1 :])


def probe_chunks(plan: FactorPlan, dtype: torch.dtype) -> list[int]:
    """The numbers of elements the probe is drawn in, one call each, the same on every rank (owner
    or not) and on a single device, so that every generator stays in step (CUDA's Philox advances
    per call): the blocks of :func:`block_plan`, else chunks of ``ROW_BLOCK_BYTES`` for a large
    tensor, else the whole. Each chunk but the last holds a multiple of 16 elements."""
    numel = math.prod(plan.shape)
    blocks = block_plan(plan, dtype)
    if blocks is not None:
        inner = numel // plan.shape[blocks.dim]
        return [(hi - lo) * inner for lo, hi in blocks.spans()]
    if not _large(plan.shape, dtype):
        return [numel]
    size = max(16, ROW_BLOCK_BYTES // _itemsize(dtype) // 16 * 16)
    return [min(size, numel - a) for a in range(0, numel, size)]


def _normal(shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype, device: Any) -> torch.Tensor:
    """``N(0, 1)`` numbers of ``shape`` from ``gen``; on the meta device (the planner's simulated
    step) an uninitialised tensor of the same memory: there are no numbers to draw, and torch
    decomposes a meta ``randn`` into a dozen reference operators, a large part of a simulated Kron
    step (``time python -m dist_optim.plan --model llama-70b --tp 8 --dp 8 --zero 1 --optimizer kron``)."""
    if torch.device(device).type == "meta":
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.randn(shape, generator=gen, dtype=dtype, device=device)


def draw_probe(gen: torch.Generator, plan: FactorPlan, dtype: torch.dtype, device: Any) -> Iterator[torch.Tensor]:
    """The probe ``V ~ N(0, 1)`` of ``plan.shape`` from ``gen``: with a :func:`block_plan`, its
    blocks one at a time, each drawn when asked for (the numbers of a block along dim ``d`` fill
    it in the order of the tensor with ``d`` moved to the front: for ``d = 0`` the order of one
    whole draw, tested on the CPU generator); otherwise the whole tensor, drawn chunk by chunk."""
    shape = tuple(plan.shape)
    blocks = block_plan(plan, dtype)
    if blocks is not None:
        rest = _moved(shape, blocks.dim)[1:]
        for lo, hi in blocks.spans():
            yield _normal((hi - lo,) + rest, gen, dtype, device).movedim(0, blocks.dim)
        return
    chunks = probe_chunks(plan, dtype)
    if len(chunks) == 1:  # drawn at once, as kron_torch does
        yield _normal(shape, gen, dtype, device)
        return
    whole = torch.empty(shape, dtype=dtype, device=device)
    flat, start = whole.view(-1), 0
    for size in chunks:
        flat[start : start + size] = _normal((size,), gen, dtype, device)
        start += size
    pending = [whole]
    del whole, flat  # the suspended generator must not keep the probe alive after handing it over
    yield pending.pop()


def discard_probe(gen: torch.Generator, plan: FactorPlan, dtype: torch.dtype, device: Any) -> None:
    """Draw the probe's numbers chunk by chunk and drop them: a non-owner keeps the sequential
    generator in step holding one chunk at a time."""
    for size in probe_chunks(plan, dtype):
        _normal((size,), gen, dtype, device)


def factor_block(factors: Sequence[torch.Tensor], dim: int, lo: int, hi: int) -> list[torch.Tensor]:
    """The factors as they act on indices ``[lo, hi)`` of ``dim``: that (diagonal) factor cut."""
    out = list(factors)
    out[dim] = out[dim][lo:hi]
    return out
