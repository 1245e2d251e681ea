"""A block's stored forms and the whole matrices its step reads: one decode before the math, one
encode after it, through the codecs the block's group declares (:data:`dist_optim.shampoo.state.STATE`).

* factors and roots: :data:`~dist_optim.states.codecs.PACKED_SYMMETRIC` with
  ``use_symmetric_packing`` (lossless: unpacked whole into scratch, packed back where the step
  changed them), else :data:`~dist_optim.states.codecs.PLAIN` (the stored tensors themselves,
  updated in place);
* eigenvector matrices: :class:`~dist_optim.states.codecs.LowBit` codes where
  :func:`~dist_optim.shampoo.state.quantises_bases` (decoded whole into scratch and rectified),
  else plain. Shampoo then keeps its roots as their eigenpairs (:attr:`BlockForms.eigenpairs`,
  :mod:`.quantized`).

Quantisation is lossy, so a refreshed basis is kept through :meth:`BlockForms.keeper`: stored
where the refresh succeeded, and what the step reads next is what was stored, decoded again, so
that a step uses exactly what a later step (or a resumed run) reads back. The math (the modules
beside this one) reads and updates plain whole tensors only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...states import codecs, lowbit
from ..blocking import Block, kept_triangle
from ..state import STATE, BlockState, Scratch, basis_codec, quantises_bases

__all__ = ["BlockForms", "Keep"]

#: ``keep(k, q, ok)``: keep the refreshed eigenvectors ``q`` of dim ``k`` where ``ok`` (a 0-d bool
#: tensor); afterwards the view's ``bases[k]`` is what is kept.
Keep = Callable[[int, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class BlockForms:
    """The codecs of one block's preconditioner matrices: ``symmetric`` (factors and roots) and
    ``basis`` (eigenvector matrices), whose whole matrices are in ``dtype``."""

    symmetric: codecs.Codec
    basis: codecs.Codec
    dtype: torch.dtype

    @classmethod
    def of(cls, block: Block, group: dict[str, Any]) -> BlockForms:
        symmetric = STATE.entry("factor").codec if group["use_symmetric_packing"] else codecs.PLAIN
        basis = basis_codec(group["preconditioner_bits"]) if quantises_bases(block, group) else codecs.PLAIN
        return cls(symmetric, basis, group["preconditioner_dtype"])

    @property
    def in_place(self) -> bool:
        """Whether the math updates the stored factors themselves (plain), so that a batch of blocks
        can update its statistics at once; packed ones are unpacked into scratch one block at a time."""
        return self.symmetric is codecs.PLAIN

    @property
    def eigenpairs(self) -> bool:
        """Whether the eigenvectors are kept as codes, decoded for each step: SOAP's bases, and
        Shampoo's roots then kept as their eigenpairs ``R_k = Q_k diag(s_k) Q_k^T`` (``basis<k>``
        and ``spectrum<k>``, :mod:`.quantized`) rather than whole."""
        return self.basis is not codecs.PLAIN

    def decode(self, stored: BlockState, block: Block, scratch: Scratch, roots: bool, bases: bool) -> BlockState:
        """The block's state as the math reads it: ``stored``'s own tensors where plain; packed
        factors (and, with ``roots``, packed roots) whole in ``scratch`` (slots ``factor<k>``,
        ``root<k>``); with ``bases``, coded eigenvectors whole in ``scratch`` (none without: the
        step reads none). Roots are needed only where the step reads them (a preconditioned
        direction, or a refresh that may keep the previous root). Scratch is reused by the next block."""
        changes: dict[str, Any] = {}
        if isinstance(self.symmetric, codecs.PackedTriangle):
            changes["factors"] = self._unpacked(stored.factors, block, scratch, "factor")
            if roots:
                changes["roots"] = self._unpacked(stored.roots, block, scratch, "root")
        if isinstance(self.basis, codecs.LowBit):
            changes["bases"] = self._decoded_bases(stored, block, scratch) if bases else []
            changes["basis_absmax"] = []
        return dataclasses.replace(stored, **changes) if changes else stored

    def keeper(self, stored: BlockState, bs: BlockState) -> Keep:
        """How a refresh keeps new eigenvectors in ``bs`` (the view :meth:`decode` made of ``stored``):
        plain ones where ``ok``; coded ones quantised into ``stored`` where ``ok``, then decoded
        again into ``bs``, so that the step reads what is stored."""
        if not isinstance(self.basis, codecs.LowBit):

            def keep_plain(k: int, q: torch.Tensor, ok: torch.Tensor) -> None:
                basis = bs.bases[k]
                basis.copy_(torch.where(ok, q.to(basis.dtype), basis))

            return keep_plain
        codec = self.basis

        def keep_coded(k: int, q: torch.Tensor, ok: torch.Tensor) -> None:
            codes, absmax = codec.quantize(q)
            torch.where(ok, codes, stored.bases[k], out=stored.bases[k])
            torch.where(ok, absmax, stored.basis_absmax[k], out=stored.basis_absmax[k])
            whole = bs.bases[k]
            d = whole.shape[0]
            raw = codec.values(stored.bases[k], stored.basis_absmax[k], d).view(d, d)
            lowbit.rectify(raw.to(whole.dtype), out=whole)

        return keep_coded

    def encode(self, stored: BlockState, bs: BlockState, block: Block, factors: bool, roots: bool) -> None:
        """Store back what the step changed in the view ``bs``: its ``factors`` (a statistics step)
        and ``roots`` (a refresh), packed where packed (a factor's kept triangle,
        :func:`~dist_optim.shampoo.blocking.kept_triangle`; a root's lower one). Plain ones were
        updated in place, eigenvectors by :meth:`keeper`."""
        codec = self.symmetric
        if not isinstance(codec, codecs.PackedTriangle):
            return
        if factors:
            for k, (packed, m) in enumerate(zip(stored.factors, bs.factors)):
                codec.pack(kept_triangle(m, block.order, k), out=packed)
        if roots:
            for packed, m in zip(stored.roots, bs.roots):
                codec.pack(m, out=packed)

    def _unpacked(self, packed: list[torch.Tensor], block: Block, scratch: Scratch, slot: str) -> list[torch.Tensor]:
        codec = self.symmetric
        assert isinstance(codec, codecs.PackedTriangle)
        out = []
        for k, m in enumerate(packed):
            d = block.shape[k]
            out.append(codec.unpack(m, d, out=scratch.get((d, d), m.dtype, m.device, f"{slot}{k}")))
        return out

    def _decoded_bases(self, stored: BlockState, block: Block, scratch: Scratch) -> list[torch.Tensor]:
        """The coded eigenvector matrices whole, in ``dtype``, in ``scratch`` (slots ``basis<k>``):
        dequantised, then rectified by one Björck step (:func:`dist_optim.states.lowbit.rectify`;
        why: the measurements of :mod:`dist_optim.states.lowbit`)."""
        codec = self.basis
        assert isinstance(codec, codecs.LowBit)
        out = []
        for k, (codes, absmax) in enumerate(zip(stored.bases, stored.basis_absmax)):
            d = block.shape[k]
            raw = scratch.get((d, d), torch.float32, codes.device, "dequantized")
            codec.values(codes, absmax, d, out=raw)
            q = raw if self.dtype == torch.float32 else raw.to(self.dtype)
            out.append(lowbit.rectify(q, out=scratch.get((d, d), self.dtype, codes.device, f"basis{k}")))
        return out
