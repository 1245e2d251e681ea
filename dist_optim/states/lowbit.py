"""Block-wise 4- and 8-bit quantisation of preconditioner matrices, and their rectification.

Wang et al. 2024, "4-bit Shampoo for Memory-Efficient Network Training" (NeurIPS; arXiv:2405.18144)
keep the eigenvector matrices of Shampoo's preconditioners in 4 bits: block-wise quantised,
dequantised for use and then rectified towards orthogonality by Björck's iteration. This module
is that quantiser, the one the whole package uses for such matrices (Shampoo's root eigenvectors
and SOAP's bases, :mod:`dist_optim.shampoo.state`), in plain torch: the same bits on every device,
no extension.

The format of a tensor of ``n`` elements, flattened row-major:

* blocks of :data:`BLOCK` consecutive elements (64 at 4 bits, 256 at 8: bitsandbytes' block), the
  last one padded with zeros; per block one fp32 ``absmax``, its largest magnitude;
* per element the code ``c = round(x / absmax * h) + h`` with ``h = 2^(bits-1) - 1`` (7 or 127;
  ``round`` half to even), ``0 <= c <= 2h``: a symmetric linear map with an exact zero, using
  ``2^bits - 1`` of the ``2^bits`` codes; the value of a code is ``(c - h) / h * absmax`` (both
  steps rounded to fp32, the first by the CPU's division), so ``absmax`` itself and zero are
  exact (an identity matrix round-trips exactly); a block with ``absmax = 0`` is zeros. Codes,
  absmax and values came out identical on the CPU and on a GPU (checked once, not benched);
* at 8 bits one code a byte; at 4 bits two codes a byte, element ``2i`` in the low nibble and
  ``2i + 1`` in the high one (an odd ``n`` pads one zero code).

Stochastic rounding (``quantize(..., generator=)``; Kron's factors, :mod:`dist_optim.kron.state`;
Shampoo and SOAP round to nearest): with ``y = x / absmax * h`` (the same fp32 steps) and ``u_i``
the ``i``-th of ``torch.rand(n, generator=generator)`` (fp32, multiples of 2^-24 in [0, 1)), the
code is ``floor(y) + h + [u < y - floor(y)]``: up with probability the fraction, so the expected
value of a code is ``y + h`` (to 2^-24 of a code), an unbiased rounding (Gupta et al. 2015, "Deep
Learning with Limited Numerical Precision", arXiv:1502.02551), where rounding to nearest loses
every change below half a code. In distribution it is the textbook ``floor(y + h + u)``, computed
as a comparison because ``y + u`` in fp32 rounds (it could move ``-absmax`` a code up): zero and
``absmax`` (``y`` an integer) stay exact under every draw. Wang et al. round to nearest.

The map was chosen by reconstruction error (``R = Q diag(s) Q^T`` from a quantised eigenvector
matrix ``Q`` after one Björck step, against float64; measured once, not benched): on dense
eigenvectors this map, Wang et al.'s linear-square map (``sign(y) y^2``, ``y = -1 + 2j / 15``, no
zero code) and the plain linear map ``y`` came out alike, while on the eigenvectors of a diagonally
dominant factor (nearly a permutation, as early in training) both maps without a zero code were
far worse. So a zero code matters and the square brings nothing. At 8 bits the maps differ little,
and blocks of 64 instead of 256 shrink the errors little for 4x the absmax bytes: 256 kept. One
Björck step (Wang et al.'s default) makes the errors several times smaller at both widths; a
second shrinks them further at two more products per use, and is not taken.
"""

from __future__ import annotations

import torch

from ..kernels import structured

__all__ = ["BITS", "BLOCK", "LEVELS", "codes_numel", "absmax_numel", "quantize", "dequantize_lowbit", "rectify"]

#: The supported widths of a quantised matrix (32: not quantised).
BITS = (32, 8, 4)
#: Elements per quantisation block, by width.
BLOCK = {4: 64, 8: 256}
#: ``h``: codes ``0..2h`` stand for ``-1, -(h-1)/h, ..., 1`` times the block's absmax.
LEVELS = {4: 7, 8: 127}


def codes_numel(numel: int, bits: int) -> int:
    """Bytes of codes of a tensor of ``numel`` elements."""
    return numel if bits == 8 else -(-numel // 2)


def absmax_numel(numel: int, bits: int) -> int:
    """Blocks (fp32 absmax values) of a tensor of ``numel`` elements."""
    return -(-numel // BLOCK[bits])


def _padded_blocks(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` flattened, as fp32, zero-padded to whole blocks, one block a row."""
    flat = x.reshape(-1)
    block = BLOCK[bits]
    out = torch.zeros(absmax_numel(flat.numel(), bits) * block, dtype=torch.float32, device=x.device)
    out[: flat.numel()] = flat
    return out.view(-1, block)


def quantize(
    values: torch.Tensor, bits: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes (uint8, :func:`codes_numel` of them) and block absmax (fp32, :func:`absmax_numel`)
    of ``values`` (any shape and float dtype; quantised from its fp32 rounding). Non-finite values
    give unspecified codes (the callers keep the previous state then). With ``generator``, rounded
    stochastically (see the module docstring) with ``torch.rand(values.numel(), generator=generator)``
    (fp32, on ``values``' device), one uniform per element in flattened order."""
    n, h = values.numel(), LEVELS[bits]
    v = _padded_blocks(values, bits)
    absmax = v.abs().amax(dim=1)
    # A zero block divides by 1: its codes are the zero code.
    divisor = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    y = torch.div(v, divisor[:, None]).mul_(h)
    if generator is None:
        codes = y.round_()
    else:
        u = torch.zeros_like(v).view(-1)
        torch.rand(n, generator=generator, dtype=torch.float32, device=v.device, out=u[:n])
        codes = y.floor()
        # Up with probability frac(y): compared, not added (fp32 y + u would round, and could
        # move 0 or -absmax off its exact code).
        codes.add_(u.view_as(y) < y.sub_(codes))
    codes = codes.add_(h).to(torch.uint8).view(-1)
    if bits == 8:
        return codes[:n].clone(), absmax
    codes = codes[: 2 * codes_numel(n, bits)]
    if n % 2:  # the pad beyond n is a zero block's or a zero's: set it to the zero code
        codes[n] = h
    return codes[0::2] | (codes[1::2] << 4), absmax


def dequantize_lowbit(
    codes: torch.Tensor, absmax: torch.Tensor, bits: int, numel: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The fp32 values of ``numel`` elements from their codes and block absmax, flattened (into
    ``out``, a contiguous fp32 tensor of ``numel`` elements of any shape, when given)."""
    block = BLOCK[bits]
    c = codes if bits == 8 else torch.stack((codes & 15, codes >> 4), dim=-1).view(-1)
    padded = torch.zeros(absmax.numel() * block, dtype=torch.float32, device=codes.device)
    values = padded[:numel]
    torch.index_select(_code_values(bits, codes.device), 0, c[:numel].int(), out=values)
    padded.view(-1, block).mul_(absmax[:, None])
    if out is None:
        return values
    return out.view(-1).copy_(values)


_VALUES: dict[tuple[int, str], torch.Tensor] = {}


def _code_values(bits: int, device: torch.device) -> torch.Tensor:
    """``(c - h) / h`` for every code, rounded to fp32 once on the CPU: CUDA divides by a scalar as
    a product with its reciprocal, which rounds some values an ulp apart from the CPU's division;
    a table read is the same on every device."""
    key = (bits, str(device))
    if key not in _VALUES:
        h = LEVELS[bits]
        _VALUES[key] = ((torch.arange(2 * h + 1, dtype=torch.float32) - h) / h).to(device)
    return _VALUES[key]


def rectify(q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """One step of Björck's orthonormalisation, ``Q (3 I - Q^T Q) / 2``, as Wang et al. rectify a
    dequantised eigenvector matrix: for ``Q = U (I + E)`` with ``U`` orthogonal and small symmetric
    ``E``, the result's departure from orthogonality is ``O(E^2)`` (why one step: the module
    docstring). ``Q^T Q`` by :func:`dist_optim.kernels.structured.gram`
    on ``Q^T`` (on the CPU exactly symmetric, about 3/4 of the products of a 1024-side ``mm``)."""
    qtq = structured.gram(q.T)
    if out is None:
        return torch.addmm(q, q, qtq, beta=1.5, alpha=-0.5)
    return torch.addmm(q, q, qtq, beta=1.5, alpha=-0.5, out=out)
