"""Optimizer state kept as partitions over the ranks that share a tensor (ZeRO's rule), and the
bucketed collectives that make and undo them.

A tensor shared by the ranks of one or more process groups (a parameter's ``sum_groups``: its ZeRO
group, then its TP group; or the work group of an owner's results) is cut, flattened, into ``n``
contiguous parts, ``n`` the product of the groups' sizes. The rank with rank ``r_k`` in group ``k``
(of ``s_k`` ranks) keeps part ``index = (r_0 s_1 + r_1) s_2 + ...`` of ``p = chunk_numel(numel, n,
align)`` elements (:func:`partition_span`; the last parts shorter, or empty). ``align`` puts the
part boundaries on multiples of a block: 8-bit states quantise blocks of 256 values, so each rank
then holds whole blocks. With ``align=1`` this is :class:`dist_optim.factored.layout.FactoredLayout`'s
rule for the factored statistics (it calls :func:`partition_span`).

* :func:`reduce_scatter_parts`: each tensor summed over its groups, every rank receiving only its
  part, stage by stage: over the first group (:func:`dist_optim.comm.reduce_scatter`: one
  all-to-all per group, dtype and stage; each chunk added in rank order on its receiver), then the
  chunk it received over the next group, and so on. The sum of an element is made in the order of
  summing over the first group, then the second, whole (bit for bit what an all-reduce in rank
  order per group gives), and does not depend on which other tensors share the call.
  Groups over which the tensor is already the same (``replicas``: the TP peers of a matrix TP
  replicates) come last and cost no collective: each rank keeps its chunk of its own copy.
* :func:`all_gather_parts`: the inverse, whole tensors from every rank's part, stages in reverse
  (:func:`dist_optim.comm.all_gather_chunks`: one all-gather per group, dtype and stage).

A ZeRO group and a TP group whose grid a bound optimizer made (:func:`dist_optim.comm.grid_of`:
grid rank ``r_0 s_1 + r_1``) are one stage: one collective over the grid instead of two, the same
parts (``chunk_numel`` over ``s_0 s_1`` ranks equals the two stages' chunk of a chunk), each
element summed over the grid in rank order. Fewer rounds of messages and one packing of the
buffers instead of two; the bytes are those of the first stage alone. Not with a replica stage,
which must not be summed.

Groups of one rank are left out; a tensor with no group left is its own (whole) part. Groups are
visited stage by stage in the one global order (:func:`dist_optim.comm.ordered_groups`), so every
rank issues the same collectives in the same order. The ranks of a later group must share their
ranks in the earlier ones (a TP group's members are at the same place in their ZeRO groups, as in
ColossalAI's mesh): they then hold the same chunk of the earlier stages.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..comm import (
    Gathering,
    grid_of,
    group_rank,
    group_size,
    ordered_groups,
    reduce_scatter,
    start_all_gather_chunks,
    topology_token,
)
from ..comm.chunks import chunk_numel, chunk_span

__all__ = [
    "live_groups",
    "partition_span",
    "reduce_scatter_parts",
    "all_gather_parts",
    "start_all_gather_parts",
    "GatheringParts",
]


def live_groups(groups: Sequence[Any]) -> tuple[Any, ...]:
    """``groups`` without those of one rank (nothing to share over)."""
    return tuple(g for g in groups if group_size(g) > 1)


def partition_span(numel: int, groups: Sequence[Any], align: int = 1) -> tuple[int, int]:
    """``[lo, hi)`` of the flattened ``numel`` elements that this rank keeps of a tensor partitioned
    over ``groups`` (the module docstring's rule); ``(0, numel)`` when no group has two ranks."""
    index, n = 0, 1
    for g in live_groups(groups):
        size = group_size(g)
        index, n = index * size + group_rank(g), n * size
    p = chunk_numel(numel, n, align)
    lo = min(numel, index * p)
    return lo, min(numel, lo + p)


def _fused(groups: tuple[Any, ...]) -> tuple[Any, ...]:
    """A data-parallel group and a TP group as their grid (:func:`dist_optim.comm.grid_of`), one
    stage instead of two, where one was made in the order of the parts: the same parts (the part
    index ``r_0 s_1 + r_1`` is the grid rank, and ``chunk_numel`` over ``s_0 s_1`` ranks is the
    two stages' chunk of a chunk), summed in grid rank order."""
    if len(groups) == 2:
        grid = grid_of(*groups)
        if grid is not None:
            return (grid,)
    return groups


def _stage_aligns(groups: Sequence[Any], align: int) -> list[int]:
    """The alignment of each stage's chunks: the parts of the later stages fit whole in a chunk."""
    sizes = [group_size(g) for g in groups]
    return [align * math.prod(sizes[k + 1 :]) for k in range(len(sizes))]


def _staged(
    groups_of: Sequence[tuple[Any, ...]], stage: int, dtypes: Sequence[torch.dtype]
) -> Iterator[tuple[Any, list[int]]]:
    """``(group, indices)`` of the requests that go through ``stage``: groups in the global order,
    each group's requests split by dtype (one collective moves one dtype)."""
    staged = [i for i, gs in enumerate(groups_of) if len(gs) > stage]
    for group in ordered_groups(groups_of[i][stage] for i in staged):
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in staged:
            if groups_of[i][stage] is group:
                by_dtype.setdefault(dtypes[i], []).append(i)
        for dtype in sorted(by_dtype, key=str):
            yield group, by_dtype[dtype]


#: Plans of :func:`reduce_scatter_parts` and :class:`GatheringParts`, by what they depend on: the
#: requests' numels, dtypes, groups and alignments, and :func:`dist_optim.comm.topology_token`. A
#: step asks the same ones every time, and making one (the groups' sizes, ranks, grids and global
#: order, per request and stage) is a visible part of GaLore's distributed step
#: (``bench/bench_step.py --dist``). The keys hold their groups, so a group's id is not reused while
#: its plans are kept.
_PLANS: dict[Any, Any] = {}
_MAX_PLANS = 256  # a few per bucket and optimizer; past this, start again


def _kept(kind: str, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
    token = topology_token()
    if token is None:
        return make()
    # The grid finder is part of the key: tests replace this module's to set grids aside.
    full = (kind, token, grid_of, key)
    plan = _PLANS.get(full)
    if plan is None:
        # Plans of another token are never asked for again; dropping them lets their groups go
        # (comm.release_groups).
        if len(_PLANS) >= _MAX_PLANS or any(k[1] != token for k in _PLANS):
            _PLANS.clear()
        plan = _PLANS[full] = make()
    return plan


def _padded(chunk: torch.Tensor, width: int) -> torch.Tensor:
    if chunk.numel() == width:
        return chunk
    out = chunk.new_zeros(width)
    out[: chunk.numel()] = chunk
    return out


#: One stage's collective of a reduce-scatter plan: its group, the requests summed (with their
#: chunks' alignments), the replicas' requests with this rank's spans of them, and the width to
#: which each request's chunk is padded where a later stage cuts it again.
_ScatterStep = tuple[Any, list[int], list[int], list[tuple[int, tuple[int, int]]], dict[int, int]]


def _scatter_plan(
    key: Sequence[tuple[int, torch.dtype, tuple[Any, ...], int, tuple[Any, ...]]],
) -> tuple[list[bool], list[_ScatterStep], list[int | None]]:
    """For requests ``(numel, dtype, groups, align, replicas)``: which are flattened (those with a
    live group), the steps, and the length each result keeps (None: the tensor itself)."""
    groups_of = [live_groups(gs + rs) for _, _, gs, _, rs in key]
    summed = [len(live_groups(gs)) for _, _, gs, _, _ in key]
    for i, gs in enumerate(groups_of):
        if summed[i] == len(gs):  # a replica stage sums nothing: not fused with a summing one
            groups_of[i] = _fused(gs)
            summed[i] = len(groups_of[i])
    aligns = [_stage_aligns(gs, k[3]) for gs, k in zip(groups_of, key)]
    length = [k[0] for k in key]
    steps: list[_ScatterStep] = []
    for stage in range(max(map(len, groups_of), default=0)):
        for group, idx in _staged(groups_of, stage, [k[1] for k in key]):
            size, rank = group_size(group), group_rank(group)
            summing = [i for i in idx if stage < summed[i]]
            replica = [(i, chunk_span(length[i], size, rank, aligns[i][stage])) for i in idx if stage >= summed[i]]
            pads = {}
            for i in idx:
                # The last chunk of a stage is padded to the others' width (zeros past the tensor's
                # end): the next stage then cuts every chunk into the same parts.
                if stage + 1 < len(groups_of[i]):
                    pads[i] = length[i] = chunk_numel(length[i], size, aligns[i][stage])
            steps.append((group, summing, [aligns[i][stage] for i in summing], replica, pads))
    spans = [partition_span(k[0], gs, k[3]) if gs else None for k, gs in zip(key, groups_of)]
    keep = [None if span is None else span[1] - span[0] for span in spans]
    return [bool(gs) for gs in groups_of], steps, keep


def reduce_scatter_parts(
    requests: Sequence[tuple[torch.Tensor, Sequence[Any], int, Sequence[Any]]],
) -> list[torch.Tensor]:
    """For each ``(tensor, groups, align, replicas)`` (``tensor`` of the same shape on every rank of
    the groups): this rank's part (1-D, :func:`partition_span` over ``groups + replicas``) of the sum
    of ``tensor`` over ``groups``; ``tensor`` itself where no group has two ranks. ``replicas``:
    groups over which the sum is the same on every rank already (a tensor TP replicates), partitioned
    without a collective (each rank keeps its part of its own copy). Collective over every group of
    ``groups``."""
    key = tuple((t.numel(), t.dtype, tuple(gs), align, tuple(rs)) for t, gs, align, rs in requests)
    flat, steps, keep = _kept("scatter", key, lambda: _scatter_plan(key))
    cur = [t.reshape(-1) if f else t for (t, _, _, _), f in zip(requests, flat)]
    for group, summing, aligns, replica, pads in steps:
        chunks = reduce_scatter([cur[i] for i in summing], group, aligns) if summing else []
        # A replica is the same on every rank of the group: its own chunk of its own copy.
        chunks += [cur[i][lo:hi] for i, (lo, hi) in replica]
        for i, chunk in zip(summing + [i for i, _ in replica], chunks):
            cur[i] = _padded(chunk, pads[i]) if i in pads else chunk
    return [c if n is None else c[:n] for c, n in zip(cur, keep)]


#: One stage's all-gather of a gather plan: its group, the requests, their lengths and alignments.
_GatherStep = tuple[Any, list[int], list[int], list[int]]


def _gather_plan(key: Sequence[tuple[torch.dtype, tuple[Any, ...], int, int]]) -> list[list[_GatherStep]]:
    """For requests ``(dtype, groups, numel, align)``: the all-gathers of each stage, the last first."""
    groups_of = [_fused(live_groups(gs)) for _, gs, _, _ in key]
    aligns = [_stage_aligns(gs, k[3]) for gs, k in zip(groups_of, key)]
    lengths = []  # per request, the length of what each stage splits (the whole, then the chunks)
    for (_, _, numel, _), gs, al in zip(key, groups_of, aligns):
        length = [numel]
        for g, a in zip(gs[:-1], al[:-1]):
            length.append(chunk_numel(length[-1], group_size(g), a))
        lengths.append(length)
    dtypes = [k[0] for k in key]
    return [
        [
            (group, idx, [lengths[i][stage] for i in idx], [aligns[i][stage] for i in idx])
            for group, idx in _staged(groups_of, stage, dtypes)
        ]
        for stage in reversed(range(max(map(len, groups_of), default=0)))
    ]


class GatheringParts:
    """:func:`start_all_gather_parts` in flight: the first stage's all-gathers issued
    asynchronously, the later stages (which need its results) run by :meth:`wait`."""

    def __init__(self, requests: Sequence[tuple[torch.Tensor, Sequence[Any], int, int]]) -> None:
        key = tuple((part.dtype, tuple(gs), numel, align) for part, gs, numel, align in requests)
        self._stages = list(_kept("gather", key, lambda: _gather_plan(key)))
        self._cur = [part for part, _, _, _ in requests]
        self._inflight = self._start(self._stages.pop(0)) if self._stages else []

    def _start(self, stage: list[_GatherStep]) -> list[tuple[list[int], Gathering]]:
        return [
            (idx, start_all_gather_chunks([self._cur[i] for i in idx], lengths, group, aligns))
            for group, idx, lengths, aligns in stage
        ]

    def wait(self) -> list[torch.Tensor]:
        while self._inflight:
            for idx, gathering in self._inflight:
                for i, t in zip(idx, gathering.wait()):
                    self._cur[i] = t
            self._inflight = self._start(self._stages.pop(0)) if self._stages else []
        return self._cur


def start_all_gather_parts(requests: Sequence[tuple[torch.Tensor, Sequence[Any], int, int]]) -> GatheringParts:
    """:func:`all_gather_parts` with its first collectives issued asynchronously (the parts may change
    at once: they were copied): the returned object's ``wait()`` gives the whole tensors. Every rank
    of the groups calls ``wait()`` before its next collective on them (the later stages run there)."""
    return GatheringParts(requests)


def all_gather_parts(requests: Sequence[tuple[torch.Tensor, Sequence[Any], int, int]]) -> list[torch.Tensor]:
    """For each ``(part, groups, numel, align)``: the whole flattened tensor of ``numel`` elements of
    which every rank of ``groups`` holds its :func:`partition_span` (``part``, 1-D); ``part`` itself
    where no group has two ranks. Collective over every group named."""
    return GatheringParts(requests).wait()
