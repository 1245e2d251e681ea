"""Blocks of the full tensor, and the products every block's math is made of.

The blocking is a function of the full shape and the options alone, so every rank, whatever it
holds of a parameter (TP slice, ZeRO chunk), computes the same blocks:

* :func:`merge_small_dims`: consecutive dims merged while their product stays <= the largest block
  side (Anil et al.'s rule, ``merge_small_dims=True``), or heavyball's rule
  (:func:`merge_trailing_dims`, ``merge_small_dims="trailing"``);
* :func:`plan_blocks`: the (merged) view of a tensor cut into blocks of at most that side;
* :func:`kept_triangle`: the triangle of a factor that its symmetric updates keep current;
* :func:`apply_each_dim`: ``x x_0 m_0 x_1 m_1 ...``, a block times a matrix along every dim.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

__all__ = ["Block", "merge_small_dims", "merge_trailing_dims", "plan_blocks", "kept_triangle", "apply_each_dim"]


@dataclass(frozen=True)
class Block:
    """One block of a parameter: where it is in the (merged) view of the full tensor, its shape, and
    whether it is preconditioned (False: grafting only, ``skip_preconditioning_dim_size_gt``)."""

    slices: tuple[slice, ...]
    shape: tuple[int, ...]
    precondition: bool

    @property
    def order(self) -> int:
        return len(self.shape)

    @property
    def cost(self) -> float:
        """The owner cost model: elements, plus ``sum_k d_k^3`` for the factors' roots."""
        numel = math.prod(self.shape)
        return float(numel + (sum(d**3 for d in self.shape) if self.precondition else 0))

    @property
    def box(self) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` per dim of the view (:func:`dist_optim.sharding.placement.plan_route`'s boxes)."""
        return tuple((s.start, s.stop) for s in self.slices)


def merge_small_dims(shape: tuple[int, ...], max_dim: int) -> tuple[int, ...]:
    """Merge consecutive dims while their product stays <= ``max_dim`` (Anil et al.'s rule)."""
    if all(d == 1 for d in shape):
        return (1,)
    out: list[int] = []
    product = 1
    for d in shape:
        if product * d <= max_dim:
            product *= d
        else:
            if product > 1:
                out.append(product)
            product = d
    if product > 1:
        out.append(product)
    return tuple(out)


def merge_trailing_dims(shape: tuple[int, ...], max_dim: int) -> tuple[int, ...]:
    """heavyball's rule (``utils.dim_merger``, after Rozet): the first dim (a layer's fan-out) kept,
    the others merged from the last one while their product stays <= ``max_dim``, so that a conv
    kernel ``(128, 64, 3, 3)`` becomes ``(128, 576)``; dims of 1 after the first vanish."""
    out: list[int] = []
    product = 1
    for d in reversed(shape[1:]):
        if product * d <= max_dim:
            product *= d
        elif product > 1:
            out.append(product)
            product = d
        else:
            out.append(d)
    if product > 1:
        out.append(product)
    return (shape[0], *reversed(out))


def plan_blocks(
    full_shape: tuple[int, ...],
    max_preconditioner_dim: int,
    merge: bool | str = False,
    skip_preconditioning_dim_size_gt: int | None = None,
    precondition_1d: bool = True,
) -> tuple[tuple[int, ...], list[Block]]:
    """The view of a tensor of ``full_shape`` that the blocking cuts (a scalar is ``(1,)``, merged
    with ``merge``: True :func:`merge_small_dims`, ``"trailing"`` :func:`merge_trailing_dims`) and
    its blocks of at most ``max_preconditioner_dim`` along every dim, in row-major order of their
    positions. A view with a dim above ``skip_preconditioning_dim_size_gt``, or a 1-D view without
    ``precondition_1d``, gets blocks without preconditioner."""
    max_dim = max_preconditioner_dim
    view = tuple(full_shape) or (1,)
    if merge == "trailing":
        view = merge_trailing_dims(view, max_dim)
    elif merge:
        view = merge_small_dims(view, max_dim)
    skip = skip_preconditioning_dim_size_gt
    precondition = (skip is None or all(d <= skip for d in view)) and (precondition_1d or len(view) > 1)
    per_dim = [[slice(s, min(s + max_dim, d)) for s in range(0, d, max_dim)] for d in view]
    blocks = [Block(tuple(sl), tuple(s.stop - s.start for s in sl), precondition) for sl in itertools.product(*per_dim)]
    return view, blocks


def kept_triangle(factor: torch.Tensor, order: int, k: int) -> torch.Tensor:
    """The view of a factor whose lower triangle :func:`dist_optim.kernels.structured.gram_update_` keeps:
    the factor itself, or for the second dim of a matrix block (whose rows are the block's columns,
    a transposed view) its transpose, i.e. the upper triangle. BLAS reads a transposed operand
    faster when the output is transposed too, as the factor update then runs on contiguous memory
    (``.venv/bin/python bench/blas_triangle.py`` times the factor update's kernels)."""
    return factor.T if order == 2 and k == 1 else factor


def apply_each_dim(
    x: torch.Tensor,
    mats: list[torch.Tensor],
    transpose: bool,
    out: torch.Tensor | None = None,
    tmp: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x x_0 m_0 x_1 m_1 ...``: contract dim k of x with dim 0 of m_k (``transpose``: dim 1).

    Contracting the leading dim and appending the result at the end brings every dim back to its
    place after ``x.dim()`` contractions. Matrices and vectors (nearly every block) take the same
    contractions as ``m_0^T x m_1`` / ``m_0^T x`` products, which read transposed operands in place
    where ``tensordot`` would first copy them; these write into ``out`` when it is given (a
    contiguous tensor of the result's shape and dtype; other cases ignore it), and a matrix's
    intermediate ``m_0^T x`` into ``tmp`` when given (the same kind, of ``x``'s shape)."""
    if x.dim() == 1 and len(mats) == 1:
        m0 = mats[0] if transpose else mats[0].T
        return torch.mv(m0, x) if out is None else torch.mv(m0, x, out=out)
    if x.dim() == 2 and len(mats) == 2:
        m0, m1 = (mats[0], mats[1].T) if transpose else (mats[0].T, mats[1])
        left = torch.mm(m0, x) if tmp is None else torch.mm(m0, x, out=tmp)
        return torch.mm(left, m1) if out is None else torch.mm(left, m1, out=out)
    for m in mats:
        x = torch.tensordot(x, m, dims=([0], [1 if transpose else 0]))
    return x
