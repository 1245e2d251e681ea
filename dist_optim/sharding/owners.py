"""Whole-tensor work on owner ranks: the one owner interface of Shampoo (blocks of a tensor), Muon
(matrices of a parameter), Kron (one whole parameter) and GaLore (one SVD per matrix).

Work that needs a whole tensor (a preconditioner block, a Newton-Schulz iteration, a Kron
preconditioner, an SVD) is owned by one rank of a *work group*, and every optimizer that does such
work goes through the same five steps, all here:

1. **Work groups** (:class:`WorkGroups`, made when the optimizer is bound): a parameter's
   data-parallel (ZeRO) group, or under tensor parallelism the TP x DP grid that group spans with
   the TP group (:func:`work_grids`), so that TP peers split the work instead of repeating it;
   with no data-parallel group its TP group; :data:`ONE_RANK` (one rank, no collective) when unbound.
2. **Owners by cost** (:func:`plan_tasks`, :func:`assign`): the items of each work group balanced
   over its ranks (:func:`dist_optim.sharding.placement.assign_owners`, longest-processing-time greedy).
   Pure: every rank computes the same owners from full shapes.
3. **Routes** (:func:`route_tasks`): for a tensor held in pieces (TP slices, ZeRO chunks), which
   piece goes from which rank to the owner of its box and which piece of the result comes back
   (:func:`dist_optim.sharding.placement.plan_route`), from every rank's holding, asked in one
   ``all_gather_object`` per work group (when the optimizer plans, not every step).
4. **The routed exchange** (:func:`to_owners` / :func:`from_owners`): each rank's pieces straight
   to the owners, who assemble their boxes, and the owners' results back to every rank that holds
   a piece of them: one ``all_to_all`` per work group and direction for all the tensors given
   (:func:`dist_optim.comm.exchange`), in a chosen communication dtype. A rank receives its boxes
   and its pieces of the results, about ``2/size`` of the bytes of gathering every full tensor,
   and nobody holds a full tensor it does not own. A tensor that every rank holds whole (DDP) is
   not sent: its owner uses its own copy. Where no route exists (holdings that do not tile the
   tensor), the fallback is to gather the full tensor (:func:`dist_optim.comm.gather_full`), let
   the owners compute and share the results whole (step 5).
5. **Whole results** (:func:`share_results`): results every rank of the work group needs whole
   (Kron's factors in its full state, directions of tensors held whole or gathered) from their
   owners, one ``all_gather`` per work group, the owner rounding its own copy through the
   communication dtype so that replicas stay equal; or **partitioned results**
   (:func:`scatter_results`): each rank's partition of them (GaLore's projectors, kept 1/n per
   rank), one ``all_to_all`` per work group.

Work groups are visited in the one global order (:func:`dist_optim.comm.ordered_groups`), so every
rank issues the same collectives in the same order. Pure planning here, every collective in
:mod:`dist_optim.comm`, the geometry and scheduling in :mod:`dist_optim.sharding.placement`.

``None`` as a group. A process group of ``None`` is the default group, the whole job, here as in
:mod:`dist_optim.comm` and ``torch.distributed`` (``comm.group_size(None)`` is the world size). The
only ``None`` that means "no group" is an optimizer's ``dp_group`` / ``tp_group`` attribute when it
was bound without one (:meth:`~dist_optim.base.DistOptimizer.bind`): :func:`work_grids` and
:func:`work_group` read those, and turn "none" into :data:`ONE_RANK`, so that no size or rank is ever
computed from a ``None`` that means "none".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from ..comm import (
    Pending,
    all_gather_objects,
    exchange,
    exchange_counts,
    group_key,
    group_rank,
    group_size,
    ordered_groups,
    share_owned,
    spanning_groups,
)
from ..comm.chunks import chunk_span
from ..comm.dtypes import widest_dtype
from ..layout import Box, ParamLayout
from .budget import exchange_rounds
from .placement import Route, assign_owners, plan_route

B = TypeVar("B")
S = TypeVar("S")

__all__ = [
    "HeldPiece",
    "held_piece",
    "member_layout",
    "work_grids",
    "WorkGroup",
    "ONE_RANK",
    "data_group",
    "work_group",
    "WorkGroups",
    "Owner",
    "assign",
    "Task",
    "plan_tasks",
    "route_tasks",
    "RoutedTensors",
    "InFlight",
    "to_owners",
    "pipelined",
    "from_owners",
    "share_results",
    "scatter_results",
]

#: What a rank tells the others of its work group about its piece of a tensor: the full shape, its
#: TP rank and its ZeRO rank (None where not split that way).
HeldPiece = tuple[tuple[int, ...], "int | None", "int | None"]


def held_piece(layout: ParamLayout) -> HeldPiece:
    """This rank's :data:`HeldPiece` of a tensor of ``layout``."""
    return (
        layout.full_shape,
        None if layout.tp is None else layout.tp.rank,
        None if layout.zero is None else layout.zero.rank,
    )


def member_layout(layout: ParamLayout, theirs: HeldPiece) -> ParamLayout | None:
    """``layout`` as another rank of the work group holds it (its :func:`held_piece`); None where
    that rank's layout differs from this one's in more than its TP and ZeRO ranks."""
    full_shape, tp_rank, zero_rank = theirs
    if full_shape != layout.full_shape or (tp_rank is None) != (layout.tp is None):
        return None
    if (zero_rank is None) != (layout.zero is None):
        return None
    tp = None if layout.tp is None or tp_rank is None else dataclasses.replace(layout.tp, rank=tp_rank)
    zero = None if layout.zero is None or zero_rank is None else dataclasses.replace(layout.zero, rank=zero_rank)
    return dataclasses.replace(layout, tp=tp, zero=zero)


def work_grids(tp_group: Any, bases: Sequence[Any]) -> dict[tuple[int, ...], Any]:
    """Under TP, the TP x DP grid group of each data-parallel (ZeRO) group in ``bases``, by
    :func:`~dist_optim.comm.group_key` of the base group (only those that form a grid).

    Collective over the whole job (it makes process groups): every process calls it at the same
    point, when its optimizer is bound. Empty without TP."""
    if tp_group is None or group_size(tp_group) <= 1:
        return {}
    ordered = ordered_groups(g for g in bases if g is not None)
    grids = spanning_groups(tp_group, ordered)
    return {group_key(base): grid for base, grid in zip(ordered, grids) if grid is not None}


# ---- whole results that every rank of the work group needs ------------------------------------
@dataclasses.dataclass(frozen=True)
class WorkGroup:
    """The ranks that split a set of whole-tensor work (a TP x DP grid, a data-parallel group, a TP
    group) and this rank's place among them: ``size`` ranks, this one ``rank``.

    ``group`` is their process group, read only when ``size > 1`` (a work group of one rank issues
    no collective); there ``None`` would be the default group, as everywhere in dist_optim."""

    group: Any
    size: int
    rank: int

    @classmethod
    def of(cls, group: Any) -> WorkGroup:
        """The work group of the ranks of ``group`` (a process group; None: the whole job);
        :data:`ONE_RANK` when it has one rank."""
        size = group_size(group)
        return cls(group, size, group_rank(group)) if size > 1 else ONE_RANK


#: This rank alone: the work is not split (unbound, or no other rank holds the tensor).
ONE_RANK = WorkGroup(group=None, size=1, rank=0)


def data_group(layout: ParamLayout, dp_group: Any) -> Any:
    """The data-parallel group over which a tensor of ``layout`` is split or replicated: its ZeRO
    group, else the optimizer's ``dp_group`` (None where it was bound without one: none)."""
    return layout.zero.group if layout.zero is not None else dp_group


def work_group(layout: ParamLayout, dp_group: Any, tp_group: Any, grids: Mapping[tuple[int, ...], Any]) -> WorkGroup:
    """The ranks that share the whole-tensor work of a tensor of ``layout``: the TP x DP grid of its
    :func:`data_group` (``grids``: from :func:`work_grids`) when it has one, else that data-parallel
    group alone (its TP peers then compute the same results), else, with no data-parallel group, its
    TP group (``layout``'s, or the optimizer's ``tp_group`` for a tensor replicated over TP);
    :data:`ONE_RANK` without either.

    ``dp_group`` / ``tp_group`` are the optimizer's (None: bound without one). A grid is used for
    a TP-split tensor only when its TP group is the optimizer's (the one the grids were made with).
    Every rank that holds pieces of the tensor gets the same ranks."""
    base = data_group(layout, dp_group)
    own_tp = layout.tp.group if layout.tp is not None else tp_group
    if base is not None:
        same_tp = layout.tp is None or (tp_group is not None and group_key(own_tp) == group_key(tp_group))
        grid = grids.get(group_key(base)) if same_tp else None
        return WorkGroup.of(grid if grid is not None else base)
    return WorkGroup.of(own_tp) if own_tp is not None else ONE_RANK


@dataclasses.dataclass(frozen=True)
class Owner:
    """Who computes one item of whole-tensor work: rank ``rank`` of the work group ``work``."""

    work: WorkGroup
    rank: int

    @property
    def mine(self) -> bool:
        """Whether this rank computes the item."""
        return self.rank == self.work.rank

    @property
    def shared(self) -> bool:
        """Whether the result travels to other ranks (the work group has more than this one)."""
        return self.work.size > 1


def _work_key(work: WorkGroup) -> tuple[int, int]:
    # By process group (WorkGroup.of makes a new object per call) and size (ONE_RANK's None is no group).
    return id(work.group), work.size


def assign(items: Sequence[tuple[WorkGroup, float]]) -> list[Owner]:
    """The :class:`Owner` of each ``(work group, cost)`` item: the items of each work group, in
    their order, balanced by cost over its ranks (:func:`~dist_optim.sharding.placement.assign_owners`).

    Pure: every rank of a work group computes the same owners when it lists the same items in the
    same order with the same costs (from full shapes, never from local ones)."""
    by_group: dict[tuple[int, int], list[int]] = {}
    for i, (work, _) in enumerate(items):
        by_group.setdefault(_work_key(work), []).append(i)
    owners: list[Owner | None] = [None] * len(items)
    for idx in by_group.values():
        work = items[idx[0]][0]
        for i, rank in zip(idx, assign_owners([float(items[i][1]) for i in idx], work.size)):
            owners[i] = Owner(items[i][0], rank)
    return owners  # type: ignore[return-value]


class WorkGroups:
    """The work groups of one optimizer's parameters: :data:`ONE_RANK` until :meth:`bind`, then
    :func:`work_group` with the TP x DP grids made at binding."""

    def __init__(self) -> None:
        self._bound = False
        self._dp_group: Any = None
        self._tp_group: Any = None
        self._grids: dict[tuple[int, ...], Any] = {}

    def bind(self, layouts: Sequence[ParamLayout], dp_group: Any, tp_group: Any) -> None:
        """Make the grids of the data-parallel groups of ``layouts`` (the parameters whose work
        goes to owners). Collective over the whole job under TP: every process binds its
        optimizer at the same point."""
        self._dp_group, self._tp_group = dp_group, tp_group
        self._grids = work_grids(tp_group, [data_group(layout, dp_group) for layout in layouts])
        self._bound = True

    def of(self, layout: ParamLayout) -> WorkGroup:
        """The :class:`WorkGroup` of a tensor of ``layout``."""
        if not self._bound:
            return ONE_RANK
        return work_group(layout, self._dp_group, self._tp_group, self._grids)

    def of_slice(self, layout: ParamLayout) -> WorkGroup:
        """The :class:`WorkGroup` of this rank's TP slice of a tensor of ``layout`` taken as a
        tensor of its own (work that never needs the other slices): the data-parallel ranks that
        share the slice, never its TP peers, which hold other slices."""
        base = data_group(layout, self._dp_group) if self._bound else None
        return WorkGroup.of(base) if base is not None else ONE_RANK


# ---- tensors cut into boxes, each box computed on its owner ------------------------------------
@dataclasses.dataclass(eq=False)
class Task:
    """One tensor's whole-tensor work: the tensor of ``layout`` seen in shape ``view``, cut into
    ``boxes`` of that view (one box: the whole tensor), box i computed by rank ``owners[i]`` of
    ``work``. ``route`` is set by :func:`route_tasks` (None: not routed)."""

    work: WorkGroup
    layout: ParamLayout
    view: tuple[int, ...]
    boxes: list[Box]
    owners: list[int]
    route: Route | None = None

    @property
    def owned(self) -> list[int]:
        """The boxes this rank computes."""
        return [i for i, owner in enumerate(self.owners) if owner == self.work.rank]

    def owner(self, index: int) -> Owner:
        """The :class:`Owner` of box ``index``."""
        return Owner(self.work, self.owners[index])

    def box_shape(self, index: int) -> tuple[int, ...]:
        return tuple(hi - lo for lo, hi in self.boxes[index])


def plan_tasks(
    items: Sequence[tuple[WorkGroup, ParamLayout, tuple[int, ...], Sequence[Box], Sequence[float]]],
) -> list[Task]:
    """A :class:`Task` for each ``(work group, layout, view, boxes, cost of each box)``, the boxes
    of each work group's tasks balanced by cost over its ranks (:func:`assign`, all the boxes of a
    work group at once, in the order given). Pure."""
    flat = [(work, cost) for work, _, _, boxes, costs in items for cost in costs[: len(boxes)]]
    owners = iter(assign(flat))
    return [
        Task(work, layout, tuple(view), list(boxes), [next(owners).rank for _ in boxes])
        for work, layout, view, boxes, _ in items
    ]


def _by_work_group(tasks: Sequence[Any], work_of: Any = None) -> list[tuple[WorkGroup, list[Any]]]:
    """``tasks`` (anything with a ``work`` attribute, or ``work_of(task)``) per work group of more
    than one rank, in the global order of their process groups: the order every rank walks them."""
    found: dict[tuple[int, int], tuple[WorkGroup, list[Any]]] = {}
    for t in tasks:
        work = t.work if work_of is None else work_of(t)
        if work.size > 1:
            found.setdefault(_work_key(work), (work, []))[1].append(t)
    by_id = {id(e[0].group): e for e in found.values()}
    return [by_id[id(g)] for g in ordered_groups(e[0].group for e in found.values())]


def route_tasks(tasks: Sequence[Task]) -> None:
    """Set the :attr:`Task.route` of each task of a work group of more than one rank: which of
    this rank's pieces go to the owners of its boxes and which pieces of the results come back.
    None where the pieces cannot be routed (not boxes of the view, or holdings that do not tile
    it): the caller gathers that tensor whole.

    Collective: one ``all_gather_object`` per work group, every rank of it calling with the same
    tasks in the same order. If the ranks do not list the same number of tasks, every rank sees
    it and all of them get None everywhere."""
    for work, members in _by_work_group(tasks):
        routes = _routes(
            [t.layout for t in members],
            [t.view for t in members],
            [t.boxes for t in members],
            [t.owners for t in members],
            work.group,
        )
        for task, route in zip(members, routes):
            task.route = route


def _routes(
    layouts: Sequence[ParamLayout],
    views: Sequence[tuple[int, ...]],
    blocks: Sequence[Sequence[Box]],
    owners: Sequence[Sequence[int]],
    group: Any,
) -> list[Route | None]:
    """This rank's :class:`~dist_optim.sharding.placement.Route` for each tensor of a work group: tensor i has
    ``layouts[i]``, is cut into ``blocks[i]`` (boxes of its full tensor seen in ``views[i]``) with
    owners ``owners[i]`` (ranks of ``group``). None for a tensor whose pieces cannot be routed
    (not boxes of the view, or holdings that do not tile it): the caller gathers it whole.

    Collective over ``group`` (one ``all_gather_object``): every rank of it calls this with the
    same tensors in the same order. If the ranks do not list the same number of tensors, every
    rank sees it and all of them get None everywhere."""
    every = all_gather_objects([held_piece(layout) for layout in layouts], group=group)
    if any(len(theirs) != len(layouts) for theirs in every):
        return [None] * len(layouts)
    me = group_rank(group)
    routes: list[Route | None] = []
    # A member's boxes follow from this rank's layout and view (compared without process groups)
    # and the member's holding alone; a model's tensors come in few such kinds (a Llama's 80
    # decoder layers repeat the same ones), so each (kind, holding) is worked out once, not once
    # per tensor and member (at 1024 ranks that was most of the time of planning).
    kinds: dict[tuple[ParamLayout, tuple[int, ...]], int] = {}
    boxes: dict[tuple[int, HeldPiece], list[tuple[Box, int]] | None] = {}
    for i, layout in enumerate(layouts):
        view = tuple(views[i])
        kind = kinds.setdefault((layout, view), len(kinds))
        holdings = []
        for theirs in every:
            key = (kind, theirs[i])
            if key not in boxes:
                m = member_layout(layout, theirs[i])
                boxes[key] = None if m is None else m.local_boxes(view)
            holdings.append(boxes[key])
        routes.append(plan_route(blocks[i], owners[i], holdings, me))
    return routes


@dataclasses.dataclass(eq=False)
class RoutedTensors:
    """A routed task's tensors in one exchange: this rank's local ``inputs`` (each of the task's
    layout, any shape); after :func:`to_owners`, ``boxes[i]`` holds the inputs of each box ``i`` this
    rank owns, whole; the owner puts box i's result in ``results[i]``; after :func:`from_owners`,
    ``out`` is this rank's piece of the results (flat, ``out_dtype``, zero in ZeRO padding)."""

    task: Task
    inputs: Sequence[torch.Tensor]
    out_dtype: torch.dtype
    boxes: dict[int, list[torch.Tensor]] = dataclasses.field(default_factory=dict)
    results: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    out: torch.Tensor | None = None

    @property
    def work(self) -> WorkGroup:
        return self.task.work

    @property
    def sent(self) -> bool:
        """Whether the inputs travel: not for a tensor every rank holds whole (its owner's copy is
        the same as everyone's)."""
        return not self.task.layout.is_local


@dataclasses.dataclass
class InFlight:
    """:func:`to_owners` in flight: :meth:`wait` before reading :attr:`RoutedTensors.boxes`."""

    pending: list[Pending]

    def wait(self) -> None:
        for p in self.pending:
            p.wait()
        self.pending = []


def to_owners(
    moved: Sequence[RoutedTensors], dtype: torch.dtype | None, wait: bool = True, bucket_bytes: int | None = None
) -> InFlight:
    """Every rank's pieces of the inputs of ``moved`` to the owners of their boxes, who get them
    whole in :attr:`RoutedTensors.boxes`: one ``all_to_all`` per work group for all its tasks, in ``dtype``
    (None: the widest dtype of the group's inputs that travel). Collective over every work group
    among them; every rank of one lists the same tasks in the same order.

    With ``wait=False`` the all_to_alls are issued asynchronously (the inputs may change at once:
    they were copied) and the boxes are filled by the returned :class:`InFlight`'s ``wait()``: the
    next bucket's pieces travel while this one's owners compute (:func:`pipelined`).

    ``bucket_bytes``: the step-memory budget. A work group's tensors larger than it in full move in
    :func:`dist_optim.sharding.budget.exchange_rounds` rounds, at once (not overlapped: a bucket that size
    is not double-buffered)."""
    sending_all = InFlight([])
    for work, members in _by_work_group(moved):
        sending: list[tuple[Route, torch.Tensor, dict[int, torch.Tensor]]] = []
        for m in members:
            route = m.task.route
            assert route is not None, "to_owners: route_tasks found no route for this task"
            owned = {i: [] for i in route.owned}  # type: dict[int, list[torch.Tensor]]
            for t in m.inputs:
                if not m.sent:
                    whole = t.reshape(m.task.view)
                    for i in route.owned:
                        owned[i].append(whole[tuple(slice(lo, hi) for lo, hi in m.task.boxes[i])])
                    continue
                filled = {i: t.new_empty(m.task.box_shape(i)) for i in route.owned}
                sending.append((route, t.reshape(-1), filled))
                for i, box in filled.items():
                    owned[i].append(box)
            m.boxes = owned
        # Whether anything travels is the same on every rank of the work group: its members list
        # the same tasks, each held whole either on all of them or on none.
        if sending:
            wire = dtype or widest_dtype(local for _, local, _ in sending)
            full = sum(math.prod(m.task.view) * len(m.inputs) for m in members if m.sent) * wire.itemsize
            pending = _move(
                [(r.gather_send, local, r.gather_recv, owned) for r, local, owned in sending],
                work.group,
                wire,
                sending[0][1].device,
                wait,
                exchange_rounds(full, bucket_bytes),
            )
            if pending is not None:
                sending_all.pending.append(pending)
    return sending_all


def pipelined(buckets: Iterable[B], start: Callable[[B], S], finish: Callable[[S], None]) -> None:
    """Run ``buckets`` through the owners with the next bucket's exchange in flight while this one
    computes: ``start(b)`` issues bucket b's pieces to the owners (:func:`to_owners` with
    ``wait=False``) and returns its state; ``finish(s)`` waits for them, computes, sends the
    results back and applies them. Order on every rank: start(0), start(1), finish(0), start(2),
    finish(1), ...: the same collectives in the same order everywhere; at most two buckets'
    inputs are alive at once."""
    pending: list[S] = []
    for bucket in buckets:
        pending.append(start(bucket))
        if len(pending) == 2:
            finish(pending.pop(0))
    for state in pending:
        finish(state)


def from_owners(moved: Sequence[RoutedTensors], dtype: torch.dtype | None, bucket_bytes: int | None = None) -> None:
    """The way back of :func:`to_owners`: each owner's :attr:`RoutedTensors.results` to every rank that holds
    a piece of them, into a new :attr:`RoutedTensors.out`; one ``all_to_all`` per work group in ``dtype``
    (None: the widest of the group's ``out_dtype``), or :func:`dist_optim.sharding.budget.exchange_rounds`
    of them where the work group's tensors exceed ``bucket_bytes`` in full. A rank's pieces to
    itself go through ``dtype`` too, so every holder applies the same values. The owners' boxes
    and results are dropped."""
    for work, members in _by_work_group(moved):
        moves = []
        for m in members:
            route = m.task.route
            assert route is not None
            local = m.inputs[0]
            out = torch.empty(local.numel(), dtype=m.out_dtype, device=local.device)
            out[m.task.layout.valid_numel :].zero_()  # ZeRO padding at the end of a chunk
            results = {i: r.reshape(m.task.box_shape(i)) for i, r in m.results.items()}
            moves.append((route.scatter_send, results, route.scatter_recv, out))
            m.out = out
        wire = dtype or widest_dtype(m.out for m in members if m.out is not None)
        full = sum(math.prod(m.task.view) for m in members) * wire.itemsize
        _move(moves, work.group, wire, members[0].inputs[0].device, rounds=exchange_rounds(full, bucket_bytes))
        for m in members:
            m.boxes, m.results = {}, {}


def _move(
    moves: Sequence[tuple[Mapping[int, Sequence[Any]], Any, Mapping[int, Sequence[Any]], Any]],
    group: Any,
    dtype: torch.dtype,
    device: torch.device,
    wait: bool = True,
    rounds: int = 1,
) -> Pending | None:
    size = group_size(group)
    send: list[list[torch.Tensor]] = [[] for _ in range(size)]
    recv: list[list[torch.Tensor]] = [[] for _ in range(size)]
    if device.type == "meta":  # no values to move: the pieces' element counts are the exchange
        counts = ([0] * size, [0] * size)
        for out_pieces, _, in_pieces, _ in moves:
            for side, by_rank in enumerate((out_pieces, in_pieces)):
                for rank, pieces in by_rank.items():
                    counts[side][rank] += sum(pc.numel for pc in pieces)
        return exchange_counts(counts[0], counts[1], group, dtype, device, wait, rounds)
    for out_pieces, source, in_pieces, target in moves:
        for rank, pieces in out_pieces.items():
            send[rank] += [pc.view(source) for pc in pieces]
        for rank, pieces in in_pieces.items():
            recv[rank] += [pc.view(target) for pc in pieces]
    return exchange(send, recv, group, dtype, device, wait, rounds)


def share_results(results: Sequence[tuple[Owner, Sequence[torch.Tensor]]], dtype: torch.dtype | None = None) -> None:
    """Every rank of each item's work group gets the item's tensors from its owner, in place: one
    ``all_gather`` per work group for all its items (:func:`~dist_optim.comm.share_owned`), work
    groups in the one global order (:func:`~dist_optim.comm.ordered_groups`).

    ``results`` are ``(owner, tensors)``: on the owner the computed tensors, elsewhere tensors of
    the same shapes and dtypes to fill. Collective over every work group of more than one rank
    among them: every rank of a work group lists the same items in the same order. ``dtype`` is
    the communication precision (None: the widest dtype of each work group's tensors); results
    are written back in each tensor's own dtype, and an owner rounds its own tensors narrower
    than ``dtype`` the same way, so that every rank holds the same values."""
    shared = [(owner, tensors) for owner, tensors in results if owner.shared]
    for work, members in _by_work_group(shared, work_of=lambda entry: entry[0].work):
        tensors = [t for _, ts in members for t in ts]
        owners = [owner.rank for owner, ts in members for _ in ts]
        if dtype is not None:
            for t, owner in zip(tensors, owners):
                if owner == work.rank and t.dtype != dtype:
                    t.copy_(t.to(dtype))
        share_owned(tensors, owners, work.group, dtype=dtype)


def scatter_results(
    results: Sequence[tuple[Owner, Sequence[torch.Tensor], Sequence[torch.Tensor]]], dtype: torch.dtype | None = None
) -> None:
    """Every rank of each item's work group gets its partition of the item's tensors from their
    owner, in place: rank ``r`` of a work group of ``n`` ranks the flattened elements
    ``chunk_span(numel, n, r)`` (:func:`dist_optim.sharding.partition.partition_span` over the work group):
    one ``all_to_all`` per work group for all its items (:func:`~dist_optim.comm.exchange`), work
    groups in the one global order. Each rank receives its parts only, not every whole result
    (:func:`share_results`), and the owner sends each result once.

    ``results`` are ``(owner, tensors, parts)``: ``tensors`` the whole results, read on the owner only
    (elsewhere may be empty); ``parts`` this rank's 1-D partitions of them to fill, on every rank.
    Collective over every work group of more than one rank among them: every rank of a work group
    lists the same items in the same order. ``dtype`` is the communication precision (None: the
    widest dtype of each work group's parts; a rank's part of its own results goes through it too)."""
    shared = [entry for entry in results if entry[0].shared]
    for work, members in _by_work_group(shared, work_of=lambda entry: entry[0].work):
        send: list[list[torch.Tensor]] = [[] for _ in range(work.size)]
        recv: list[list[torch.Tensor]] = [[] for _ in range(work.size)]
        for owner, tensors, parts in members:
            if owner.rank == work.rank:
                for t in tensors:
                    flat = t.reshape(-1)
                    for r in range(work.size):
                        lo, hi = chunk_span(flat.numel(), work.size, r)
                        send[r].append(flat[lo:hi])
            recv[owner.rank] += list(parts)
        parts_all = [p for _, _, parts in members for p in parts]
        if not parts_all:
            continue
        comm_dtype = dtype or widest_dtype(parts_all)
        exchange(send, recv, work.group, comm_dtype, parts_all[0].device)
