"""State codecs: how an optimizer's state entry is stored, and what its math reads from it.

An optimizer's math runs on plain tensors (fp32 moments, whole symmetric matrices); what
``optimizer.state`` and the checkpoints hold may be a compact form of them. A :class:`Codec` is one
such form: what it stores under an entry's name (:meth:`Codec.stored`: saved keys, shapes,
dtypes), :meth:`~Codec.decode` to the tensor the math needs, :meth:`~Codec.encode` after the math,
and :meth:`~Codec.holds`, the one predicate for "is this saved value in my form" (a state saved
with other options is converted, not misread). Meta's ``QuantizedTensorList`` (Shampoo's
``distributed_shampoo/utils``) is the model: the math sees dequantised tensors, the state keeps codes.

* :data:`PLAIN`: the tensor itself;
* :class:`Blockwise8bit`: bitsandbytes' 8-bit block-wise codes (Dettmers et al., 2022,
  arXiv:2110.02861; :mod:`.bnb`), the codes under the entry's name and ``<name>_absmax``;
* :class:`PackedTriangle`: a symmetric or triangular matrix as its packed lower or upper
  triangle (:func:`dist_optim.kernels.structured.pack_lower`), lossless;
* :class:`LowBit`: 4- or 8-bit block-wise codes of a matrix (Wang et al., 2024, "4-bit Shampoo",
  arXiv:2405.18144; :mod:`.lowbit`), of its packed triangle where it is one, with ``<name>_absmax``.

An optimizer declares its entries once (:class:`Entry`: a name and the codec it uses when its
option is on; :class:`StateSpec`: the entries and the rule for their keys), and its step, loader
and conversions ask the declaration: :meth:`StateSpec.keeps_saved_dtype` (the loader keeps codes
and their absmax as saved) and :meth:`Entry.holds` (which form a loaded value is in).

The scope of ``optim_bits`` and ``min_8bit_size`` (:class:`EightBit`): a constructor option of
every optimizer that has 8-bit moments, checked here (:func:`check_8bit_options`) and kept on
the optimizer as ``optimizer.optim_bits`` / ``optimizer.min_8bit_size``; a tensor of at least
``min_8bit_size`` elements keeps its moments in 8 bits (bitsandbytes' rule). Shampoo keeps both
in its param groups too, as it always has (its options are group options, saved with them): the
constructor's values are the groups' defaults and a group may set its own, checked by the same
function. An optimizer whose moments are optimizer-wide refuses them in a param group
(:func:`refuse_group_8bit_options`): there they would be ignored.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from ..kernels import structured
from ..layout import ParamLayout
from . import bnb, lowbit

__all__ = [
    "ABSMAX",
    "absmax_key",
    "quantized",
    "Codec",
    "Plain",
    "PLAIN",
    "Blockwise8bit",
    "BNB_SIGNED",
    "BNB_UNSIGNED",
    "PackedTriangle",
    "PACKED_SYMMETRIC",
    "PACKED_UPPER",
    "LowBit",
    "Entry",
    "StateSpec",
    "EightBit",
    "check_8bit_options",
    "refuse_group_8bit_options",
]

#: The suffix of a quantised entry's block absmax key.
ABSMAX = "_absmax"

Stored = list[tuple[str, tuple[int, ...], torch.dtype]]


def absmax_key(key: str) -> str:
    """The key of the block absmax of the quantised entry ``key``."""
    return key + ABSMAX


class Codec:
    """How one state entry is stored. Subclasses say what they store, decode and encode; the
    base is the interface the optimizers program against."""

    name = "codec"
    #: Whether the stored form carries a ``<name>_absmax`` entry beside the codes.
    has_absmax = False

    def stored(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> Stored:
        """The saved ``(key, shape, dtype)`` of an entry ``key`` whose decoded value has ``shape``
        and ``dtype``, in the order they are saved."""
        raise NotImplementedError

    def keys(self, key: str) -> tuple[str, ...]:
        """Every saved key of entry ``key``."""
        return (key, absmax_key(key)) if self.has_absmax else (key,)

    def holds(self, value: Any) -> bool:
        """Whether a saved value is in this codec's form (the one predicate for it)."""
        raise NotImplementedError

    def decode(self, stored: Mapping[str, Any], key: str, **how: Any) -> torch.Tensor:
        """The tensor the math reads."""
        raise NotImplementedError

    def encode(self, value: torch.Tensor, stored: MutableMapping[str, Any], key: str, **how: Any) -> None:
        """Store ``value`` (the math's result) into the existing entry ``key`` of ``stored``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name


class Plain(Codec):
    """The tensor as the math uses it."""

    name = "plain"

    def stored(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> Stored:
        return [(key, tuple(shape), dtype)]

    def holds(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and not quantized(value)

    def decode(self, stored: Mapping[str, Any], key: str, **how: Any) -> torch.Tensor:
        value: torch.Tensor = stored[key]
        return value

    def encode(self, value: torch.Tensor, stored: MutableMapping[str, Any], key: str, **how: Any) -> None:
        if stored[key] is not value:
            stored[key].copy_(value)


PLAIN = Plain()


def quantized(value: Any) -> bool:
    """Whether a saved value is the codes of a quantising codec (:class:`Blockwise8bit`,
    :class:`LowBit`): the one place that tells codes from values by their dtype."""
    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8


class Blockwise8bit(Codec):
    """bitsandbytes' 8-bit block-wise codes of a moment (:mod:`.bnb`): uint8 codes of the moment's
    shape (this rank's piece) under its name, one fp32 absmax per block of 256 elements of the
    *full* tensor under ``<name>_absmax``; ``signed``: bitsandbytes' signed map (first moments) or
    unsigned one (second moments). A step reads a bucket's entries through a
    :class:`~dist_optim.states.bnb.Batch8bit` (:meth:`read`), which encodes them all at once."""

    has_absmax = True

    def __init__(self, signed: bool) -> None:
        self.signed = signed
        self.name = f"bnb8-{'signed' if signed else 'unsigned'}"

    def stored(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, full_numel: int | None = None) -> Stored:
        numel = full_numel if full_numel is not None else int(torch.Size(shape).numel())
        return [(key, tuple(shape), torch.uint8), (absmax_key(key), (-(-numel // bnb.BLOCKSIZE),), torch.float32)]

    def holds(self, value: Any) -> bool:
        return quantized(value)

    def decode(self, stored: Mapping[str, Any], key: str, **how: Any) -> torch.Tensor:
        """fp32 values (``how["blocks"]``: the :class:`~dist_optim.states.bnb.FullBlocks` of the
        entry's tensor)."""
        blocks: bnb.FullBlocks = how["blocks"]
        return blocks.dequantize_blockwise_8bit(stored[key], stored[absmax_key(key)], self.signed)

    def encode(self, value: torch.Tensor, stored: MutableMapping[str, Any], key: str, **how: Any) -> None:
        """Codes and block absmax of ``value`` (``how["blocks"]``; ``how["absmax"]``: the reduced
        absmax of a tensor held in pieces)."""
        how["blocks"].quantize_into(value, how.get("absmax"), stored[key], stored[absmax_key(key)], self.signed)

    def read(
        self,
        batch: bnb.Batch8bit,
        state: dict[str, Any],
        key: str,
        layout: ParamLayout,
        like: torch.Tensor,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """The entry's values for a step to update in place, encoded by ``batch.store()``; an entry
        not in this form yet (absent, or saved with ``optim_bits=32``) is carried over."""
        return batch.read(state, key, self.signed, layout, like, dtype)

    def to_plain(
        self,
        batch: bnb.Batch8bit,
        state: dict[str, Any],
        key: str,
        layout: ParamLayout,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        """Decode the entry into a plain tensor of ``dtype`` where it is in this form (a state saved
        with ``optim_bits=8`` loaded where it is kept in 32 bits); local, no collective."""
        if self.holds(state.get(key)):
            batch.to_32bit(state, key, self.signed, layout, device, dtype)


#: First moments (bitsandbytes' signed map) and second moments (its unsigned map).
BNB_SIGNED = Blockwise8bit(signed=True)
BNB_UNSIGNED = Blockwise8bit(signed=False)


class PackedTriangle(Codec):
    """A ``d x d`` matrix as its packed ``lower`` or upper triangle, ``d (d + 1) / 2`` elements,
    lossless: a symmetric matrix is decoded whole (mirrored; Shampoo's factors and roots), a
    triangular one with zeros in the other triangle (Kron's factors)."""

    def __init__(self, lower: bool, symmetric: bool) -> None:
        self.lower, self.symmetric = lower, symmetric
        self.name = f"packed-{'lower' if lower else 'upper'}{'-symmetric' if symmetric else ''}"

    def stored(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> Stored:
        return [(key, (structured.packed_size(shape[0]),), dtype)]

    def holds(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and value.dim() == 1 and not quantized(value)

    def decode(self, stored: Mapping[str, Any], key: str, **how: Any) -> torch.Tensor:
        """The whole ``how["side"]``-sided matrix (into ``how["out"]`` where given)."""
        return self.unpack(stored[key], how["side"], how.get("out"))

    def unpack(self, packed: torch.Tensor, side: int, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.symmetric:
            return structured.unpack_symmetric(packed, side, out=out)
        if self.lower:
            raise NotImplementedError("a lower-triangular matrix is not a stored form of any optimizer")
        return structured.unpack_upper_triangular(packed, side, out=out)

    def pack(self, value: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return structured.pack_lower(value, out=out) if self.lower else structured.pack_upper(value, out=out)

    def encode(self, value: torch.Tensor, stored: MutableMapping[str, Any], key: str, **how: Any) -> None:
        self.pack(value, out=stored[key])


#: Shampoo's symmetric factors and roots (the lower triangle) and Kron's upper-triangular factors.
PACKED_SYMMETRIC = PackedTriangle(lower=True, symmetric=True)
PACKED_UPPER = PackedTriangle(lower=False, symmetric=False)


class LowBit(Codec):
    """A matrix as ``bits``-bit block-wise codes (:mod:`.lowbit`) of its elements, or of its
    ``packed`` triangle, under its name, with ``<name>_absmax``; decoded to fp32 values."""

    has_absmax = True

    def __init__(self, bits: int, packed: PackedTriangle | None = None) -> None:
        if bits not in (8, 4):
            raise ValueError(f"LowBit: bits must be 8 or 4, got {bits!r}")
        self.bits, self.packed = bits, packed
        self.name = f"lowbit{bits}" + (f"-{packed.name}" if packed is not None else "")

    def numel(self, side: int) -> int:
        """Elements quantised of a ``side x side`` matrix."""
        return structured.packed_size(side) if self.packed is not None else side * side

    def stored(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> Stored:
        n = self.numel(shape[0])
        return [
            (key, (lowbit.codes_numel(n, self.bits),), torch.uint8),
            (absmax_key(key), (lowbit.absmax_numel(n, self.bits),), torch.float32),
        ]

    def holds(self, value: Any) -> bool:
        return quantized(value)

    def decode(self, stored: Mapping[str, Any], key: str, **how: Any) -> torch.Tensor:
        """fp32 values of the ``how["side"]``-sided matrix: flat (``how["flat"]``, into
        ``how["out"]`` where given), else whole (unpacked where packed)."""
        side = how["side"]
        codes, absmax = stored[key], stored[absmax_key(key)]
        if how.get("flat"):
            return self.values(codes, absmax, side, how.get("out"))
        values = self.values(codes, absmax, side)
        return values.view(side, side) if self.packed is None else self.packed.unpack(values, side)

    def values(
        self, codes: torch.Tensor, absmax: torch.Tensor, side: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The flat fp32 values of a ``side``-sided matrix's codes and absmax (into ``out``)."""
        return lowbit.dequantize_lowbit(codes, absmax, self.bits, self.numel(side), out)

    def quantize(
        self, value: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes and block absmax of a whole matrix (of its packed triangle where packed)."""
        flat = self.packed.pack(value) if self.packed is not None else value.reshape(-1)
        return lowbit.quantize(flat, self.bits, generator)

    def encode(self, value: torch.Tensor, stored: MutableMapping[str, Any], key: str, **how: Any) -> None:
        """Quantise ``value`` into the entry (``how["generator"]``: stochastic rounding)."""
        codes, absmax = self.quantize(value, how.get("generator"))
        stored[key].copy_(codes)
        stored[absmax_key(key)].copy_(absmax)


C = TypeVar("C", bound=Codec)


@dataclass(frozen=True)
class Entry(Generic[C]):
    """A state entry an optimizer declares: its ``name`` (a key, or a key's name after a prefix
    such as Shampoo's ``block<i>.``) and the ``codec`` it is stored with when its option is on."""

    name: str
    codec: C

    def keys(self, prefix: str = "") -> tuple[str, ...]:
        return self.codec.keys(prefix + self.name)

    def holds(self, state: Mapping[str, Any], prefix: str = "") -> bool:
        """Whether ``state`` holds this entry in its codec's form (not a plain one saved without it)."""
        return self.codec.holds(state.get(prefix + self.name))


@dataclass(frozen=True)
class StateSpec:
    """An optimizer's declared state entries. ``pattern`` (a regular expression with the named
    groups ``name`` and, for indexed entries such as ``factor<k>``, ``index``) is the one rule that
    parses its keys; the default matches the entries' names exactly."""

    entries: tuple[Entry[Any], ...]
    pattern: str | None = None

    def _regex(self) -> re.Pattern[str]:
        if self.pattern is not None:
            return re.compile(self.pattern)
        names = "|".join(re.escape(e.name) for e in sorted(self.entries, key=lambda e: -len(e.name)))
        return re.compile(rf"(?P<name>{names})(?P<absmax>{ABSMAX})?")

    def parse(self, key: str) -> tuple[Entry[Any], int | None, bool] | None:
        """The entry a key belongs to, its index (indexed entries) and whether it is the entry's
        absmax; None for a key no entry declares."""
        m = self._regex().fullmatch(key)
        if m is None:
            return None
        found = [e for e in self.entries if e.name == m.group("name")]
        if not found:
            return None
        groups = m.groupdict()
        index = groups.get("index")
        return found[0], None if index is None else int(index), bool(groups.get("absmax"))

    def entry(self, name: str) -> Entry[Any]:
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(name)

    def encoded(self, key: str, value: Any) -> bool:
        """Whether ``key`` holds a declared entry in its codec's quantised form: its codes, or the
        absmax beside them (a plain value saved without the option is not)."""
        parsed = self.parse(key)
        if parsed is None:
            return False
        entry, _, is_absmax = parsed
        return entry.codec.has_absmax and (is_absmax or entry.codec.holds(value))

    def keeps_saved_dtype(self, key: str, value: Any) -> bool:
        """Codes and their fp32 absmax are restored as saved (torch's loader would cast them to
        the parameter's dtype)."""
        return self.encoded(key, value)


def check_8bit_options(optim_bits: Any, min_8bit_size: Any, what: str) -> tuple[int, int]:
    """The validated ``(optim_bits, min_8bit_size)``: a one-line ValueError naming the value and the
    fix for ``optim_bits`` other than 32 or 8 (bools too) or a ``min_8bit_size`` that is not an
    integer >= 0; ``what`` names what 8 bits quantises."""
    if isinstance(optim_bits, bool) or optim_bits not in (8, 32):
        raise ValueError(
            f"optim_bits must be 32 or 8 ({what}), got {optim_bits!r}; pass optim_bits=8 for 8-bit states "
            "or optim_bits=32 for full precision"
        )
    if isinstance(min_8bit_size, bool) or not isinstance(min_8bit_size, int) or min_8bit_size < 0:
        raise ValueError(f"min_8bit_size must be an integer >= 0, got {min_8bit_size!r}")
    return int(optim_bits), int(min_8bit_size)


@dataclass(frozen=True)
class EightBit:
    """``optim_bits`` and ``min_8bit_size``, checked: which tensors keep 8-bit moments."""

    optim_bits: int = 32
    min_8bit_size: int = 4096

    @classmethod
    def of(cls, source: Any, what: str = "8-bit block-wise states") -> EightBit:
        """The options of an optimizer (its attributes) or of a param group (its keys)."""
        get = source.get if isinstance(source, Mapping) else (lambda k: getattr(source, k))
        return cls(*check_8bit_options(get("optim_bits"), get("min_8bit_size"), what))

    def keeps(self, numel: int) -> bool:
        """Whether a tensor of ``numel`` elements (the full tensor's, or a Shampoo block's) is 8-bit."""
        return self.optim_bits == 8 and numel >= self.min_8bit_size


def refuse_group_8bit_options(group: Mapping[str, Any], owner: str) -> None:
    """Refuse ``optim_bits`` / ``min_8bit_size`` in a param group of an optimizer where they are
    constructor options (they would be ignored there)."""
    given = [k for k in ("optim_bits", "min_8bit_size") if k in group]
    if given:
        raise ValueError(
            f"{owner}: {', '.join(given)} is optimizer-wide: pass it to the constructor, not in a param group"
        )
