"""Measuring what an optimizer step sends and allocates, on a real job or on a simulated one.

The planner measures its simulated steps (meta tensors, a fake process group) with two instruments.
tests/distributed/test_plan.py measures real gloo runs with the tests' own (tests/helpers/collectives.py,
tests/helpers/allocated.py), written without this module, so that a miscount here cannot recur on the
measured side and hide (they define the conventions below for themselves).

* :class:`Traffic` stands in for ``torch.distributed`` inside :mod:`dist_optim.comm` (the only
  module of the package that communicates, see docs/design.md "Communication") for the duration of
  a ``with`` block. It counts every collective and the bytes this rank sends in it. ``measure``
  mode passes each call on to torch.distributed (a real run); ``simulate`` mode does not: the
  tensors are meta tensors, nothing moves, and ``all_gather_object`` answers with what every peer
  would have sent (:class:`Peers`).
* :class:`LiveBytes` is a ``TorchDispatchMode`` that follows every tensor storage allocated inside
  its block until it is freed: the peak of the bytes alive is the step's transient peak. On meta
  tensors it also answers ``.item()``: scalars computed only from other scalars (step counters)
  are computed exactly on CPU beside the meta tensor; a value that depends on tensor contents
  cannot be known, and is answered 0 (a number: no NaN/Inf seen) or True (a condition: an
  iteration goes on to its limit), which the planner's output names. A small meta tensor copied to
  the CPU (``tolist()``) is answered from its shadow the same way.

Bytes sent per rank follow NCCL's bus-bandwidth convention (ring algorithms), so figures compare
with ``nccl-tests``: all-reduce ``2 (g-1)/g`` of the buffer, all-gather ``(g-1)/g`` of the output,
broadcast the buffer, all-to-all exactly the pieces sent to other ranks.
"""

from __future__ import annotations

import collections
import functools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from .meta_kernels import meta_call

__all__ = ["Traffic", "StepTraffic", "LiveBytes", "traffic_of", "Peers", "c10d_bytes", "flat_values"]

#: Answers ``all_gather_object`` in a simulation: (this rank's object, the group) -> every member's.
Peers = Callable[[Any, Any], list[Any]]


@dataclass
class StepTraffic:
    """Collectives issued and bytes sent by this rank, by collective name."""

    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    sent: dict[str, Fraction] = field(default_factory=lambda: collections.defaultdict(Fraction))
    #: Bytes dist_optim.comm.rules would copy between host and device if this rank's tensors lived
    #: in host memory (ZeRO's CPU offload): each collective's inputs in, outputs back.
    staged: int = 0
    #: The largest device buffers one collective then needs (input and output together).
    staged_peak: int = 0

    @property
    def collectives(self) -> int:
        return sum(self.counts.values())

    @property
    def bytes_sent(self) -> Fraction:
        return sum(self.sent.values(), Fraction(0))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Traffic:
    """A stand-in for the ``torch.distributed`` module that counts collectives and bytes.

    Everything it does not override (group sizes, ranks, ``new_group``) goes to torch.distributed:
    the groups of a simulation are real ``fake``-backend groups."""

    def __init__(self, simulate: bool = False, peers: Peers | None = None) -> None:
        self.simulate = simulate
        self.peers = peers
        self.step = StepTraffic()

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def _size(self, group: Any) -> int:
        return dist.get_world_size(group)

    def _record(self, name: str, sent: Fraction, staged_in: int = 0, staged_out: int = 0) -> None:
        """One collective: ``sent`` bytes to other ranks; ``staged_in``/``staged_out`` the bytes of
        its input and output buffers (one buffer in place: both), what staging copies each way."""
        self.step.counts[name] += 1
        self.step.sent[name] += sent
        self.step.staged += staged_in + staged_out
        self.step.staged_peak = max(self.step.staged_peak, staged_in + staged_out)

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, **kw: Any) -> Any:
        g = self._size(group)
        self._record("all_reduce", Fraction(2 * (g - 1) * _nbytes(tensor), g), _nbytes(tensor), _nbytes(tensor))
        return None if self.simulate else dist.all_reduce(tensor, op=op, group=group, **kw)

    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor, group: Any = None, **kw: Any) -> Any:
        g = self._size(group)
        self._record("all_gather", Fraction((g - 1) * _nbytes(out), g), _nbytes(inp), _nbytes(out))
        return None if self.simulate else dist.all_gather_into_tensor(out, inp, group=group, **kw)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None, **kw: Any) -> Any:
        self._record("broadcast", Fraction(_nbytes(tensor)), _nbytes(tensor), _nbytes(tensor))
        return None if self.simulate else dist.broadcast(tensor, src=src, group=group, **kw)

    def all_to_all_single(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
        group: Any = None,
        **kw: Any,
    ) -> Any:
        g = self._size(group)
        me = dist.get_rank(group)
        splits = input_split_sizes or [inp.numel() // g] * g
        sent = Fraction(sum(n for r, n in enumerate(splits) if r != me) * inp.element_size())
        self._record("all_to_all", sent, _nbytes(inp), _nbytes(out))
        if self.simulate:
            return None
        return dist.all_to_all_single(out, inp, output_split_sizes, input_split_sizes, group=group, **kw)

    def all_gather_object(self, out: list[Any], obj: Any, group: Any = None) -> None:
        # Planning metadata (which pieces a rank holds), exchanged when an optimizer (re)plans, not
        # per step: counted as a collective, its pickled bytes are not step traffic.
        self._record("all_gather_object", Fraction(0))
        if not self.simulate:
            dist.all_gather_object(out, obj, group=group)
            return
        if self.peers is None:
            raise RuntimeError("Traffic(simulate=True) needs peers= to answer all_gather_object")
        out[:] = self.peers(obj, group)

    def barrier(self, group: Any = None, **kw: Any) -> Any:
        self._record("barrier", Fraction(0))
        return None if self.simulate else dist.barrier(group=group, **kw)


def _tensors_bytes(x: Any) -> int:
    return sum(_nbytes(t) for t in tensors_in(x))


#: ``c10d`` operator -> (collective kind, index of the tensor argument measured, share of it sent
#: per rank as a function of the group size g), in the bus-bandwidth convention of :class:`Traffic`.
C10D_KINDS: dict[str, tuple[str, int, Callable[[int], Fraction]]] = {
    "allreduce_": ("all_reduce", 0, lambda g: Fraction(2 * (g - 1), g)),
    "allreduce_coalesced_": ("all_reduce", 0, lambda g: Fraction(2 * (g - 1), g)),
    "allgather_": ("all_gather", 0, lambda g: Fraction(g - 1, g)),
    "_allgather_base_": ("all_gather", 0, lambda g: Fraction(g - 1, g)),
    "allgather_into_tensor_coalesced_": ("all_gather", 0, lambda g: Fraction(g - 1, g)),
    "reduce_scatter_": ("reduce_scatter", 1, lambda g: Fraction(g - 1, g)),
    "_reduce_scatter_base_": ("reduce_scatter", 1, lambda g: Fraction(g - 1, g)),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, lambda g: Fraction(g - 1, g)),
    "alltoall_": ("all_to_all", 1, lambda g: Fraction(g - 1, g)),
    "alltoall_base_": ("all_to_all", 1, lambda g: Fraction(g - 1, g)),
    "broadcast_": ("broadcast", 0, lambda g: Fraction(1)),
}


def c10d_bytes(name: str, args: tuple[Any, ...], g: int) -> tuple[str, Fraction]:
    """The kind of a ``c10d`` operator call on a group of ``g`` ranks and the bytes this rank sends
    in it (all-to-all: the even split; a one-rank group sends nothing)."""
    kind, index, share = C10D_KINDS.get(name, (name.strip("_"), 0, lambda g: Fraction(1)))
    return kind, (share(g) * _tensors_bytes(args[index]) if g > 1 else Fraction(0))


@contextmanager
def traffic_of(traffic: Traffic) -> Iterator[Traffic]:
    """Route :mod:`dist_optim.comm`'s collectives through ``traffic`` inside the block."""
    from dist_optim import comm

    with comm.collectives_through(traffic):
        yield traffic


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages allocated inside the block that are still alive, and their peak.

    A storage counts from the op that creates it until the last tensor on it made inside the block
    dies; storages that existed before (parameters, gradients, earlier state) are not counted. With
    ``answer_meta_items`` the ``.item()`` of a meta tensor is answered from its CPU shadow where
    it has one (a scalar computed from scalars), else 0 or True (:attr:`meta_items` counts those
    guesses)."""

    #: Meta tensors of at most this many elements get a CPU shadow when all their inputs have one.
    SHADOW_NUMEL = 16

    def __init__(self, answer_meta_items: bool = False, shadows: dict[int, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.answer_meta_items = answer_meta_items
        self.live = 0
        self.peak = 0
        #: The largest single storage allocated inside the block.
        self.largest = 0
        self.meta_items = 0
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, int] = collections.Counter()
        # ids of the tensors already followed (a set of ids, not a WeakSet: WeakSet membership
        # compares tensors with ==, which is element-wise)
        self._seen: set[int] = set()
        # CPU shadows by id of their meta tensor; pass the same dict to the LiveBytes of every
        # step so that state scalars (step counters) keep theirs across steps
        self._shadows = {} if shadows is None else shadows

    def reset_peak(self) -> None:
        self.peak = self.live

    def has_shadow(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s values are followed in a CPU shadow (a small meta tensor of scalars)."""
        return id(t) in self._shadows

    def shadow_values(self, t: torch.Tensor) -> tuple[torch.dtype, tuple[Any, ...]] | None:
        """The dtype and flat values of ``t``'s CPU shadow, or None: read without a copy or a
        dispatched operator (``tolist`` dispatches none), as a replay's description reads them."""
        shadow = self._shadows.get(id(t))
        return None if shadow is None else (shadow.dtype, flat_values(shadow))

    def shadow_of(self, t: torch.Tensor) -> torch.Tensor | None:
        """A copy of the CPU shadow of ``t``'s values (not counted: shadows are the recorder's), or None."""
        shadow = self._shadows.get(id(t))
        if shadow is None:
            return None
        with _disable_current_modes():
            return shadow.clone()

    def set_shadow(self, t: torch.Tensor, value: torch.Tensor) -> None:
        """Follow ``t``'s values as a copy of ``value`` (a CPU tensor of its shape) while ``t`` lives."""
        with _disable_current_modes():
            self._shadows[id(t)] = value.clone()
        weakref.finalize(t, self._shadows.pop, id(t), None)

    def drop_shadow(self, t: torch.Tensor) -> None:
        """Stop following ``t``'s values (they were written with values not followed)."""
        self._shadows.pop(id(t), None)

    def storages(self) -> frozenset[int]:
        """The storages allocated inside the block and alive, by their ``_cdata``."""
        return frozenset(self._sizes)

    def _release(self, key: int, tid: int) -> None:
        self._seen.discard(tid)
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live -= self._sizes.pop(key)

    def _track(self, t: torch.Tensor, existing: set[int]) -> None:
        if id(t) in self._seen:
            return
        storage = t.untyped_storage()
        key = storage._cdata
        if key in existing and key not in self._sizes:
            return  # a view of, or an in-place result on, a storage from before the block
        if key not in self._sizes:
            self._sizes[key] = storage.nbytes()
            self.largest = max(self.largest, self._sizes[key])
            self.live += self._sizes[key]
            self.peak = max(self.peak, self.live)
        self._refs[key] += 1
        self._seen.add(id(t))
        weakref.finalize(t, self._release, key, id(t))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.answer_meta_items and func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            shadow = self._shadows.get(id(args[0]))
            if shadow is not None:
                return shadow.item()
            self.meta_items += 1
            return True if args[0].dtype == torch.bool else 0
        if self.answer_meta_items and func is torch.ops.aten._to_copy.default and _meta_to_cpu(args, kwargs):
            # ``tolist()`` of a small meta tensor (ColossalAI's expert split sizes): its CPU shadow
            shadow = self._shadows.get(id(args[0]))
            if shadow is not None:
                return shadow.to(kwargs.get("dtype") or shadow.dtype, copy=True)
        inputs = tensors_in(args)
        if kwargs:
            inputs += tensors_in(kwargs)
        out = meta_call(func, args, kwargs, inputs)
        results = tensors_in(out)
        if self.answer_meta_items:
            self._shadow(func, args, kwargs, inputs, results)
        made = [t for t in results if not _is_sparse(t)]
        if made:
            existing = {a.untyped_storage()._cdata for a in inputs if not _is_sparse(a)}
            for t in made:
                self._track(t, existing)
        return out

    def _shadow(
        self, func: Any, args: Any, kwargs: Any, inputs: list[torch.Tensor], results: list[torch.Tensor]
    ) -> None:
        """Compute ``func`` on the CPU shadows of its inputs when every meta input is a small tensor
        with a shadow, and keep the results as the shadows of its small meta outputs (``inputs``,
        ``results``: the tensors among its arguments and its outputs, :func:`tensors_in`)."""
        if func.overloadpacket.__name__ in UNDEFINED_VALUES:
            return  # uninitialised memory: no value to shadow (a CPU one would hold whatever it held)
        outs = [t for t in results if t.is_meta]
        outs += _written(func, args, kwargs)  # what an in-place op without outputs writes to
        if not outs:
            return
        shadows = self._shadows
        if any(t.numel() > self.SHADOW_NUMEL for t in outs) or any(t.is_meta and id(t) not in shadows for t in inputs):
            # written with values not followed, or an operator on a shadowed scalar with unknown
            # inputs: forget them (checked before mapping the arguments: most operators stop here)
            for t in outs:
                shadows.pop(id(t), None)
            return

        def to_cpu(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_meta:
                return shadows[id(x)]
            if isinstance(x, torch.device) and x.type == "meta":
                return torch.device("cpu")
            return x

        cpu_args, cpu_kwargs = torch.utils._pytree.tree_map(to_cpu, (args, kwargs))
        result = func(*cpu_args, **cpu_kwargs)
        cpu_results = tensors_in(result)
        if result is None or len(results) != len(cpu_results):
            return  # an in-place op without outputs: the shadows were updated in place
        for t, c in zip(results, cpu_results):
            if t.is_meta and id(t) not in self._shadows:
                self._shadows[id(t)] = c
                weakref.finalize(t, self._shadows.pop, id(t), None)


#: Operators whose outputs hold no defined values.
UNDEFINED_VALUES = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


@functools.cache
def _written_arguments(func: Any) -> tuple[tuple[int, str], ...]:
    return tuple(
        (i, arg.name)
        for i, arg in enumerate(func._schema.arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
    )


def _written(func: Any, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The meta tensors among the arguments ``func``'s schema marks as written to (``Tensor(a!)``):
    a ``torch._foreach_copy_`` of unshadowed tensors into shadowed ones must drop their shadows."""
    written: list[torch.Tensor] = []
    for i, name in _written_arguments(func):
        value = args[i] if i < len(args) else kwargs.get(name)
        written += [t for t in tensors_in(value) if t.is_meta]
    return written


def flat_values(t: torch.Tensor) -> tuple[Any, ...]:
    """The values of a small host tensor, flat, as a tuple, without a dispatched operator."""
    values = t.tolist()
    if not isinstance(values, list):
        return (values,)
    while values and isinstance(values[0], list):
        values = [v for row in values for v in row]
    return tuple(values)


def tensors_in(x: Any) -> list[torch.Tensor]:
    """The tensors in an operator's arguments or results (nested lists, tuples and dicts), in
    ``torch.utils._pytree.tree_leaves`` order: the same leaves for the containers operators take
    and return, without pytree's generic walk: every dispatched operator walks its arguments and
    results, so this walk is on the planner's hottest path (a profile of a plan shows it:
    ``python -m cProfile -s tottime -m dist_optim.plan --model llama-70b --tp 8 --dp 8 --zero 1``)."""
    if isinstance(x, torch.Tensor):
        return [x]
    found: list[torch.Tensor] = []
    stack = [x]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
    return found


def _meta_to_cpu(args: Any, kwargs: Any) -> bool:
    device = kwargs.get("device")
    return bool(args[0].is_meta) and device is not None and torch.device(device).type == "cpu"


def _is_sparse(t: torch.Tensor) -> bool:
    return t.layout != torch.strided
