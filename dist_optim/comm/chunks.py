"""Splitting flat tensors over the ranks of a group, shared by the collectives
(:mod:`dist_optim.comm`) and the modules that plan them (:mod:`dist_optim.sharding.partition`,
:mod:`dist_optim.sharding.owners`): ZeRO's chunk rule (:func:`chunk_numel`, :func:`chunk_span`) and the
pairing of an exchange run in rounds (:func:`exchange_round`), pure functions of integers; and the
local copies around a collective's buffer (:func:`pack_chunks`, :func:`unpack_chunks`,
:func:`scratch`), which communicate nothing."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "aligns_for",
    "chunk_numel",
    "chunk_span",
    "exchange_round",
    "pack_chunks",
    "unpack_chunks",
    "flat_to",
    "to_flat",
    "scratch",
]


def chunk_numel(numel: int, size: int, align: int = 1) -> int:
    """The chunk of a tensor of ``numel`` elements split over ``size`` ranks: the smallest multiple of
    ``align`` that ``size`` chunks cover ``numel`` with (trailing ranks may hold less, or nothing)."""
    per = -(-numel // size) if numel else 0
    return -(-per // align) * align


def chunk_span(numel: int, size: int, rank: int, align: int = 1) -> tuple[int, int]:
    """``[start, stop)`` of the flat elements of a ``numel``-element tensor that rank ``rank`` of
    ``size`` holds in :func:`dist_optim.comm.reduce_scatter`'s split (chunks of :func:`chunk_numel`, clipped)."""
    c = chunk_numel(numel, size, align)
    return min(rank * c, numel), min((rank + 1) * c, numel)


def exchange_round(source: int, target: int, size: int, rounds: int) -> int:
    """The round in which rank ``source`` sends to rank ``target`` when an :func:`dist_optim.comm.exchange` over
    ``size`` ranks runs in ``rounds`` all_to_alls: by the offset ``(target - source) mod size``, in
    ``rounds`` consecutive runs of offsets (``rounds == size``: round k pairs each rank with the one
    k places on). Both ends of a pair compute it alike."""
    return ((target - source) % size) * rounds // size


def aligns_for(align: int | Sequence[int], n: int) -> list[int]:
    """The chunk alignment of each of ``n`` tensors: one for all (an int), or one each."""
    return [align] * n if isinstance(align, int) else list(align)


def pack_chunks(flats: Sequence[torch.Tensor], widths: Sequence[int], out: torch.Tensor) -> None:
    """Row r of ``out`` (``[rows, sum(widths)]``) gets chunk r of each 1-D tensor of ``flats`` in turn,
    ``widths[i]`` elements wide, zeros past a tensor's end (``out`` may hold anything before).

    One ``torch.cat`` of a ``[rows, width]`` view of each tensor: a step packs a hundred small
    tensors, and a copy issued from Python per tensor (and per slice of it) cost more than its
    bytes. Only a tensor that does not fill its rows is padded first (a copy)."""
    rows = out.shape[0]
    pieces: list[torch.Tensor] = []
    for f, w in zip(flats, widths):
        n = f.numel()
        if n == rows * w:
            pieces.append(f.view(rows, w))
        elif rows == 1:  # a chunk shorter than its width: zeros after it
            pieces += [f.view(1, n), f.new_zeros(1, w - n)]
        else:
            pieces.append(torch.cat([f, f.new_zeros(rows * w - n)]).view(rows, w))
    if pieces:
        torch.cat(pieces, dim=1, out=out)


def unpack_chunks(gathered: torch.Tensor, numels: Sequence[int], widths: Sequence[int]) -> list[torch.Tensor]:
    """The inverse of :func:`pack_chunks` on ``gathered`` (``[rows, sum(widths)]``, row r every
    tensor's chunk r): each tensor whole and flat (its first ``numels[i]`` elements), each in a
    buffer of its own, filled by one ``torch._foreach_copy_`` (a strided copy per tensor from Python
    cost more than its bytes); views of ``gathered`` itself where it has one row. Not one buffer for
    all: a result kept (a checkpoint's entry) would keep the others' memory, and on the CPU a new
    buffer of a MiB or more faults every page in (:func:`scratch`)."""
    rows = gathered.shape[0]
    if rows == 1:
        return [t[:n] for t, n in zip(gathered[0].split(list(widths)), numels)]
    dst = [torch.empty(rows, w, dtype=gathered.dtype, device=gathered.device) for w in widths]
    if dst:
        torch._foreach_copy_(dst, list(gathered.split(list(widths), dim=1)))
    return [t.view(-1)[:n] for t, n in zip(dst, numels)]


#: Reused buffers of :func:`scratch`, by role, dtype and device.
_SCRATCH: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

#: The smallest buffer :func:`scratch` keeps: smaller ones came from memory glibc had kept.
SCRATCH_MIN_BYTES = 2**20


def flat_to(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Fill ``tensors`` (or views) in turn from consecutive elements of the 1-D ``flat``."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view(t.shape))
        offset += n


def to_flat(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """The inverse of :func:`flat_to`: ``tensors`` (or views, strided ones too) in turn into ``flat``."""
    offset = 0
    for t in tensors:
        n = t.numel()
        flat[offset : offset + n].view(t.shape).copy_(t)
        offset += n


def scratch(role: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D buffer of ``numel`` elements holding anything, for a collective's packed send or
    receive that is done with before its caller returns (one caller per ``role``, never two of its
    buffers alive at once). On the CPU, one of at least ``SCRATCH_MIN_BYTES`` is kept and reused by
    the next call (grown to the largest asked for): glibc gives a large freed buffer back to the
    system (unmapped, or trimmed off the heap's top), and in bench_step.py --dist galore the
    reduce-scatter's two 1.5 MB buffers were faulted in again every step, hundreds of page faults
    per rank and step (its smaller buffers were not). It is
    held between steps: at most the largest bucket's packed bytes (:mod:`dist_optim.sharding.budget`) per
    role and dtype. Elsewhere a new buffer (CUDA's caching allocator already reuses memory; the
    planner's meta tensors hold none)."""
    nbytes = numel * dtype.itemsize
    if device.type != "cpu" or nbytes < SCRATCH_MIN_BYTES:
        return torch.empty(numel, dtype=dtype, device=device)
    key = (role, dtype, device)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        _SCRATCH.pop(key, None)  # the old one freed before the larger one is made
        buf = _SCRATCH[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]
