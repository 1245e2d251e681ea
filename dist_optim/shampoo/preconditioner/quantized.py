"""Quantised eigenvectors (``preconditioner_bits`` 8 or 4): a block's refresh and the whole
matrices its step uses, from the stored codes (Wang et al. 2024, "4-bit Shampoo for
Memory-Efficient Network Training", NeurIPS; the format and its measured errors:
:mod:`dist_optim.states.lowbit`).

Shampoo keeps, per factor ``L_k``, the eigenvectors ``Q_k`` of its damped, bias-corrected form
``A_k + epsilon I`` (``basis<k>``, quantised) and the root's eigenvalues ``s_k = lam'^-alpha``
(``spectrum<k>``, ``preconditioner_dtype``). Each preconditioned step dequantises ``Q_k``,
rectifies it by one Björck step ``Q <- Q (3 I - Q^T Q) / 2`` (both: :mod:`.forms`, the block's
decode) and applies ``R_k = Q_k diag(s_k) Q_k^T`` (:func:`roots`), made in reused scratch memory, as
the 32-bit step applies its stored root. The refresh is
``eigh`` (``root_inverse="eigh"``) or :func:`~dist_optim.kernels.matrix_functions.warm_eigh` from the
decoded ``Q_k`` (``"warm"``: the quantised eigenvectors are its warm start, no fp32 copy is kept);
the iterative root methods compute no eigenvectors and are refused with this option. SOAP keeps
its bases ``Q_k`` quantised the same way and every rotation uses them decoded and rectified; a
refresh (any ``eigenbasis``) starts from the decoded bases.

Deviations from Wang et al.: the factors ``L_k`` stay in ``preconditioner_dtype`` (packed with
``use_symmetric_packing``), where Wang et al. also keep the preconditioner's statistics as
quantised eigenvectors and eigenvalues: each step adds a small increment ``(1 - b2) G G^T`` to
them, which a 4- or 8-bit code of the sum would mostly round away, and it is the factors, not the
roots, that carry the history. Their mapping is linear-square without a zero code; ours is linear
with an exact zero (measured better on nearly diagonal factors, equal on dense ones:
:mod:`dist_optim.states.lowbit`). One Björck step at every use, never more (their default). A refresh
step also uses the eigenvectors decoded from the codes it just stored, so that a step reads
exactly what a later step (or a resumed run) would.

A block's matrices are held whole by its owner, so the quantisation is local: a distributed run
quantises the same values in the same blocks as one device does, bit for bit.
"""

from __future__ import annotations

import torch

from ..blocking import Block
from ..state import BlockState, Scratch

__all__ = ["roots"]


def roots(bs: BlockState, block: Block, scratch: Scratch) -> list[torch.Tensor]:
    """The roots ``R_k = Q_k diag(s_k) Q_k^T`` of a block kept as eigenpairs, from its decoded
    eigenvectors ``bs.bases`` (what is stored: :meth:`.forms.BlockForms.keeper`) and spectra, in
    ``scratch`` (slots ``"scaled"``, ``"root<k>"``; reused by the next block)."""
    out = []
    for k, (q, s) in enumerate(zip(bs.bases, bs.spectra)):
        d = block.shape[k]
        scaled = torch.mul(q, s, out=scratch.get((d, d), q.dtype, q.device, "scaled"))
        out.append(torch.mm(scaled, q.T, out=scratch.get((d, d), q.dtype, q.device, f"root{k}")))
    return out
