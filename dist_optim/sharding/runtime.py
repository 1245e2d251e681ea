"""The owner runtime: one step's whole-tensor work, for every optimizer that has some.

Shampoo (blocks of a parameter), Muon (its matrices) and Kron (the whole parameter) each need, at
every step, a function of whole tensors that the ranks holding pieces of them cannot compute
alone. An optimizer declares that work once per step and parameter as an :class:`OwnedWork`: its
:class:`~dist_optim.sharding.owners.Task` (boxes of the tensor and their owners, planned once by
:meth:`OwnerRuntime.plan`), its local inputs and the dtype of its result. :meth:`OwnerRuntime.run`
does the rest, the same way for all of them:

* **how each tensor reaches its owners**: a work group of one rank (unbound, or nobody else holds
  the tensor) computes on its own whole inputs (*here*); pieces travel straight to the owners of
  their boxes and the results' pieces back (*routed*: :func:`dist_optim.sharding.owners.to_owners` /
  :func:`~dist_optim.sharding.owners.from_owners`); where no route exists, the full inputs are gathered
  and the owners' results shared whole (*gathered*: :func:`dist_optim.comm.gather_full`,
  :func:`~dist_optim.sharding.owners.share_results`);
* **buckets** of consecutive parameters within one step-memory budget
  (:func:`dist_optim.sharding.budget.buckets`), the next bucket's pieces in flight while this one computes
  (:func:`dist_optim.sharding.owners.pipelined`);
* **hand-back**: each holder gets its result (:meth:`OwnedWork.local`): its flat piece (routed) or
  the whole result (here, gathered), for the optimizer to apply; or, with ``partitions=True``,
  each rank of the work group its partition of the owner's outputs (GaLore's projectors, kept
  1/n per rank: :func:`dist_optim.sharding.owners.scatter_results`).

The optimizer supplies three functions, all on local tensors: ``prepare`` (a bucket's inputs),
``compute`` (the owned boxes' results from their whole inputs, :attr:`OwnedWork.owned`) and
``deliver`` (apply the results). Every collective is issued here, through :mod:`dist_optim.sharding.owners`
and :mod:`dist_optim.comm`, in the same order on every rank.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import torch

from ..comm import gather_full
from ..comm.dtypes import widest_dtype
from ..layout import Box, ParamLayout
from .budget import buckets
from .owners import (
    InFlight,
    Owner,
    RoutedTensors,
    Task,
    WorkGroup,
    WorkGroups,
    from_owners,
    pipelined,
    plan_tasks,
    route_tasks,
    scatter_results,
    share_results,
    to_owners,
)

__all__ = ["OwnedWork", "OwnerRuntime", "Transport"]

E = TypeVar("E")  # the optimizer's record of a work
T = TypeVar("T")  # what it lists per parameter before a bucket is prepared


class Transport(enum.Enum):
    """How an :class:`OwnedWork`'s inputs reach its owners and its results come back (module docstring)."""

    HERE = "here"  # a work group of one rank: computed here on the whole local inputs
    ROUTED = "routed"  # pieces to the owners of their boxes, the results' pieces back
    GATHERED = "gathered"  # the inputs gathered whole, the owners' results shared whole


@dataclasses.dataclass(eq=False)
class OwnedWork(Generic[E]):
    """One parameter's whole-tensor work at one step.

    Declared by the optimizer: ``entry`` (its own record: param group, parameter, state, ...),
    ``task`` (from :meth:`OwnerRuntime.plan`), ``inputs`` (local tensors of the task's layout, any
    shape) and ``out_dtype`` (the result's dtype).

    Filled by the runtime: :attr:`transport`; before ``compute``, :attr:`owned` (box index -> the box's
    whole inputs, for the boxes this rank computes); ``compute`` puts box ``i``'s result in
    ``results[i]`` (in the box's shape), or, for work this rank does alone, may set
    :attr:`whole` to the whole result at once, or leave both empty where it applied the result
    itself; after the exchange, :meth:`local` is this rank's part of the result.

    With ``partitions=True`` (:meth:`OwnerRuntime.run`), one box per task: ``compute`` sets the
    owner's whole :attr:`outputs` and, on every rank of a work group of more than one, the
    :attr:`parts` to fill, this rank's partitions of them."""

    entry: E
    task: Task
    inputs: Sequence[torch.Tensor]
    out_dtype: torch.dtype
    transport: Transport = Transport.HERE
    owned: dict[int, list[torch.Tensor]] = dataclasses.field(default_factory=dict)
    results: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    whole: torch.Tensor | None = None
    moved: RoutedTensors | None = None
    boxes: list[torch.Tensor] = dataclasses.field(default_factory=list)
    piece: torch.Tensor | None = None
    outputs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    parts: list[torch.Tensor] = dataclasses.field(default_factory=list)

    @property
    def layout(self) -> ParamLayout:
        return self.task.layout

    @property
    def copies(self) -> bool:
        """Whether the owned inputs are the runtime's copies (assembled pieces, gathered tensors)
        that ``compute`` may overwrite, not views of the optimizer's own tensors."""
        if self.transport == Transport.ROUTED:
            return self.moved is not None and self.moved.sent
        return self.transport == Transport.GATHERED and not self.layout.is_local

    @property
    def delivered(self) -> bool:
        """Whether there is a result to hand back (not: work done alone and applied by ``compute``)."""
        return self.piece is not None or self.whole is not None or bool(self.boxes)

    def box_shape(self, index: int) -> tuple[int, ...]:
        return self.task.box_shape(index)

    def box_slices(self, index: int) -> tuple[slice, ...]:
        return tuple(slice(lo, hi) for lo, hi in self.task.boxes[index])

    def full(self) -> torch.Tensor:
        """The whole result in the task's view shape (alone or gathered work): the one box itself,
        else the boxes joined."""
        if self.whole is not None:
            return self.whole.reshape(self.task.view)
        if len(self.boxes) == 1:
            return self.boxes[0].reshape(self.task.view)
        out = self.boxes[0].new_empty(self.task.view)
        for i, box in enumerate(self.boxes):
            out[self.box_slices(i)] = box
        return out

    def local(self) -> torch.Tensor:
        """This rank's part of the result, flat in the layout's local order (routed: the piece
        that came back; otherwise the local part of the whole result), or the whole result
        in the layout's full shape where the layout is whole."""
        if self.piece is not None:
            return self.piece
        full = self.full().reshape(self.layout.full_shape)
        return full if self.layout.is_local else self.layout.take_local(full, copy=False)


@dataclasses.dataclass(eq=False)
class _Bucket(Generic[E]):
    works: list[OwnedWork[E]]
    sending: InFlight


class OwnerRuntime:
    """The owners of one optimizer's whole-tensor work and the choreography of its steps.

    Lifecycle: :meth:`bind` (with the optimizer: the work groups, collective over the job under
    TP), :meth:`plan` (tasks from full shapes, pure; again after a change of the param groups),
    :meth:`run` once per step. Routes are planned lazily by the first :meth:`run` after a
    :meth:`plan` (one ``all_gather_object`` per work group)."""

    #: Route pieces to their owners (False: gather every tensor whole and share the results whole:
    #: the same result bit for bit, kept for the tests and ``bench/bench_step.py --dist`` rows that
    #: compare the two).
    route_pieces: bool = True

    def __init__(self) -> None:
        self.groups = WorkGroups()
        self.tasks: dict[torch.Tensor, Task] = {}
        self._bound = False
        self._routed = False

    # ---- planning ------------------------------------------------------------------------------
    def bind(self, layouts: Sequence[ParamLayout], dp_group: Any, tp_group: Any) -> None:
        """The work groups of the parameters of ``layouts`` (:meth:`~dist_optim.sharding.owners.WorkGroups.bind`);
        forgets the tasks. Collective over the job under TP."""
        self.groups.bind(layouts, dp_group, tp_group)
        self._bound = True
        self.forget()

    def work_of(self, layout: ParamLayout) -> WorkGroup:
        return self.groups.of(layout)

    def slice_work_of(self, layout: ParamLayout) -> WorkGroup:
        """The work group of this rank's TP slice of a tensor of ``layout`` planned as a tensor of
        its own (:meth:`~dist_optim.sharding.owners.WorkGroups.of_slice`)."""
        return self.groups.of_slice(layout)

    def plan(
        self,
        params: Sequence[torch.Tensor],
        specs: Sequence[tuple[ParamLayout, tuple[int, ...], Sequence[Box], Sequence[float]]],
        works: Sequence[WorkGroup | None] | None = None,
    ) -> list[Task]:
        """The task of each parameter, from ``(layout, view, boxes of the view, cost of each box)``:
        all the boxes of a work group balanced by cost over its ranks (:func:`~dist_optim.sharding.owners.plan_tasks`).
        ``works`` gives a parameter's work group where it is not its layout's (None: the layout's).
        Pure: every rank gets the same owners from the same full shapes."""
        given = list(works) if works is not None else [None] * len(specs)
        items = [
            (work or self.work_of(layout), layout, tuple(view), boxes, costs)
            for (layout, view, boxes, costs), work in zip(specs, given)
        ]
        tasks = plan_tasks(items)
        self.tasks = dict(zip(params, tasks))
        self._routed = False
        return tasks

    def forget(self) -> None:
        """Drop the tasks (the param groups or the binding changed)."""
        self.tasks = {}
        self._routed = False

    def owner(self, param: torch.Tensor, index: int = 0) -> Owner | None:
        task = self.tasks.get(param)
        return None if task is None else task.owner(index)

    def _route(self) -> None:
        if self._routed or not self._bound:
            return
        if self.route_pieces:
            route_tasks([t for t in self.tasks.values() if t.work.size > 1])
        self._routed = True

    # ---- a step ----------------------------------------------------------------------------------
    def run(
        self,
        entries: Sequence[T],
        sizes: Sequence[int],
        prepare: Callable[[Sequence[T]], list[OwnedWork[E]]],
        compute: Callable[[list[OwnedWork[E]]], None],
        deliver: Callable[[list[OwnedWork[E]]], None],
        *,
        comm_dtype: torch.dtype | None,
        budget: int | None,
        in_order: bool = False,
        partitions: bool = False,
    ) -> None:
        """One step's work of ``entries`` (one per parameter with work, ``sizes`` its bytes of full
        inputs), in buckets of at most ``budget`` bytes when bound: ``prepare`` a bucket's
        :class:`OwnedWork` (in flight to the owners while the previous bucket computes),
        ``compute`` the owned boxes, the results back, ``deliver`` (every work of the bucket; those
        done alone and applied by ``compute`` are not :attr:`~OwnedWork.delivered`). Collective over every work
        group among them: every rank lists the same entries in the same order.

        ``comm_dtype``: the precision of every exchange (None: the widest of the tensors that
        travel). ``compute`` is called with every work of the bucket, owned boxes or not: first
        the ones that do not wait for an exchange, then, once their pieces arrived, the routed
        ones; ``in_order=True`` waits first and calls it once with the bucket in order (Kron:
        its probes are drawn in parameter order on every rank). ``partitions``: hand back
        partitions of the owners' outputs (:class:`OwnedWork`), not each holder's part."""
        if not entries:
            return
        self._route()
        ranges = buckets(sizes, budget if self._bound else None)
        pipelined(
            ranges,
            lambda r: self._start(prepare(entries[r[0] : r[1]]), comm_dtype, budget),
            lambda b: self._finish(b, compute, deliver, comm_dtype, budget, in_order, partitions),
        )

    def _start(self, works: list[OwnedWork[E]], comm_dtype: torch.dtype | None, budget: int | None) -> _Bucket[E]:
        """Sort the works by how they reach their owners; gather the full inputs of the gathered ones
        (blocking), send the routed ones' pieces (in flight)."""
        gathered: list[OwnedWork[E]] = []
        moved: list[RoutedTensors] = []
        for w in works:
            if w.task.work.size == 1:
                w.transport = Transport.HERE
            elif w.task.route is not None:
                w.transport = Transport.ROUTED
                w.moved = RoutedTensors(w.task, w.inputs, w.out_dtype)
                moved.append(w.moved)
            else:
                w.transport = Transport.GATHERED
                if not w.layout.is_local:
                    gathered.append(w)
        if gathered:
            tensors = [(w.layout, t) for w in gathered for t in w.inputs]
            fulls = iter(gather_full(tensors, dtype=comm_dtype or widest_dtype(t for _, t in tensors)))
            for w in gathered:
                w.inputs = [next(fulls) for _ in w.inputs]
        sending = InFlight([])
        if moved:
            sending = to_owners(moved, comm_dtype, False, budget)
        return _Bucket(works, sending)

    def _finish(
        self,
        bucket: _Bucket[E],
        compute: Callable[[list[OwnedWork[E]]], None],
        deliver: Callable[[list[OwnedWork[E]]], None],
        comm_dtype: torch.dtype | None,
        budget: int | None,
        in_order: bool,
        partitions: bool,
    ) -> None:
        works = bucket.works
        routed = [w for w in works if w.transport == Transport.ROUTED]
        for w in works:
            if w.transport != Transport.ROUTED:
                w.owned = _whole_boxes(w)
        if in_order:
            bucket.sending.wait()
            _arrived(routed)
            compute(works)
        else:
            compute([w for w in works if w.transport != Transport.ROUTED])
            bucket.sending.wait()
            _arrived(routed)
            compute(routed)
        if partitions:
            _scatter_outputs(works, comm_dtype)
        else:
            _share_boxes(works, comm_dtype)
            _pieces_back(routed, comm_dtype, budget)
        deliver(works)


def _scatter_outputs(works: Sequence[OwnedWork[Any]], comm_dtype: torch.dtype | None) -> None:
    """Each rank's partitions of the owners' outputs (:func:`~dist_optim.sharding.owners.scatter_results`),
    the owners' whole inputs dropped before the outputs travel."""
    for w in works:
        w.owned, w.inputs = {}, []
        if w.moved is not None:
            w.moved.boxes, w.moved = {}, None
    scatter_results([(w.task.owner(0), w.outputs, w.parts) for w in works if w.transport != Transport.HERE], comm_dtype)


def _share_boxes(works: Sequence[OwnedWork[Any]], comm_dtype: torch.dtype | None) -> None:
    """The whole results of work not routed: every box of gathered work from its owner to every
    rank of the work group (:func:`~dist_optim.sharding.owners.share_results`); alone, this rank's own."""
    shares: list[tuple[Owner, list[torch.Tensor]]] = []
    for w in works:
        w.owned = {}
        if w.transport == Transport.GATHERED:
            w.boxes = []
            for i in range(len(w.task.boxes)):
                box = w.results.get(i)
                if box is None:  # another rank's box, filled by share_results
                    box = torch.empty(w.box_shape(i), dtype=w.out_dtype, device=w.inputs[0].device)
                w.boxes.append(box)
                shares.append((w.task.owner(i), [box]))
            w.results = {}
        elif w.transport == Transport.HERE and w.whole is None and w.results:
            w.boxes, w.results = [w.results[i] for i in range(len(w.task.boxes))], {}
    share_results(shares, comm_dtype)


def _pieces_back(routed: Sequence[OwnedWork[Any]], comm_dtype: torch.dtype | None, budget: int | None) -> None:
    """The routed results' pieces from their owners to every holder
    (:func:`~dist_optim.sharding.owners.from_owners`)."""
    moved = []
    for w in routed:
        assert w.moved is not None
        w.moved.results, w.results = w.results, {}
        moved.append(w.moved)
    if moved:
        from_owners(moved, comm_dtype, budget)
    for w in routed:
        assert w.moved is not None
        w.piece, w.moved = w.moved.out, None


def _whole_boxes(w: OwnedWork[Any]) -> dict[int, list[torch.Tensor]]:
    """The owned boxes' inputs of work held whole here (alone, or gathered): views of the inputs."""
    mine = range(len(w.task.boxes)) if w.transport == Transport.HERE else w.task.owned
    views = [t.reshape(w.task.view) for t in w.inputs]
    return {i: [v[w.box_slices(i)] for v in views] for i in mine}


def _arrived(routed: Sequence[OwnedWork[Any]]) -> None:
    """The routed works' owned boxes, assembled by :func:`~dist_optim.sharding.owners.to_owners`."""
    for w in routed:
        assert w.moved is not None
        w.owned = w.moved.boxes
