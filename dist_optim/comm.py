"""Every collective dist_optim issues goes through this module.

Optimizers do their math on local tensors and hand the cross-process parts to a few layout-aware,
*bucketed* operations:

* :class:`SumBucket`: queue tensors whose values are partial sums over a parameter's shards (sums of
  squares for norms, row/column bins for factored statistics), then ``flush()`` once: one
  ``all_reduce`` per process group for the whole step, not one per parameter.
* :func:`gather_full`: local pieces (TP slices, ZeRO chunks) back into full tensors, one
  ``all_gather`` per group for all the tensors of a call.
* :func:`broadcast_from`: bucketed broadcast of results computed by one owner rank.
* :func:`share_owned`: results computed by different owner ranks, to every rank, in one ``all_gather``.
* :func:`exchange`: pieces from each rank to the ranks that need them (gradient pieces to the owners
  of blocks, the owners' results back), in one ``all_to_all``: each rank receives what it uses.
* :func:`reduce_scatter` / :func:`all_gather_chunks`: sums split into equal chunks, one per rank, and
  back to whole tensors; one collective each per call. The sum is made in rank order on the chunk's
  rank: its value does not depend on the other tensors of the call (nor on buckets).

Each is a no-op for a parameter whose layout is local. ``COUNTS`` counts the collectives issued
(tests and benchmarks: the number per step does not grow with the number of parameters).

Ordering: a process takes part in several groups (its TP group, its ZeRO group, ...). Buckets are
flushed group by group in one global order (the sorted member ranks of each group), which every
process follows, so collectives on overlapping groups cannot deadlock.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .chunks import aligns_for, chunk_numel, exchange_round, flat_to, pack_chunks, scratch, to_flat, unpack_chunks
from .dtypes import widest_dtype
from .layout import ParamLayout

__all__ = [
    "COUNTS",
    "reset_counts",
    "SumBucket",
    "MaxBucket",
    "gather_full",
    "broadcast_from",
    "share_owned",
    "exchange",
    "Pending",
    "reduce_scatter",
    "all_gather_chunks",
    "start_all_gather_chunks",
    "Gathering",
    "all_gather_objects",
    "grid_groups",
    "grid_of",
    "group_key",
    "ordered_groups",
    "topology_token",
    "release_groups",
    "freeing_groups",
    "barrier",
    "group_size",
    "group_rank",
    "collectives_through",
]

#: Number of collectives issued since the last :func:`reset_counts`, by operation name.
COUNTS: collections.Counter[str] = collections.Counter()


@contextlib.contextmanager
def collectives_through(backend: Any) -> Iterator[Any]:
    """Inside the block, every call this module makes to ``torch.distributed`` goes to ``backend``
    instead: an object with the same functions (the planner's recorder, ``dist_optim.plan.traffic``,
    which counts collectives and bytes and may answer them without communicating). The one hook
    by which code outside this module observes or replaces its collectives. Not thread-safe."""
    global dist
    saved = dist
    dist = backend
    try:
        yield backend
    finally:
        dist = saved


def reset_counts() -> None:
    COUNTS.clear()


#: (size, rank, member ranks) of torch.distributed's groups, with the group, by ``id(group)``:
#: asking torch.distributed costs microseconds, hundreds of times a step. The entry holds its group
#: (until release_groups), so that its id is not reused by a group with other members (a stale key
#: would order collectives differently on different ranks). Not for ``None`` (re-made by each
#: ``init_process_group``) nor for another backend (``collectives_through``'s).
_PLACES: dict[int, tuple[Any, tuple[int, int, tuple[int, ...]]]] = {}
_TORCH_DIST = dist  # ``dist`` itself is rebound inside collectives_through


def _place(group: Any) -> tuple[int, int, tuple[int, ...]]:
    cached = _PLACES.get(id(group))
    if cached is not None and cached[0] is group and dist is _TORCH_DIST:
        return cached[1]
    if not dist.is_available() or not dist.is_initialized():
        return 1, 0, (0,)
    size = dist.get_world_size(group)
    key = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(size))
    place = size, dist.get_rank(group), key
    if group is not None and dist is _TORCH_DIST:
        _PLACES[id(group)] = (group, place)
    return place


def group_size(group: Any) -> int:
    """World size of ``group`` (1 when no process group is initialised)."""
    return _place(group)[0]


def group_rank(group: Any) -> int:
    """This process's rank in ``group`` (0 when no process group is initialised)."""
    return _place(group)[1]


def group_key(group: Any) -> tuple[int, ...]:
    """A key that orders groups identically on every process: their global member ranks."""
    return _place(group)[2]


def ordered_groups(groups: Iterable[Any]) -> list[Any]:
    """``groups`` without repeats, in the one order every process follows (:func:`group_key`):
    collectives issued group by group in this order cannot deadlock on overlapping groups."""
    unique: dict[tuple[tuple[int, ...], int], Any] = {}
    for g in groups:
        unique.setdefault((group_key(g), id(g)), g)
    return [unique[k] for k in sorted(unique, key=lambda k: k[0])]


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
        dist.all_reduce(tensors[0], op=reduce_op, group=group)
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=reduce_op, group=group)
    flat_to(flat, tensors)


def _all_gather_flat(flat: torch.Tensor, group: Any, wait: bool = True) -> tuple[torch.Tensor, Any]:
    """``[size, n]`` tensor whose row r is rank r's ``flat``, and the work to wait for (None once
    done; with ``wait=False`` the all_gather is issued asynchronously)."""
    size = group_size(group)
    # A 1-D output: gloo's all_gather_into_tensor rejects a [size, n] one.
    out = torch.empty(size * flat.numel(), dtype=flat.dtype, device=flat.device)
    COUNTS["all_gather"] += 1
    work = dist.all_gather_into_tensor(out, flat.contiguous(), group=group, async_op=not wait)
    return out.view(size, flat.numel()), work


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
            flat = torch.cat([results[i].reshape(-1).to(comm_dtype) for i in idx])
            gathered, _ = _all_gather_flat(flat, group)
            offset = 0
            for i in idx:
                layout = items[i][0]
                n = results[i].numel()
                piece = gathered[:, offset : offset + n]
                offset += n
                if kind == "zero":
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


def broadcast_from(tensors: Sequence[torch.Tensor], src_rank_in_group: int, group: Any) -> None:
    """Broadcast ``tensors`` (same dtype) in place from one rank of ``group``, in one collective."""
    if group_size(group) == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    COUNTS["broadcast"] += 1
    dist.broadcast(
        flat,
        src=dist.get_global_rank(group, src_rank_in_group) if group is not None else src_rank_in_group,
        group=group,
    )
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
    that many all_to_alls, each moving the pieces of the pairs :func:`dist_optim.chunks.exchange_round`
    gives it: the send and receive buffers then hold about ``1/rounds`` of the pieces each, where one
    owner sending a whole tensor's pieces to every holder would otherwise copy all of it at once.
    Run one after the other (``wait`` is ignored: None is returned); the same values."""
    size = group_size(group)
    if len(send) != size or len(recv) != size:
        raise ValueError(f"exchange: one list of pieces per rank of the group ({size}) to send and to receive")
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
    send_counts = [sum(t.numel() for t in pieces) for pieces in send]
    recv_counts = [sum(t.numel() for t in pieces) for pieces in recv]
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
    pending = Pending(work, out, [t for pieces in recv for t in pieces])
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
    return out, dist.all_to_all_single(out, flat, recv, send, group=group, async_op=not wait)


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


#: Grid groups made by :func:`grid_groups`, by their sorted member ranks (made once per job), with
#: the default group they were made under: a re-initialised job makes them again.
_GRIDS: dict[tuple[int, ...], tuple[Any, Any]] = {}

#: Grids whose ranks are in the order of parts partitioned over a data-parallel group, then TP
#: (:func:`grid_of`), by the keys of the two groups, with the default group they were made under.
_GRID_OF: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[Any, Any]] = {}

_RELEASES = 0  # bumped by release_groups: part of topology_token


def topology_token() -> Any:
    """Changes wherever group_size, group_rank, group_key or grid_of may answer otherwise for the same
    groups (a new default group, a grid made, :func:`release_groups`): :mod:`dist_optim.partition`
    keeps its plans by it. None where not torch.distributed's own (collectives_through; no group)."""
    if dist is not _TORCH_DIST or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.group.WORLD, len(_GRID_OF), _RELEASES


def release_groups() -> None:
    """Let go of the groups the caches hold (places; partition plans, by the token; not the live
    grids), so that destroyed ones are freed with their communicators (a gloo thread polling every
    10 ms, NCCL's memory): booster.boost and the test pool call it once a plugin is collected."""
    global _RELEASES
    with freeing_groups():
        _PLACES.clear()
    _RELEASES += 1


@contextlib.contextmanager
def freeing_groups() -> Iterator[None]:
    """Groups known at entry (torch.distributed's, the caches') whose last reference goes inside the block keep
    their backends until it ends, which frees them with the GIL released. torch 2.5.1 frees a backend under the GIL
    (pytorch#154976 changed that later); a gloo backend's destructor waits for its threads, and one freeing a
    collective that has just finished needs the GIL: both then wait for ever."""
    world = getattr(_TORCH_DIST.distributed_c10d, "_world", None)
    groups = [*(world.pg_map if world is not None else ()), *(g for g, _ in _PLACES.values())]
    held = [g._get_backend(d) for g in groups for d in getattr(g, "_device_types", ())]
    del groups  # else this frame would hold the groups until after their backends
    try:
        yield
    finally:
        held.clear()  # a backend's own Python object frees it without the GIL


def grid_of(base: Any, tp: Any) -> Any:
    """The grid group :func:`grid_groups` made of data-parallel group ``base`` and TP group ``tp``
    when every member's rank in it is ``rank(base) * size(tp) + rank(tp)``: the index of the part
    a member keeps of a tensor partitioned over ``(base, tp)`` (:mod:`dist_optim.partition`), which
    then takes one collective over the grid instead of one per group. None otherwise (no grid made,
    or its ranks in another order)."""
    if base is None or tp is None or not dist.is_available() or not dist.is_initialized():
        return None
    found = _GRID_OF.get((group_key(base), group_key(tp)))
    return found[1] if found is not None and found[0] is dist.group.WORLD else None


def grid_groups(tp_group: Any, bases: Sequence[Any]) -> list[Any]:
    """For each group in ``bases`` (data-parallel groups of this process), the group of all ranks
    of the grid it spans with ``tp_group``: the union of the TP groups of its members (the TP x DP
    ranks of a pipeline stage), or None where the two are not orthogonal axes of one grid.

    Making process groups is collective over the whole job in torch.distributed: every process
    must call this at the same point (a plugin binding its optimizer), with its own groups. One
    ``all_gather_object`` over the world tells every process every process's groups; all of them
    then create every valid grid in one sorted order, once per job."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return [None] * len(bases)
    tp = tuple(sorted(dist.get_process_group_ranks(tp_group)))
    mine = [(tp, group_key(b)) for b in bases]
    every = all_gather_objects(mine)
    tp_of = {r: pairs[0][0] for r, pairs in enumerate(every) if pairs}

    def span(pair: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple[int, ...] | None:
        a, b = pair
        if any(q not in tp_of for q in b):
            return None
        ranks = tuple(sorted({r for q in b for r in tp_of[q]}))
        return ranks if len(ranks) == len(a) * len(b) else None

    # The ranks of one data-parallel group name the same pair, and the same grid: each distinct
    # pair is spanned and each grid checked once, not once per rank (quadratic in the world size:
    # seconds at 1024 ranks).
    spanned: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[int, ...] | None] = {}
    for pairs in every:
        for pair in pairs:
            if pair not in spanned:
                spanned[pair] = span(pair)
    spans = [[spanned[pair] for pair in pairs] for pairs in every]
    listed = [set(s for s in per_rank if s is not None) for per_rank in spans]
    # A grid is made only if every member names it: then all of them agree on its members.
    named = {s for per_rank in listed for s in per_rank}
    valid = sorted(s for s in named if all(s in listed[q] for q in s))
    world = dist.group.WORLD
    for ranks in valid:
        made = _GRIDS.get(ranks)
        if made is None or made[0] is not world:
            _GRIDS[ranks] = (world, dist.new_group(list(ranks)))
        # A member's grid rank is its place in the sorted ranks (new_group sorts them); where that is
        # r_dp * tp + r_tp for every member, the grid is the two groups in one (grid_of).
        pairs = {q: next(pair for pair, s in zip(every[q], spans[q]) if s == ranks) for q in ranks}
        if all(i == b.index(q) * len(a) + a.index(q) for i, (q, (a, b)) in enumerate(pairs.items())):
            for a, b in set(pairs.values()):
                _GRID_OF[(b, a)] = (world, _GRIDS[ranks][1])
    me = dist.get_rank()
    return [_GRIDS[s][1] if s in valid else None for s in spans[me]]


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
