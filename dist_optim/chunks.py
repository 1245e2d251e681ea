"""The arithmetic of splitting flat tensors over the ranks of a group, shared by the collectives
(:mod:`dist_optim.comm`) and the modules that plan them (:mod:`dist_optim.partition`,
:mod:`dist_optim.owners`): ZeRO's chunk rule (:func:`chunk_numel`, :func:`chunk_span`) and the
pairing of an exchange run in rounds (:func:`exchange_round`). Pure functions of integers."""

from __future__ import annotations

__all__ = ["chunk_numel", "chunk_span", "exchange_round"]


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
