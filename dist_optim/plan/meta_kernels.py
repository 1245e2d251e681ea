"""Meta kernels answered without torch's slow paths, for the planner's recorder (:class:`~.traffic.LiveBytes`).

A simulated step dispatches every operator of the optimizers' own code on meta tensors, and torch
computes many meta outputs through Python references (``torch._refs``: element-wise type promotion,
broadcasting and stride rules, reductions), a few hundred microseconds each. The same operators run
on the same shapes layer after layer, so :func:`meta_call` remembers an out-of-place operator's
outputs by its arguments' metadata and makes the next ones directly; a few operators whose outputs
are known in advance are made without running at all (:func:`_shortcut`). The answers are the
kernels' own: a remembered output has the shape, strides, offset, dtype and storage size the kernel
gave for the same metadata. ``python -m cProfile -s tottime -m dist_optim.plan --model llama-70b --tp 2
--dp 32 --optimizer came`` shows what is left.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import torch

from .torch_internals import strides_device

__all__ = ["meta_call", "COUNTS"]

#: Operators answered from the memo (``"remembered"``) and run to fill it (``"recorded"``).
COUNTS: collections.Counter[str] = collections.Counter()


def meta_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], inputs: list[torch.Tensor]) -> Any:
    """``func(*args, **kwargs)``, its meta outputs made directly where their metadata is known from
    an earlier call with the same arguments' metadata (or in advance, :func:`_shortcut`).
    ``inputs``: the tensors among the arguments (the recorder's :func:`~.traffic.tensors_in`)."""
    out = _shortcut(func, args, kwargs)
    if out is not None:
        return out
    if not _functional(func):
        return func(*args, **kwargs)
    key = _memo_key(func, args, kwargs)
    if key is None:
        return func(*args, **kwargs)
    made = _MEMO.get(key, _MISSING)
    if made is None:
        return func(*args, **kwargs)
    if made is not _MISSING:
        assert isinstance(made, _Outputs)
        COUNTS["remembered"] += 1
        return made.make()
    out = func(*args, **kwargs)
    COUNTS["recorded"] += 1
    if len(_MEMO) >= MEMO_ENTRIES:
        _MEMO.clear()
    _MEMO[key] = _Outputs.of(out, inputs)
    return out


#: Remembered outputs at most, far above what one plan meets (its operators recur on a few shapes,
#: ``COUNTS`` tells); beyond, the memo starts again, so that a process planning many models keeps a few MB.
MEMO_ENTRIES = 20_000


class _Outputs:
    """The metadata of an operator's fresh meta outputs (a tensor, or a tuple or list of tensors
    and Nones), to make more like them."""

    __slots__ = ("container", "tensors")

    def __init__(self, container: type | None, tensors: tuple[tuple[Any, ...] | None, ...]) -> None:
        self.container = container  # None: a single tensor
        self.tensors = tensors  # (shape, stride, offset, dtype, storage elements) or None

    @staticmethod
    def of(out: Any, inputs: list[torch.Tensor]) -> _Outputs | None:
        """What to remember of ``out``, or None where it is not only fresh strided meta tensors, each
        on a storage of its own (a view of an argument, a number, a host tensor)."""
        single = isinstance(out, torch.Tensor)
        if not single and not isinstance(out, (tuple, list)):
            return None
        results = [out] if single else list(out)
        seen = {t.untyped_storage()._cdata for t in inputs}
        described: list[tuple[Any, ...] | None] = []
        for t in results:
            if t is None:
                described.append(None)
                continue
            if not isinstance(t, torch.Tensor) or type(t) is not torch.Tensor or not t.is_meta:
                return None
            if t.layout != torch.strided or t.requires_grad:
                return None
            storage = t.untyped_storage()
            if storage._cdata in seen:
                return None
            seen.add(storage._cdata)
            numel = storage.nbytes() // t.element_size()
            described.append((tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, numel))
        return _Outputs(None if single else type(out), tuple(described))

    def make(self) -> Any:
        made: list[torch.Tensor | None] = []
        for d in self.tensors:
            if d is None:
                made.append(None)
                continue
            shape, stride, offset, dtype, numel = d
            made.append(torch.empty(numel, dtype=dtype, device="meta").as_strided(shape, stride, offset))
        return made[0] if self.container is None else self.container(made)


_MEMO: dict[Any, _Outputs | None] = {}
_MISSING = object()

#: Arguments that are not tensors, described by their type and value.
_ATOMS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


@functools.cache
def _functional(func: Any) -> bool:
    """Whether ``func``'s outputs are fresh tensors whose metadata depends on its arguments' metadata
    alone: it writes no argument, returns no alias, and has no output shape that depends on values."""
    if not isinstance(func, torch._ops.OpOverload):
        return False
    schema = func._schema
    if any(a.alias_info is not None for a in schema.arguments) or not schema.returns:
        return False
    if any(r.alias_info is not None for r in schema.returns):
        return False
    return not {torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output} & set(func.tags)


def _memo_key(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func`` and its arguments' metadata (tensors: shape, strides, dtype; every tensor on meta,
    at least one), with what else an output's layout may follow (the default dtype, the device
    meta kernels shape their outputs as), or None where an argument is not described."""
    parts: list[Any] = [func, torch.get_default_dtype(), strides_device()]
    if not _describe(args, parts) or not _describe(kwargs, parts):
        return None
    if not any(type(p) is _TensorKey for p in parts):
        return None
    return tuple(parts)


class _TensorKey(tuple):  # type: ignore[type-arg]
    """A tensor argument's metadata in a memo key (a tuple of its own type: told from a list's)."""

    __slots__ = ()


def _describe(x: Any, parts: list[Any]) -> bool:
    if isinstance(x, torch.Tensor):
        if not x.is_meta or x.layout != torch.strided or x.is_conj() or x.is_neg():
            return False
        parts.append(_TensorKey((tuple(x.shape), x.stride(), x.dtype)))
        return True
    if isinstance(x, _ATOMS):
        parts.append((type(x), x))
        return True
    if isinstance(x, (tuple, list)):
        parts.append((type(x), len(x)))
        return all(_describe(v, parts) for v in x)
    if isinstance(x, dict):
        parts.append((dict, tuple(x)))
        return all(isinstance(k, str) and _describe(v, parts) for k, v in x.items())
    return False


def _shortcut(func: Any, args: Any, kwargs: Any) -> Any:
    """What ``func`` returns on meta tensors, made directly where torch makes it through a Python
    reference, slowly: the norms of ``torch._foreach_norm`` (the NaN/Inf check's, of every
    gradient; one scalar per tensor, in ``dtype`` or the tensor's real dtype), ``torch.zeros``
    (state buffers) and an in-place element-wise operator's result, its first argument (the
    factored optimizers' statistics). None for any other call, which runs as it is. Deviation: a
    shape or dtype an in-place operator would refuse passes on meta (a real run refuses it)."""
    if func is torch.ops.aten._foreach_norm.Scalar:
        tensors = args[0]
        if not tensors or not all(t.is_meta for t in tensors):
            return None
        dtype = kwargs.get("dtype", args[2] if len(args) > 2 else None)
        return [torch.empty((), dtype=dtype or _REAL.get(t.dtype, t.dtype), device="meta") for t in tensors]
    if _in_place_pointwise(func) and isinstance(args[0], torch.Tensor) and args[0].is_meta:
        return args[0]
    if func is torch.ops.aten.zeros.default and set(kwargs) <= {"dtype", "device", "pin_memory"}:
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "meta" and not kwargs.get("pin_memory"):
            return torch.empty(args[0], dtype=kwargs.get("dtype"), device="meta")
    return None


@functools.cache
def _in_place_pointwise(func: Any) -> bool:
    """Whether ``func`` is an element-wise operator that writes its first argument and returns it."""
    schema = func._schema
    if torch.Tag.pointwise not in func.tags or not schema.arguments or len(schema.returns) != 1:
        return False
    first, out = schema.arguments[0].alias_info, schema.returns[0].alias_info
    return first is not None and first.is_write and out is not None and out.is_write


#: The real dtype of a complex one (a norm's).
_REAL = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}
