"""Matrices that stress Muon's fp32 Newton-Schulz iteration, and the plain formula it is measured
against (``tests/unit/test_muon.py`` asserts on them, ``bench/ns_accuracy.py`` prints the table
docs/optimizers.md quotes).

A momentum of rank 8 (as a gradient of a few tokens), one whose singular values are log-spaced from 1
to 1e-6 (ill-conditioned, every scale present) and a Gaussian one; each drawn in float64 from a
generator seeded with ``m + n`` and rounded once to fp32, so a shape and kind give the same matrix in
every process.
"""

from __future__ import annotations

import torch

#: The kinds :func:`stress_momentum` draws.
STRESS_KINDS = ("rank8", "log-spaced", "gaussian")


def stress_momentum(shape: tuple[int, int], kind: str) -> torch.Tensor:
    """An fp32 ``m x n`` matrix of rank 8 (``"rank8"``), with singular values log-spaced from 1 to
    1e-6 (``"log-spaced"``), or Gaussian (``"gaussian"``)."""
    if kind not in STRESS_KINDS:
        raise ValueError(f"kind must be one of {STRESS_KINDS}, got {kind!r}")
    m, n = shape
    gen = torch.Generator().manual_seed(m + n)
    if kind == "rank8":
        c = torch.randn(m, 8, generator=gen, dtype=torch.float64) @ torch.randn(
            8, n, generator=gen, dtype=torch.float64
        )
    elif kind == "log-spaced":
        k = min(m, n)
        u = torch.linalg.qr(torch.randn(m, k, generator=gen, dtype=torch.float64))[0]
        v = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64))[0]
        c = (u * torch.logspace(0, -6, k, dtype=torch.float64)) @ v.T
    else:
        c = torch.randn(m, n, generator=gen, dtype=torch.float64)
    return c.float()


def plain_newton_schulz(c: torch.Tensor, coefficients: list[tuple[float, float, float]]) -> torch.Tensor:
    """The iteration as Jordan et al. write it, plain products in ``c``'s dtype (the yardstick):
    ``X = C / max(||C||, 1e-7)`` in the wide orientation, then ``X <- a X + (b A + c A A) X`` with
    ``A = X X^T`` for each ``(a, b, c)``."""
    x = c.T if c.size(0) > c.size(1) else c
    x = x / x.norm().clamp(min=1e-7)
    for a, b, cc in coefficients:
        gram = x @ x.T
        x = a * x + (b * gram + cc * (gram @ gram)) @ x
    return x.T if c.size(0) > c.size(1) else x
