"""Reused scratch memory of a Shampoo owner's step: whole matrices decoded from their stored form
(:mod:`.state`), a batch's gradients and directions."""

from __future__ import annotations

import math

import torch

__all__ = ["ALIGN_BYTES", "Scratch"]

#: Where :meth:`Scratch.split` starts each tensor: a multiple of this many bytes from the buffer's start.
ALIGN_BYTES = 64


class Scratch:
    """Reused scratch memory, one buffer per slot and dtype and device, grown as needed. On the CPU
    a fresh block-sized tensor costs page faults comparable to the arithmetic of a memory-bound
    operation on it (``bench/bench_step.py`` shows the step's time)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
        # The views handed out, by buffer and shapes: a step asks for the same ones block after
        # block and step after step, and making them is two tensor operations each.
        self._views: dict[
            tuple[str, torch.dtype, torch.device], dict[tuple[tuple[int, ...], ...], list[torch.Tensor]]
        ] = {}

    def get(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, slot: str) -> torch.Tensor:
        """A contiguous tensor of ``shape`` over the memory of ``slot``: ``"left"`` (``R_0^T M``
        before it is multiplied by ``R_1``), SOAP's ``"rot"`` (a rotated block) and ``"den"`` (its
        denominator); with packing ``"factor<k>"`` and ``"root<k>"`` (whole matrices); with
        quantised eigenvectors ``"dequantized"``, ``"basis<k>"``, ``"scaled"`` (``Q diag(s)``) and
        ``"root<k>"``."""
        return self.split([shape], dtype, device, slot)[0]

    def split(
        self, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device, slot: str
    ) -> list[torch.Tensor]:
        """Contiguous tensors of ``shapes``, one after the other over the memory of ``slot``: a
        batch of blocks' tensors that are all alive at once (``"outs"``: their directions,
        ``"grad"``: their gradients' contiguous copies; ``"refresh"``: a warm root refresh's new
        root and ``Q diag(s)``)."""
        key = (slot, dtype, device)
        made = self._views.setdefault(key, {})
        wanted = tuple(tuple(shape) for shape in shapes)
        views = made.get(wanted)
        if views is not None:
            return views
        # Each tensor starts on a 64-byte boundary, as a fresh allocation does: BLAS may round a
        # product into a misaligned output differently, and a block's bits must not depend on
        # its neighbours in the batch.
        align = max(1, ALIGN_BYTES // dtype.itemsize)
        offsets, n = [], 0
        for shape in wanted:
            offsets.append(n)
            n += -(-math.prod(shape) // align) * align
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n:
            buf = self._buffers[key] = torch.empty(n, dtype=dtype, device=device)
            made.clear()  # views of the old buffer
        views = made[wanted] = [buf[o : o + math.prod(shape)].view(shape) for o, shape in zip(offsets, wanted)]
        return views
