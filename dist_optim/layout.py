"""How one parameter is split across processes.

A :class:`ParamLayout` is data: the parameter's *full* shape (what a single-device model has),
its tensor-parallel split (group, dim) if any, and its ZeRO shard (group, padding, chunk) if any.
Everything here is index arithmetic; nothing communicates. ``dist_optim.comm`` turns layouts into
collectives, and the optimizers use the index helpers to map a local tensor (a TP slice, or a
flat ZeRO chunk of a TP slice) back to coordinates of the full tensor.

Terms (see docs/design.md, "Vocabulary"):

* working param: what forward/backward sees. Under TP it is the rank's slice of the full param.
* ZeRO shard: the working param flattened, zero-padded to a multiple of the ZeRO group size, cut
  into equal contiguous chunks; each rank owns one chunk (a 1-D tensor). A chunk may cut rows in
  the middle and may consist of padding only.
* flat-range shard: the working param flattened and cut at arbitrary boundaries, one contiguous
  range per rank, unpadded and possibly empty (FSDP's fragments of the original parameters, which
  fall wherever its flat parameter's equal chunks cut). A :class:`ZeroShard` with ``bounds``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "TPSplit",
    "ZeroShard",
    "ParamLayout",
    "local_layout",
    "whole_layout",
    "range_boxes",
    "shard_bounds",
    "register_tp_reader",
    "read_tp_dim",
]


@dataclass(frozen=True)
class TPSplit:
    """A tensor-parallel split: the full tensor is cut into ``size`` equal slices along ``dim``.

    ``group`` is the process group over which the slices live (``None`` only in pure index
    tests); ``rank`` is this process's index in it, which is also the slice it holds.
    """

    dim: int
    size: int
    rank: int
    group: Any = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"TPSplit: rank {self.rank} is outside a group of size {self.size}")


@dataclass(frozen=True)
class ZeroShard:
    """A ZeRO shard of the flattened working param.

    ``padding`` zeros are appended so that ``working numel + padding`` divides by ``size``;
    rank ``rank`` owns the contiguous chunk ``[rank * chunk, (rank + 1) * chunk)``.

    With ``bounds`` (``size + 1`` non-decreasing offsets from 0 to the working numel), rank ``r``
    instead owns ``[bounds[r], bounds[r + 1])``, unpadded and possibly empty: a flat-range shard
    (FSDP's ``use_orig_params`` fragments). ``padding`` is then 0. Equal chunks are the special
    case the ZeRO plugins produce; everything that maps a chunk to coordinates of the full tensor
    (:meth:`ParamLayout.chunk_range`) serves both.
    """

    size: int
    rank: int
    padding: int
    group: Any = field(default=None, compare=False, hash=False)
    bounds: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"ZeroShard: rank {self.rank} is outside a group of size {self.size}")
        if not 0 <= self.padding < self.size:
            raise ValueError(
                f"ZeroShard: padding {self.padding} must be in [0, {self.size}) for a group of size {self.size}"
            )
        if self.bounds is not None:
            bounds = tuple(int(b) for b in self.bounds)
            object.__setattr__(self, "bounds", bounds)
            if (
                len(bounds) != self.size + 1
                or bounds[0] != 0
                or any(b > c for b, c in zip(bounds, bounds[1:]))
                or self.padding
            ):
                raise ValueError(
                    f"ZeroShard: bounds {bounds} must be {self.size + 1} non-decreasing offsets from 0 "
                    "(one range per rank) with padding 0"
                )

    @property
    def widths(self) -> tuple[int, ...] | None:
        """Elements each rank holds of a flat-range shard (None for equal chunks)."""
        if self.bounds is None:
            return None
        return tuple(c - b for b, c in zip(self.bounds, self.bounds[1:]))


@dataclass(frozen=True)
class ParamLayout:
    """Where the piece of a parameter that this process holds sits in the full tensor.

    ``full_shape`` is the single-device shape (including any vocabulary padding the model itself
    carries). ``local_shape`` is the working param's shape: ``full_shape`` with the TP dim divided
    by the TP size. The optimizer's tensor for this param is the working param itself, or its flat
    ZeRO chunk of ``chunk_numel`` elements when ``zero`` is set.
    """

    full_shape: tuple[int, ...]
    tp: TPSplit | None = None
    zero: ZeroShard | None = None

    def __post_init__(self) -> None:
        shape = tuple(int(s) for s in self.full_shape)
        object.__setattr__(self, "full_shape", shape)
        if self.tp is not None:
            if self.tp.size == 1:
                object.__setattr__(self, "tp", None)
            else:
                dim = self.tp.dim % len(shape) if shape else 0
                if not shape or shape[dim] % self.tp.size:
                    raise ValueError(
                        f"ParamLayout: full shape {shape} cannot be split into {self.tp.size} equal "
                        f"slices along dim {self.tp.dim}"
                    )
                if dim != self.tp.dim:
                    object.__setattr__(self, "tp", TPSplit(dim, self.tp.size, self.tp.rank, self.tp.group))
        if self.zero is not None and self.zero.bounds is not None:
            if self.zero.bounds[-1] != self.local_numel:
                raise ValueError(
                    f"ParamLayout: flat ranges {self.zero.bounds} end at {self.zero.bounds[-1]}, not at the "
                    f"{self.local_numel} elements of the working param"
                )
        elif self.zero is not None:
            # A ZeRO "shard" over one rank is kept: the optimizer's tensor is then the whole working
            # param, but flat, and factored math needs to know its shape.
            expected = (-self.local_numel) % self.zero.size
            if self.zero.padding != expected:
                raise ValueError(
                    f"ParamLayout: ZeRO padding {self.zero.padding} does not match a working param of "
                    f"{self.local_numel} elements over {self.zero.size} ranks (expected {expected})"
                )

    # ---- shapes -------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.full_shape)

    @property
    def full_numel(self) -> int:
        return math.prod(self.full_shape)

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.tp is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.tp.dim] //= self.tp.size
        return tuple(shape)

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def is_local(self) -> bool:
        """True when this process holds the whole parameter (no TP split, no ZeRO shard)."""
        return self.tp is None and self.zero is None

    @property
    def sum_groups(self) -> tuple[Any, ...]:
        """Process groups over which a sum over the full tensor is split: the ZeRO group (each
        rank holds a chunk) and the TP group (each rank holds a slice). Replicated copies are
        not summed."""
        groups = []
        if self.zero is not None and self.zero.size > 1:
            groups.append(self.zero.group)
        if self.tp is not None:
            groups.append(self.tp.group)
        return tuple(groups)

    @property
    def geometry(self) -> ParamLayout:
        """This layout without its process groups (equal to it: groups take no part in a layout's
        equality): the key for a cache of what depends only on where the piece sits, which then
        does not keep a destroyed group, and its communicator, alive."""
        tp = None if self.tp is None else TPSplit(self.tp.dim, self.tp.size, self.tp.rank)
        zero = None if self.zero is None else dataclasses.replace(self.zero, group=None)
        return ParamLayout(self.full_shape, tp, zero)

    def is_split_along(self, dim: int) -> bool:
        return self.tp is not None and self.tp.dim == dim % self.ndim

    # ---- ZeRO chunk ---------------------------------------------------------------------
    @property
    def chunk_numel(self) -> int:
        """Elements in the tensor the optimizer sees (the ZeRO chunk, padding included)."""
        if self.zero is None:
            return self.local_numel
        if self.zero.bounds is not None:
            return self.zero.bounds[self.zero.rank + 1] - self.zero.bounds[self.zero.rank]
        return (self.local_numel + self.zero.padding) // self.zero.size

    @property
    def chunk_range(self) -> tuple[int, int]:
        """``[start, stop)`` of this rank's chunk in the flattened, padded working param."""
        if self.zero is None:
            return 0, self.local_numel
        if self.zero.bounds is not None:
            return self.zero.bounds[self.zero.rank], self.zero.bounds[self.zero.rank + 1]
        start = self.zero.rank * self.chunk_numel
        return start, start + self.chunk_numel

    @property
    def largest_chunk_numel(self) -> int:
        """Elements of the largest piece a rank of the ZeRO group holds (``chunk_numel`` but for a
        flat-range shard): what a step budget counts, so that every rank cuts its buckets, and
        issues its collectives, at the same parameters."""
        return max(self.gather_widths)

    @property
    def gather_widths(self) -> tuple[int, ...]:
        """Elements each rank of the ZeRO group holds (equal chunks: ``chunk_numel`` each; a
        flat-range shard: its ranges' lengths); what an all-gather of the pieces pads to."""
        if self.zero is None:
            return (self.local_numel,)
        return self.zero.widths or (self.chunk_numel,) * self.zero.size

    @property
    def valid_numel(self) -> int:
        """Elements of the chunk that are real (not ZeRO padding)."""
        start, stop = self.chunk_range
        return max(0, min(stop, self.local_numel) - start)

    @property
    def tp_offset(self) -> int:
        """Index along the TP dim where this rank's slice starts in the full tensor."""
        if self.tp is None:
            return 0
        return self.tp.rank * self.local_shape[self.tp.dim]

    def tp_slices(self) -> tuple[slice, ...]:
        """Index of the working param inside the full tensor."""
        index = [slice(None)] * self.ndim
        if self.tp is not None:
            start = self.tp_offset
            index[self.tp.dim] = slice(start, start + self.local_shape[self.tp.dim])
        return tuple(index)

    def full_flat_index(
        self, drop_dims: tuple[int, ...] = (), device: torch.device | str | None = None
    ) -> torch.Tensor:
        """For each element of the local tensor, its flat index in the full tensor with
        ``drop_dims`` removed (row-major); padding elements get ``-1``.

        With ``drop_dims=(-1,)`` on a matrix this is the row of every element, with ``(-2,)`` its
        column: scatter-adding a chunk's values at these indices gives the chunk's share of the
        full row/column sums, whatever rows the chunk cuts.
        """
        drop = {d % self.ndim for d in drop_dims}
        start, _ = self.chunk_range
        flat = torch.arange(start, start + self.chunk_numel, device=device)
        out = torch.zeros_like(flat)
        stride_local = 1
        stride_out = 1
        for dim in range(self.ndim - 1, -1, -1):
            size = self.local_shape[dim]
            if dim not in drop:
                coord = torch.div(flat, stride_local, rounding_mode="floor") % size
                if self.is_split_along(dim):
                    coord = coord + self.tp_offset
                out += coord * stride_out
                stride_out *= self.full_shape[dim]
            stride_local *= size
        if self.zero is not None:
            out = torch.where(flat < self.local_numel, out, torch.full_like(out, -1))
        return out

    def local_boxes(self, view_shape: tuple[int, ...]) -> list[tuple[Box, int]] | None:
        """The real (non-padding) elements this rank holds, as boxes of the full tensor seen in
        ``view_shape`` (a reshape of ``full_shape``, e.g. with small dims merged), each with the
        position of its first element in the optimizer's flat tensor: a box's elements, row-major,
        are consecutive there. At most ``2 * len(view_shape) - 1`` boxes (a ZeRO chunk cuts rows).

        None where the pieces are not boxes of that view: a TP slice of a view that merges the
        TP dim with others."""
        view_shape = tuple(int(s) for s in view_shape)
        if math.prod(view_shape) != self.full_numel:
            raise ValueError(f"local_boxes: view {view_shape} is not a reshape of {self.full_shape}")
        if self.tp is None:
            shape, dim, shift = view_shape, 0, 0
        elif view_shape == self.full_shape:
            shape, dim, shift = self.local_shape, self.tp.dim, self.tp_offset
        else:
            return None
        start, stop = self.chunk_range
        out: list[tuple[Box, int]] = []
        offset = 0
        for box in range_boxes(start, min(stop, self.local_numel), shape):
            if shift:
                box = box[:dim] + ((box[dim][0] + shift, box[dim][1] + shift),) + box[dim + 1 :]
            out.append((box, offset))
            offset += box_numel(box)
        return out

    def reduced_shape(self, drop_dims: tuple[int, ...]) -> tuple[int, ...]:
        """The full shape with ``drop_dims`` removed."""
        drop = {d % self.ndim for d in drop_dims}
        return tuple(s for d, s in enumerate(self.full_shape) if d not in drop)

    # ---- moving data between forms (no communication) -----------------------------------
    def take_local(self, full: torch.Tensor, copy: bool = True) -> torch.Tensor:
        """The part of a full tensor this rank holds, in the optimizer's form: a copy, or with
        ``copy=False`` a view of ``full`` where one exists (a caller that owns ``full``)."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"take_local: expected a tensor of shape {self.full_shape}, got {tuple(full.shape)}")
        local = full[self.tp_slices()]
        if self.zero is None:
            return local.clone() if copy else local
        flat = local.reshape(-1)
        if self.zero.padding:
            flat = torch.nn.functional.pad(flat, (0, self.zero.padding))
        start, stop = self.chunk_range
        return flat[start:stop].clone() if copy else flat[start:stop]

    def to_working_shape(self, padded_flat_working: torch.Tensor) -> torch.Tensor:
        """Strip ZeRO padding from a gathered flat working param and restore its shape."""
        return padded_flat_working[: self.local_numel].view(self.local_shape)


#: A box of a tensor: ``(start, stop)`` along every dim (hashable, unlike slices).
Box = tuple[tuple[int, int], ...]


def box_numel(box: Box) -> int:
    return math.prod(stop - start for start, stop in box)


def range_boxes(start: int, stop: int, shape: tuple[int, ...]) -> list[Box]:
    """The flat range ``[start, stop)`` of a row-major tensor of ``shape`` as boxes, in flat order:
    a partial leading row, whole rows, a partial trailing row, recursively (at most
    ``2 * len(shape) - 1`` boxes)."""
    if start >= stop:
        return []
    if not shape:
        return [()]
    if len(shape) == 1:
        return [((start, stop),)]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner
    if first == last:
        base = first * inner
        return [((first, first + 1), *box) for box in range_boxes(start - base, stop - base, shape[1:])]
    boxes: list[Box] = []
    if start % inner:
        boxes += [((first, first + 1), *box) for box in range_boxes(start % inner, inner, shape[1:])]
        first += 1
    whole_stop = last + 1 if stop % inner == 0 else last
    if whole_stop > first:
        boxes.append(((first, whole_stop), *((0, s) for s in shape[1:])))
    if stop % inner:
        boxes += [((last, last + 1), *box) for box in range_boxes(0, stop % inner, shape[1:])]
    return boxes


def shard_bounds(start: int, numel: int, width: int, size: int) -> tuple[int, ...]:
    """The :attr:`ZeroShard.bounds` of a tensor laid at ``[start, start + numel)`` of a flat buffer
    cut into ``size`` shards of ``width`` elements, rank ``r`` holding ``[r * width, (r + 1) * width)``:
    FSDP's flat parameters and Gemini's chunks are both laid out this way."""
    return tuple(min(max(r * width - start, 0), numel) for r in range(size + 1))


def local_layout(tensor: torch.Tensor) -> ParamLayout:
    """The layout of a parameter that lives whole on this process."""
    return whole_layout(tuple(tensor.shape))


@functools.lru_cache(maxsize=4096)
def whole_layout(shape: tuple[int, ...]) -> ParamLayout:
    """The layout of a whole tensor of ``shape``: one object per shape (layouts are frozen), as an
    unbound optimizer asks for its parameters' layouts several times a step."""
    return ParamLayout(shape)


# ---- reading the TP split of a working param ------------------------------------------------
# The core does not know any framework's tensor annotations. Integrations register a reader that
# returns the split dim of a working param, or None if the param is replicated across the TP group:
# on import (``dist_optim.plugins`` for ColossalAI, test harnesses), and, so that a framework's
# sliced tensor is never silently read as replicated because its integration was not imported, an
# installed integration names the module that registers its reader under the entry-point group
# :data:`INTEGRATIONS` (setup.py), loaded the first time a split is read with none registered.
TPReader = Callable[[torch.Tensor], "int | None"]
_TP_READERS: list[TPReader] = []
INTEGRATIONS = "dist_optim.integrations"
_integrations_loaded = False


def register_tp_reader(reader: TPReader) -> None:
    """Teach the core how to find the TP split dim of a working parameter."""
    if reader not in _TP_READERS:
        _TP_READERS.append(reader)


def _load_integrations() -> None:
    global _integrations_loaded
    if _integrations_loaded:
        return
    _integrations_loaded = True
    from importlib.metadata import entry_points

    for entry in entry_points(group=INTEGRATIONS):
        entry.load()


def read_tp_dim(working: torch.Tensor) -> int | None:
    """The dim along which ``working`` is TP-split, or None when it is replicated."""
    if not _TP_READERS:
        _load_integrations()
    for reader in _TP_READERS:
        dim = reader(working)
        if dim is not None:
            return dim
    return None
