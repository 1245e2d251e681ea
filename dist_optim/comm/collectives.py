"""The collectives: every one dist_optim issues is issued here (the package docstring says which
and how they are ordered)."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..layout import ParamLayout
from .chunks import (
    aligns_for,
    chunk_numel,
    exchange_round,
    flat_to,
    pack_chunks,
    scratch,
    to_flat,
    unpack_chunks,
)
from .dtypes import widest_dtype
from .groups import group_rank, group_size, ordered_groups
from .rules import StagedWork, Staging, check

#: torch.distributed itself: ``dist`` is rebound inside ``collectives_through``, whose backend
#: (the planner's recorder) neither stages nor is checked.
_TORCH_DIST = dist

#: Number of collectives issued since the last :func:`reset_counts`, by operation name.
COUNTS: collections.Counter[str] = collections.Counter()


def reset_counts() -> None:
    COUNTS.clear()


_SKIPPED = object()  # a stage a SumBucket request skips (first_stage)


@dataclass
class SumBucket:
    """Collects in-place all-reduce (sum) requests and runs them in as few collectives as it can.

    ``add(t, groups)`` queues ``t`` to be summed over each group in ``groups``, in that order (a
    layout's ``sum_groups``: ZeRO group, then TP group; every member of a group must queue its
    tensor with the same sequence of group roles). After :meth:`flush`, every queued tensor holds
    its reduced value. Tensors of one dtype that share a group travel in one flat buffer.

    ``first_stage`` (default 0) puts a request's first group at a later stage: a tensor summed
    over a TP group only, beside tensors summed over their ZeRO group and then that TP group, joins
    their TP all-reduce (stage 1) instead of adding one of its own at stage 0."""

    _requests: list[tuple[torch.Tensor, tuple[Any, ...]]] = field(default_factory=list)

    def add(self, tensor: torch.Tensor, groups: Sequence[Any], first_stage: int = 0) -> torch.Tensor:
        groups = tuple(g for g in groups if group_size(g) > 1)
        if groups:
            self._requests.append((tensor, (_SKIPPED,) * first_stage + groups))
        return tensor

    def __len__(self) -> int:
        return len(self._requests)

    def flush(self) -> None:
        requests, self._requests = self._requests, []
        # Stage k reduces every request over its k-th group. A request's groups are reduced one
        # stage after another so that, at each stage, all members of a group hold partial sums in
        # the same state (a tensor summed over its ZeRO group, then over its TP group); within a
        # stage, groups go in the global order of ordered_groups.
        for stage in range(max((len(gs) for _, gs in requests), default=0)):
            staged = [(t, gs[stage]) for t, gs in requests if len(gs) > stage and gs[stage] is not _SKIPPED]
            for group in ordered_groups(g for _, g in staged):
                by_dtype: dict[torch.dtype, list[torch.Tensor]] = collections.defaultdict(list)
                for tensor, g in staged:
                    if g is group:
                        by_dtype[tensor.dtype].append(tensor)
                for dtype in sorted(by_dtype, key=str):
                    _all_reduce_many(by_dtype[dtype], group, self._op)

    #: The reduction (a class attribute so subclasses pick another one).
    _op = "sum"


@dataclass
class MaxBucket(SumBucket):
    """:class:`SumBucket` with an element-wise maximum instead of a sum (block-wise absmax of
    tensors whose pieces live on several ranks)."""

    _op = "max"


def _all_reduce_many(tensors: list[torch.Tensor], group: Any, op: str = "sum") -> None:
    COUNTS["all_reduce"] += 1
    reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
    if len(tensors) == 1 and tensors[0].is_contiguous():
        _all_reduce(tensors[0], reduce_op, group)
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    _all_reduce(flat, reduce_op, group)
    flat_to(flat, tensors)


def _all_reduce(tensor: torch.Tensor, op: Any, group: Any) -> None:
    """``torch.distributed.all_reduce`` of ``tensor`` in place, on the group's device."""
    staging = Staging(group, active=dist is _TORCH_DIST)
    on_device = staging.recv(tensor, filled=True)
    if dist is _TORCH_DIST:
        check("all_reduce", group, [on_device], [on_device])
    dist.all_reduce(on_device, op=op, group=group)
    staging.finish()


def _all_gather_flat(flat: torch.Tensor, group: Any, wait: bool = True) -> tuple[torch.Tensor, Any]:
    """``[size, n]`` tensor whose row r is rank r's ``flat``, and the work to wait for (None once
    done; with ``wait=False`` the all_gather is issued asynchronously)."""
    size = group_size(group)
    # A 1-D output: gloo's all_gather_into_tensor rejects a [size, n] one.
    out = torch.empty(size * flat.numel(), dtype=flat.dtype, device=flat.device)
    COUNTS["all_gather"] += 1
    staging = Staging(group, active=dist is _TORCH_DIST)
    sent, got = staging.send(flat.contiguous()), staging.recv(out)
    if dist is _TORCH_DIST:
        check("all_gather", group, [sent], [got])
    work = dist.all_gather_into_tensor(got, sent, group=group, async_op=not wait)
    if wait:
        staging.finish()
        return out.view(size, flat.numel()), None
    return out.view(size, flat.numel()), StagedWork(work, staging)


def gather_full(
    items: Sequence[tuple[ParamLayout, torch.Tensor]], dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """Full tensors from local pieces: ZeRO chunks are gathered over their ZeRO group, padding is
    dropped, then TP slices are gathered over their TP group and concatenated along the split dim.
    All items sharing a group are gathered in one collective. ``dtype`` optionally sets the
    communication precision (e.g. bf16 to halve the bytes); the result is in the input's dtype."""
    results: list[torch.Tensor] = []
    for layout, tensor in items:
        if tensor.numel() != layout.chunk_numel:
            raise ValueError(
                f"gather_full: tensor of {tensor.numel()} elements does not match its layout "
                f"({layout.chunk_numel} elements expected)"
            )
        results.append(tensor.detach().reshape(-1) if layout.zero is not None else tensor.detach())
    out_dtypes = [t.dtype for _, t in items]

    def _stage(kind: str) -> None:
        pending: dict[int, list[int]] = collections.defaultdict(list)
        groups: dict[int, Any] = {}
        for i, (layout, _) in enumerate(items):
            part = layout.zero if kind == "zero" else layout.tp
            if kind == "zero" and part is not None and part.size == 1:
                results[i] = layout.to_working_shape(results[i])
            elif part is not None:
                pending[id(part.group)].append(i)
                groups[id(part.group)] = part.group
        for group in ordered_groups(groups.values()):
            idx = pending[id(group)]
            # Without an explicit communication dtype, the widest of the bucket: never round a
            # tensor through a narrower neighbour's dtype.
            comm_dtype = dtype or widest_dtype(results[i] for i in idx)
            # Every rank sends as many elements per item: a flat-range shard's pieces differ in
            # length, so each is padded to the longest (NCCL's all-gather takes equal sizes).
            widths = [items[i][0].largest_chunk_numel if kind == "zero" else results[i].numel() for i in idx]
            flat = torch.cat([_padded(results[i].reshape(-1).to(comm_dtype), w) for i, w in zip(idx, widths)])
            gathered, _ = _all_gather_flat(flat, group)
            offset = 0
            for i, n in zip(idx, widths):
                layout = items[i][0]
                piece = gathered[:, offset : offset + n]
                offset += n
                if kind == "zero" and layout.zero.bounds is not None:  # type: ignore[union-attr]
                    rows = [piece[r, :w] for r, w in enumerate(layout.gather_widths)]
                    results[i] = layout.to_working_shape(torch.cat(rows))
                elif kind == "zero":
                    results[i] = layout.to_working_shape(piece.reshape(-1))
                else:
                    size = layout.tp.size  # type: ignore[union-attr]
                    stacked = piece.reshape(size, *layout.local_shape)
                    dim = layout.tp.dim  # type: ignore[union-attr]
                    results[i] = stacked.movedim(0, dim).reshape(layout.full_shape)

    _stage("zero")
    for i, (layout, _) in enumerate(items):
        if layout.zero is None:
            results[i] = results[i].reshape(layout.local_shape)
    _stage("tp")
    return [r.to(d) if r.dtype != d else r for r, d in zip(results, out_dtypes)]


def _padded(flat: torch.Tensor, width: int) -> torch.Tensor:
    return flat if flat.numel() == width else torch.nn.functional.pad(flat, (0, width - flat.numel()))


def broadcast_from(tensors: Sequence[torch.Tensor], src_rank_in_group: int, group: Any) -> None:
    """Broadcast ``tensors`` (same dtype) in place from one rank of ``group``, in one collective."""
    if group_size(group) == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    COUNTS["broadcast"] += 1
    staging = Staging(group, active=dist is _TORCH_DIST)
    on_device = staging.recv(flat, filled=True)
    if dist is _TORCH_DIST:
        check("broadcast", group, [on_device], [on_device], src=src_rank_in_group)
    dist.broadcast(
        on_device,
        src=dist.get_global_rank(group, src_rank_in_group) if group is not None else src_rank_in_group,
        group=group,
    )
    staging.finish()
    flat_to(flat, tensors)


def share_owned(
    tensors: Sequence[torch.Tensor],
    owners: Sequence[int],
    group: Any,
    dtype: torch.dtype | None = None,
) -> None:
    """Every rank of ``group`` gets every tensor, each computed by its owner (rank in group).
    ``tensors`` are allocated with their final shapes on every rank; on the owner they hold the
    result, elsewhere anything. One ``all_gather`` of per-rank flat buffers (padded to the largest)
    fills them all in place. ``dtype`` sets the communication precision (e.g. bf16), results are
    written back in each tensor's own dtype."""
    size = group_size(group)
    if size == 1 or not tensors:
        return
    if len(tensors) != len(owners):
        raise ValueError("share_owned: one owner per tensor")
    comm_dtype = dtype or widest_dtype(tensors)
    per_rank: list[list[int]] = [[] for _ in range(size)]
    for i, owner in enumerate(owners):
        per_rank[owner].append(i)
    lengths = [sum(tensors[i].numel() for i in idx) for idx in per_rank]
    width = max(lengths)
    if width == 0:
        return
    me = group_rank(group)
    mine = [tensors[i].reshape(-1).to(comm_dtype) for i in per_rank[me]]
    flat = torch.zeros(width, dtype=comm_dtype, device=tensors[0].device)
    if mine:
        torch.cat(mine, out=flat[: lengths[me]])
    gathered, _ = _all_gather_flat(flat, group)
    for rank, idx in enumerate(per_rank):
        if rank == me:
            continue
        flat_to(gathered[rank], [tensors[i] for i in idx])


@dataclass
class Pending:
    """An exchange in flight (:func:`exchange` with ``wait=False``): :meth:`wait` finishes it,
    writing the received pieces in place; until then they hold nothing."""

    work: Any
    out: torch.Tensor
    recv: list[torch.Tensor]

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        flat_to(self.out, self.recv)
        self.recv = []


def exchange(
    send: Sequence[Sequence[torch.Tensor]],
    recv: Sequence[Sequence[torch.Tensor]],
    group: Any,
    dtype: torch.dtype,
    device: torch.device,
    wait: bool = True,
    rounds: int = 1,
) -> Pending | None:
    """Pieces between the ranks of ``group`` in one ``all_to_all``: ``send[r]`` (tensors or views,
    in order) go to rank r, which writes them into its ``recv[me]`` (views of the same shapes, in
    the same order, in place). Every rank of ``group`` calls it, also with nothing to move.

    ``dtype`` is the communication precision and must be the same on every rank; a rank's pieces
    to itself go through it too, so that every receiver of a value gets the same rounding.
    ``device`` holds the buffers (the one the backend communicates from). With ``wait=False`` the
    all_to_all is issued asynchronously and a :class:`Pending` returned: the caller computes
    meanwhile and calls its ``wait()`` before reading ``recv`` (the send tensors may be reused at
    once: they were copied into the send buffer).

    ``rounds`` (the same on every rank; at most the group's size counts) splits the exchange into
    that many all_to_alls, each moving the pieces of the pairs :func:`dist_optim.comm.chunks.exchange_round`
    gives it: the send and receive buffers then hold about ``1/rounds`` of the pieces each, where one
    owner sending a whole tensor's pieces to every holder would otherwise copy all of it at once.
    Run one after the other (``wait`` is ignored: None is returned); the same values."""
    size = group_size(group)
    if len(send) != size or len(recv) != size:
        raise ValueError(f"exchange: one list of pieces per rank of the group ({size}) to send and to receive")
    send_counts = [sum(t.numel() for t in pieces) for pieces in send]
    recv_counts = [sum(t.numel() for t in pieces) for pieces in recv]
    if torch.device(device).type == "meta":  # no values: the counts are the exchange, rounds included
        return exchange_counts(send_counts, recv_counts, group, dtype, device, wait, rounds)
    rounds = max(1, min(int(rounds), size))
    if rounds > 1:
        me = group_rank(group)
        for k in range(rounds):
            exchange(
                [send[r] if exchange_round(me, r, size, rounds) == k else [] for r in range(size)],
                [recv[r] if exchange_round(r, me, size, rounds) == k else [] for r in range(size)],
                group,
                dtype,
                device,
            )
        return None
    flat = torch.empty(sum(send_counts), dtype=dtype, device=device)
    pieces = [t for per_rank in send for t in per_rank]
    if pieces and all(t.dtype == dtype and t.is_contiguous() for t in pieces):
        # One call: a step sends pieces of every tensor of a bucket to every rank, and a copy per
        # piece from Python costs more than the bytes. Not for strided pieces (boxes of a matrix):
        # flattening each would copy it first, all of them alive at once.
        torch.cat([t.reshape(-1) for t in pieces], out=flat)
    else:
        to_flat(pieces, flat)
    out, work = _all_to_all(flat, send_counts, recv_counts, group, wait)
    return _waited(Pending(work, out, [t for pieces in recv for t in pieces]), wait)


def exchange_counts(
    send_counts: Sequence[int],
    recv_counts: Sequence[int],
    group: Any,
    dtype: torch.dtype,
    device: torch.device,
    wait: bool = True,
    rounds: int = 1,
) -> Pending | None:
    """:func:`exchange` on the meta device (the planner's simulated step), where tensors hold no
    values: ``send_counts[r]`` elements to rank r, ``recv_counts[r]`` from it, the same buffers,
    collectives and rounds, without a copy or a view per piece, which were most of what a simulated
    owner exchange dispatched (``time python -m dist_optim.plan --model llama-70b --tp 8 --dp 8
    --zero 1 --optimizer shampoo``)."""
    size = group_size(group)
    rounds = max(1, min(int(rounds), size))
    if rounds > 1:
        me = group_rank(group)
        sends = [exchange_round(me, r, size, rounds) for r in range(size)]
        recvs = [exchange_round(r, me, size, rounds) for r in range(size)]
        for k in range(rounds):
            exchange_counts(
                [n if sends[r] == k else 0 for r, n in enumerate(send_counts)],
                [n if recvs[r] == k else 0 for r, n in enumerate(recv_counts)],
                group,
                dtype,
                device,
            )
        return None
    flat = torch.empty(sum(send_counts), dtype=dtype, device=device)
    out, work = _all_to_all(flat, list(send_counts), list(recv_counts), group, wait)
    return _waited(Pending(work, out, []), wait)


def _waited(pending: Pending, wait: bool) -> Pending | None:
    """An exchange's end: waited for (None), or handed to the caller to wait for."""
    if wait:
        pending.wait()
        return None
    return pending


def _all_to_all(
    flat: torch.Tensor, send: list[int], recv: list[int], group: Any, wait: bool, out: torch.Tensor | None = None
) -> tuple[Any, Any]:
    """One ``all_to_all_single`` of the packed ``flat`` (``send[r]`` elements for rank r, in rank
    order): the flat received elements (``recv[r]`` from rank r; into ``out`` where given) and the
    work to wait for."""
    out = torch.empty(sum(recv), dtype=flat.dtype, device=flat.device) if out is None else out
    COUNTS["all_to_all"] += 1
    staging = Staging(group, active=dist is _TORCH_DIST)
    sent, got = staging.send(flat), staging.recv(out)
    if dist is _TORCH_DIST:
        check("all_to_all", group, [sent], [got], send_splits=send, recv_splits=recv)
    work = dist.all_to_all_single(got, sent, recv, send, group=group, async_op=not wait)
    if wait:
        staging.finish()
        return out, None
    return out, StagedWork(work, staging)


def reduce_scatter(tensors: Sequence[torch.Tensor], group: Any, align: int | Sequence[int] = 1) -> list[torch.Tensor]:
    """The sum over the ranks of ``group`` of each of ``tensors`` (same shapes on every rank), each rank
    getting only its chunk (:func:`chunk_span`, of the flattened tensor; ``align``: one for all, or one
    per tensor): one ``all_to_all`` for all of them (sent in their own dtype, which must be one dtype for
    the call). The chunk owner adds the pieces in rank order, so a value does not depend on the other
    tensors of the call; a reduce-scatter collective would sum in an order set by the element's place in
    the buffer."""
    size, me = group_size(group), group_rank(group)
    flats = [t.reshape(-1) for t in tensors]
    if size == 1:
        return [f.clone() for f in flats]
    widths = [chunk_numel(f.numel(), size, a) for f, a in zip(flats, aligns_for(align, len(flats)))]
    mine = [max(0, min(f.numel(), (me + 1) * w) - me * w) for f, w in zip(flats, widths)]
    dtype, device, width = flats[0].dtype, flats[0].device, sum(widths)
    # Row r of ``send``: this rank's chunk of every tensor for rank r, zero-padded to its width. What
    # rank r receives is one row of ``got`` each, summed row by row (the same additions in rank order
    # as tensor by tensor); the padding is cut off. Both done with here: scratch (kept on the CPU).
    send = scratch("reduce_scatter.send", size * width, dtype, device).view(size, width)
    pack_chunks(flats, widths, send)
    recv = scratch("reduce_scatter.recv", size * width, dtype, device)
    got = _all_to_all(send.view(-1), [width] * size, [width] * size, group, True, recv)[0].view(size, width)
    acc = got[0] + got[1]  # a new tensor, not a view of the reused rows: the same sums in rank order
    for r in range(2, size):
        acc.add_(got[r])
    return [chunk[:n] for chunk, n in zip(acc.split(widths), mine)]


@dataclass
class Gathering:
    """:func:`start_all_gather_chunks` in flight: :meth:`wait` gives the whole flat tensors."""

    work: Any
    gathered: torch.Tensor
    numels: Sequence[int]
    widths: Sequence[int]

    def wait(self) -> list[torch.Tensor]:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return unpack_chunks(self.gathered, self.numels, self.widths)


def start_all_gather_chunks(
    chunks: Sequence[torch.Tensor], numels: Sequence[int], group: Any, align: int | Sequence[int] = 1
) -> Gathering:
    """The inverse of :func:`reduce_scatter`'s split: whole flat tensors of ``numels`` elements from every
    rank's chunks (1-D, of one dtype), in one ``all_gather`` issued asynchronously (the chunks may
    change at once: they were copied); the returned :class:`Gathering`'s ``wait()`` gives them."""
    size = group_size(group)
    if size == 1:
        return Gathering(None, torch.cat([c.reshape(1, -1) for c in chunks], dim=1), numels, numels)
    widths = [chunk_numel(n, size, a) for n, a in zip(numels, aligns_for(align, len(numels)))]
    # Not a scratch buffer: the all_gather is in flight after this returns.
    flat = torch.empty(sum(widths), dtype=chunks[0].dtype, device=chunks[0].device)
    pack_chunks([c.reshape(-1) for c in chunks], widths, flat.view(1, -1))
    gathered, work = _all_gather_flat(flat, group, wait=False)
    return Gathering(work, gathered, numels, widths)


def all_gather_chunks(
    chunks: Sequence[torch.Tensor], numels: Sequence[int], group: Any, align: int | Sequence[int] = 1
) -> list[torch.Tensor]:
    """:func:`start_all_gather_chunks`, waited for."""
    return start_all_gather_chunks(chunks, numels, group, align).wait()


def all_gather_along(tensor: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Every rank's ``tensor`` (all of one shape) concatenated along ``dim`` in rank order: a
    sequence split over sequence-parallel ranks made whole again. One all-gather."""
    size = group_size(group)
    if size == 1:
        return tensor
    rows, _ = _all_gather_flat(tensor.reshape(-1), group)
    return torch.cat([row.view(tensor.shape) for row in rows.unbind(0)], dim=dim)


def all_gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's picklable ``obj`` (checkpoint metadata, not tensors on a hot path)."""
    if not dist.is_available() or not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    COUNTS["all_gather_object"] += 1
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group: Any = None) -> None:
    if dist.is_available() and dist.is_initialized():
        COUNTS["barrier"] += 1
        dist.barrier(group=group)
