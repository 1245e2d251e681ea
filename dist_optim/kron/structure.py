"""Which preconditioner a parameter gets: its merged shape and the kind of each factor (as
kron_torch), and the cost model owners are assigned by.

A dim gets a diagonal factor when its size is 1 or exceeds ``max_size_triangular``, when the
tensor has fewer than ``min_ndim_triangular`` dims, or by ``memory_save_mode`` ("one_diag": the
largest dim, the last of equal largest ones; "all_diag": all; "smart_one_diag": the largest only
if strictly larger than the second); otherwise an upper-triangular one. With ``merge_dims`` a
tensor of more than 2 dims is preconditioned as the matrix ``[prod(s[:-1]), s[-1]]`` or ``[s[0],
prod(s[1:])]`` that kron_torch picks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["FactorPlan", "merged_shape", "diag_dims", "plan_factors", "precond_cost"]


@dataclass(frozen=True)
class FactorPlan:
    """A parameter's preconditioner: the (merged) full shape it acts on and, per dim, a diagonal
    (True) or upper-triangular factor. A 0-dim tensor has one scalar (diagonal) factor."""

    shape: tuple[int, ...]
    diag: tuple[bool, ...]

    def factor_shapes(self) -> list[tuple[int, ...]]:
        if not self.shape:
            return [()]
        return [(n,) if d else (n, n) for n, d in zip(self.shape, self.diag)]


def merged_shape(shape: tuple[int, ...], merge: bool) -> tuple[int, ...]:
    """kron_torch's choice for > 2 dims: ``[prod(s[:-1]), s[-1]]`` unless ``[s[0], prod(s[1:])]``
    has the smaller signed difference (second minus first)."""
    if len(shape) <= 2 or not merge:
        return shape
    last = (math.prod(shape[:-1]), shape[-1])
    first = (shape[0], math.prod(shape[1:]))
    return last if last[1] - last[0] <= first[1] - first[0] else first


def diag_dims(shape: tuple[int, ...], memory_save_mode: str | None, max_size: int, min_ndim: int) -> tuple[bool, ...]:
    """Per dim of ``shape``: whether its factor is diagonal (see the module docstring)."""
    ndim = len(shape)
    diag = [False] * ndim
    if ndim:
        # The largest dim; among equal largest ones the last (numpy's reversed argsort on <= 13 items).
        largest = max(range(ndim), key=lambda i: (shape[i], i))
        if memory_save_mode == "all_diag":
            diag = [True] * ndim
        elif memory_save_mode == "one_diag":
            diag[largest] = True
        elif memory_save_mode == "smart_one_diag":
            ordered = sorted(shape)
            if ndim > 1 and ordered[-1] > ordered[-2]:
                diag[largest] = True
    return tuple(d or n == 1 or n > max_size or ndim < min_ndim for n, d in zip(shape, diag))


def plan_factors(full_shape: tuple[int, ...], group: dict[str, Any]) -> FactorPlan:
    """The :class:`FactorPlan` of a parameter of ``full_shape`` in param group ``group``."""
    shape = merged_shape(tuple(full_shape), bool(group["merge_dims"]))
    if group.get("variant") == "heavyball":  # heavyball drops dims of size 1 (its SqueezeGrad)
        shape = tuple(n for n in shape if n != 1)
    if len(shape) > 13:
        raise ValueError(f"DistributedKron: a {len(shape)}-dim parameter is not supported (at most 13 dims)")
    diag = diag_dims(shape, group["memory_save_mode"], group["max_size_triangular"], group["min_ndim_triangular"])
    return FactorPlan(shape, diag)


def precond_cost(shape: Sequence[int], diag: Sequence[bool]) -> float:
    """Work of one preconditioner update plus preconditioning, in multiply-adds (a model).

    Per triangular factor of size ``n`` on a tensor of ``N`` elements, with the structured
    products of :mod:`dist_optim.kernels.structured`: ``A`` and the triangular solve ~N n / 2 each, the
    two Gram products ~N n / 2 each, the two triangular applications in the preconditioning
    ~N n / 2 each (3 N n together), the factor update ``triu(D) Q`` ~n^3 / 3. A diagonal factor
    costs ~8 N."""
    numel = math.prod(shape)
    cost = float(numel)
    for n, d in zip(shape, diag):
        cost += 8.0 * numel if d else 3.0 * numel * n + float(n) ** 3 / 3.0
    return cost
