"""Replaying the pure functions of a simulated step (:mod:`dist_optim.kernels.replay`) instead of running
them again.

A simulated step runs the optimizer's own code on meta tensors under :class:`~.traffic.LiveBytes`.
The first call of a :func:`~dist_optim.kernels.replay.replayable` function with given argument metadata
runs and is recorded: the peak of bytes alive it added above its start, the bytes it left alive
besides its outputs, how many unknowable values it guessed, and its outputs (shape, strides,
dtype, storage size, or which argument's storage they are a view of). A later call with the same
metadata does not run: the recorder's peak and counters move as the call would have moved them and
fresh meta outputs (or views of the same arguments) are returned. The measured figures are the
same, and the planner no longer dispatches the same few thousand operators once per decoder layer.

What cannot be replayed runs as it is: arguments that are not tensors, numbers, strings, dtypes,
devices or tuples/lists of them (or frozen dataclasses of numbers), small tensors whose values the
recorder follows (CPU shadows of scalars), outputs in containers other than a tuple or list, a
call that issued a collective or allocated memory it kept without returning it. An output whose
values the recorder followed (a scalar made from constants: no argument has one) gets the same
values at a replay.

In-place work (:func:`~dist_optim.kernels.replay.replayable_work`, :meth:`Replays.work`: Shampoo's
owner batches) is described by its caller; a batch whose description, and the values the recorder
follows for its tensors, were seen before moves the peak, the guesses and those values as the
recorded batch did, without running. It is recorded only where it kept no memory, replaced no
storage nor described tensor, wrote no host tensor and issued no collective; else it runs each time.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from typing import Any

import torch

from .traffic import LiveBytes, Traffic, flat_values

__all__ = ["Replays"]

_ATOMS = (int, float, bool, str, type(None), torch.dtype, torch.device)


@dataclasses.dataclass(frozen=True)
class _Output:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    storage_numel: int  # elements of the storage, in ``dtype`` (new outputs)
    alias: int | None  # index of the tensor argument whose storage it views, else None (new)
    shadow: torch.Tensor | None  # its values where the recorder follows them (made from constants)


@dataclasses.dataclass(frozen=True)
class _WorkEffect:
    transient: int  # the peak bytes alive above the work's start
    guesses: int  # unknowable values answered (LiveBytes.meta_items)
    shadows: tuple[tuple[int, torch.Tensor | None], ...]  # described tensor -> its followed values after (None: none)


@dataclasses.dataclass(frozen=True)
class _Effect:
    transient: int  # the peak bytes alive above the call's start
    guesses: int  # unknowable values answered (LiveBytes.meta_items)
    outputs: tuple[_Output, ...]
    container: type | None  # tuple, list or NoneType (no output: in place), None: a single tensor


class Replays:
    """The replayer of one simulated run: records the effects of each replayable call by its
    argument metadata and replays them (``hits`` counts the calls replayed)."""

    def __init__(self, traffic: Traffic | None = None) -> None:
        #: The recorder of the step being simulated (set before each step; None: nothing replayed).
        self.live: LiveBytes | None = None
        self._traffic = traffic
        self._effects: dict[Any, _Effect | None] = {}
        self.hits = 0
        self._works: dict[Any, _WorkEffect] = {}
        #: In-place works replayed (:meth:`work`), and those run and recorded.
        self.work_hits = 0
        self.work_recorded = 0

    def __call__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        live = self.live
        tensors: list[torch.Tensor] = []
        key = _key((fn, args, tuple(sorted(kwargs.items()))), tensors)
        if live is None or key is None or any(not t.is_meta or live.has_shadow(t) for t in tensors):
            return fn(*args, **kwargs)
        effect = self._effects.get(key, _MISSING)
        if effect is _MISSING:
            out, effect = self._record(live, fn, args, kwargs, tensors)
            self._effects[key] = effect
            return out
        if effect is None:
            return fn(*args, **kwargs)
        assert isinstance(effect, _Effect)
        self.hits += 1
        return self._replay(live, effect, tensors)

    def _record(
        self,
        live: LiveBytes,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        tensors: list[torch.Tensor],
    ) -> tuple[Any, _Effect | None]:
        calls = self._traffic.step.collectives if self._traffic is not None else 0
        start, peak, guesses = live.live, live.peak, live.meta_items
        live.peak = start
        try:
            out = fn(*args, **kwargs)
        finally:
            transient = live.peak - start
            live.peak = max(peak, live.peak)
        if self._traffic is not None and self._traffic.step.collectives != calls:
            return out, None
        results = list(out) if isinstance(out, (tuple, list)) else [] if out is None else [out]
        if not all(isinstance(t, torch.Tensor) and t.is_meta for t in results):
            return out, None
        storages = [t.untyped_storage()._cdata for t in tensors]
        outputs = []
        new_bytes = 0
        seen: set[int] = set()
        for t in results:
            key = t.untyped_storage()._cdata
            alias = storages.index(key) if key in storages else None
            numel = t.untyped_storage().nbytes() // t.element_size()
            shadow = live.shadow_of(t)
            if alias is None:
                if key in seen:
                    return out, None  # two outputs on one new storage
                seen.add(key)
                new_bytes += t.untyped_storage().nbytes()
            elif shadow is not None:
                return out, None  # a followed value written into an argument
            # No argument has a shadow (see __call__): a followed output was made from constants
            # and the arguments' metadata alone, the same at every replay.
            outputs.append(_Output(tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, numel, alias, shadow))
        if live.live - start != new_bytes:
            return out, None  # it kept memory it did not return (a cache): not replayable
        container = type(out) if isinstance(out, (tuple, list)) else type(None) if out is None else None
        return out, _Effect(transient, live.meta_items - guesses, tuple(outputs), container)

    def work(self, fn: Callable[[], None], describe: Callable[[], Any]) -> None:
        """The work replayer (:func:`~dist_optim.kernels.replay.replayable_work`): ``fn()`` runs and is
        recorded the first time its description is seen, where it behaved as the contract says (no
        collective, nothing kept, the same tensors described after it); later calls with the same
        description, and the same followed values of its tensors, move the recorder as it did
        (peak, guesses, followed values) without running."""
        live = self.live
        if live is None:
            fn()
            return
        tensors: list[torch.Tensor] = []
        key = _key(describe(), tensors, work=True)
        if key is None or not all(t.is_meta or t.numel() <= _HOST_VALUES for t in tensors):
            fn()
            return
        before = [_values(live, t) for t in tensors]
        full = (key, tuple(before))
        effect = self._works.get(full)
        if effect is not None:
            self.work_hits += 1
            live.peak = max(live.peak, live.live + effect.transient)
            live.meta_items += effect.guesses
            for i, shadow in effect.shadows:
                if shadow is None:
                    live.drop_shadow(tensors[i])
                else:
                    live.set_shadow(tensors[i], shadow)
            return
        recorded = self._record_work(live, fn, describe, key, tensors, before)
        if recorded is not None:
            self._works[full] = recorded
            self.work_recorded += 1

    def _record_work(
        self,
        live: LiveBytes,
        fn: Callable[[], None],
        describe: Callable[[], Any],
        key: Any,
        tensors: list[torch.Tensor],
        before: list[Any],
    ) -> _WorkEffect | None:
        calls = self._traffic.step.collectives if self._traffic is not None else 0
        start, peak, guesses, alive = live.live, live.peak, live.meta_items, live.storages()
        live.peak = start
        try:
            fn()
        finally:
            transient = live.peak - start
            live.peak = max(peak, live.peak)
        if self._traffic is not None and self._traffic.step.collectives != calls:
            return None
        if live.live != start or live.storages() != alive:
            return None  # it kept memory, or replaced a storage: the next call may differ
        after: list[torch.Tensor] = []
        if _key(describe(), after, work=True) != key or any(a is not b for a, b in zip(after, tensors)):
            return None  # it replaced a described tensor or changed its metadata
        changed = [i for i, (t, was) in enumerate(zip(tensors, before)) if _values(live, t) != was]
        if any(not tensors[i].is_meta for i in changed):
            return None  # it wrote a host tensor (a step counter): replaying would not
        shadows = tuple((i, live.shadow_of(tensors[i])) for i in changed)
        return _WorkEffect(transient, live.meta_items - guesses, shadows)

    def _replay(self, live: LiveBytes, effect: _Effect, tensors: list[torch.Tensor]) -> Any:
        live.peak = max(live.peak, live.live + effect.transient)
        live.meta_items += effect.guesses
        made = []
        for o in effect.outputs:
            if o.alias is not None:
                made.append(tensors[o.alias].as_strided(o.shape, o.stride, o.offset))
            else:
                base = torch.empty(o.storage_numel, dtype=o.dtype, device="meta")
                made.append(base.as_strided(o.shape, o.stride, o.offset))
                if o.shadow is not None:
                    live.set_shadow(made[-1], o.shadow)
        if effect.container is None:
            return made[0]
        if effect.container is type(None):
            return None  # an in-place function: only its transient memory to replay
        return effect.container(made)


_MISSING = object()


#: Host tensors of at most this many elements (step counters) may be read by an in-place work: their
#: values are part of its description.
_HOST_VALUES = 16


def _values(live: LiveBytes, t: torch.Tensor) -> tuple[Any, ...] | None:
    """The values of a host tensor ``t`` (a step counter), or those the recorder follows for a meta
    one (a small tensor of scalars), as a hashable tuple; None for a meta tensor not followed."""
    if not t.is_meta:
        return (t.dtype, flat_values(t))
    return live.shadow_values(t)


def _key(x: Any, tensors: list[torch.Tensor], storages: dict[int, list[int]] | None = None, work: bool = False) -> Any:
    """A hashable description of ``x``'s metadata (tensors appended to ``tensors`` in order), or
    None where ``x`` holds something that is not described. ``storages``: the indices in ``tensors``
    by storage, shared by the calls that describe one thing. ``work``: the description of an
    in-place work (:meth:`Replays.work`): dicts with string keys are described too, and a
    tensor's storage offset is not (what it writes in place moves no memory)."""
    if storages is None:
        storages = {}
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided:
            return None
        same = storages.setdefault(x.untyped_storage()._cdata, [])
        offset = 0 if work else x.storage_offset()
        key = ("T", tuple(x.shape), x.stride(), offset, x.dtype, x.device.type, tuple(same))
        same.append(len(tensors))
        tensors.append(x)
        return key
    if isinstance(x, _ATOMS):
        return (type(x), x)
    if isinstance(x, (tuple, list)):
        parts = [_key(v, tensors, storages, work) for v in x]
        return None if any(p is None for p in parts) else (type(x), tuple(parts))
    if work and isinstance(x, dict):
        items = [(k, _key(v, tensors, storages, work)) for k, v in x.items()]
        return None if any(p is None or not isinstance(k, str) for k, p in items) else (dict, tuple(items))
    if isinstance(x, types.FunctionType) and x.__closure__ is None:  # a module's function: its name says all
        return ("F", x.__module__, x.__qualname__)
    if dataclasses.is_dataclass(x) and not isinstance(x, type) and x.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        return _key((type(x).__qualname__, dataclasses.astuple(x)), tensors, storages, work)
    return None
