"""Optimizer states in bitsandbytes' formats: 8-bit block-wise quantised Adam moments and paged
buffers (Dettmers et al., 2022, "8-bit Optimizers via Block-wise Quantization", arXiv:2110.02861).

GaLore's 8-bit mode (:mod:`dist_optim.galore`) keeps its moments as bitsandbytes' 8-bit blockwise
Adam does: uint8 codes plus one fp32 absmax per block of :data:`BLOCKSIZE` values, with
bitsandbytes' signed (first moment) and unsigned (second moment) dynamic maps. This module holds
what is specific to that format, none of GaLore's math:

* the codes themselves (:func:`dequantize_blockwise_8bit`, :func:`quantize_into`, through bitsandbytes'
  ``quantize_blockwise`` / ``dequantize_blockwise``, whose nearest-code search we do not
  reimplement);
* :class:`FullBlocks`: blocks of the *full* flattened tensor for a tensor held in pieces (a TP
  slice, a ZeRO chunk), so that codes and absmax do not depend on the layout;
* the state entries (:func:`new_moments_8bit`: zero ``exp_avg``, ``exp_avg_sq`` and their
  ``*_absmax``, under a prefix; decoded and encoded by :class:`dist_optim.states.codecs.Blockwise8bit`);
  for one 8-bit entry of any optimizer (Muon's momentum), :func:`new_8bit`, :func:`read_8bit` and
  :func:`write_8bit_many`, which max-reduces the absmax of tensors held in pieces itself (one
  :class:`~dist_optim.comm.MaxBucket` for all the entries it is given); :func:`start_8bit` and
  :func:`to_32bit` for a state that was saved with the other ``optim_bits``;
* :class:`Batch8bit`, how every optimizer's step uses them: the 8-bit entries of one bucket
  read as fp32 values to update (carried over from a 32-bit state where one was saved), then
  stored all at once (one max-reduction of the block absmax per process group), and an 8-bit
  entry loaded by a 32-bit optimizer dequantised;
* paged (CUDA unified) memory (:class:`Buffers`, :func:`paged_on_device`);
* bitsandbytes' quantisation arguments as ColossalAI passes them (:func:`quant_args`).

bitsandbytes is imported only when one of these runs (32-bit GaLore does not need it).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from .. import comm
from ..layout import ParamLayout

__all__ = [
    "BLOCKSIZE",
    "PAGED_MIN_NUMEL",
    "qmap",
    "dequantize_blockwise_8bit",
    "quantize_into",
    "FullBlocks",
    "MOMENTS",
    "new_moments_8bit",
    "new_8bit",
    "read_8bit",
    "write_8bit_many",
    "Requant",
    "start_8bit",
    "to_32bit",
    "Batch8bit",
    "Buffers",
    "paged_on_device",
    "paging_supported",
    "quant_args",
]

#: bitsandbytes' 8-bit optimizers quantise in blocks of 256 values.
BLOCKSIZE = 256
#: bitsandbytes pages optimizer states of at least this many elements.
PAGED_MIN_NUMEL = 100_000

_QMAPS: dict[tuple[bool, str], torch.Tensor] = {}


# ---- codes -----------------------------------------------------------------------------------
def qmap(signed: bool, device: torch.device) -> torch.Tensor:
    """bitsandbytes' dynamic quantisation map (signed for exp_avg, unsigned for exp_avg_sq)."""
    key = (signed, str(device))
    if key not in _QMAPS:
        import bitsandbytes.functional as bnbf

        _QMAPS[key] = bnbf.create_dynamic_map(signed=signed).to(device)
    return _QMAPS[key]


def dequantize_blockwise_8bit(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 values of a whole tensor's codes (blocks of its own flattened elements)."""
    if codes.is_meta:  # the planner's simulation (dist_optim.plan): no values, the same allocation
        return torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    import bitsandbytes.functional as bnbf

    return bnbf.dequantize_blockwise(codes, absmax=absmax, code=qmap(signed, codes.device), blocksize=BLOCKSIZE).view(
        codes.shape
    )


def quantize_into(values: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> None:
    """Codes of a whole tensor's ``values`` into ``codes``, its block absmax into ``absmax``."""
    if values.is_meta:  # the planner's simulation: bitsandbytes' output buffers, no values
        torch.empty(values.numel(), dtype=torch.uint8, device=values.device)
        torch.empty(absmax.shape, dtype=torch.float32, device=values.device)
        return
    import bitsandbytes.functional as bnbf

    out, qstate = bnbf.quantize_blockwise(
        values.float().contiguous(), code=qmap(signed, values.device), blocksize=BLOCKSIZE
    )
    codes.copy_(out.view(codes.shape))
    absmax.copy_(qstate.absmax)


class FullBlocks:
    """8-bit block-wise quantisation of a tensor's moments with blocks of ``BLOCKSIZE``
    consecutive elements of the *full* flattened tensor (bitsandbytes' blocks on one device), so
    that codes and absmax do not depend on how the tensor is split: a TP slice or a ZeRO chunk
    holds pieces of blocks, whose absmax is max-reduced over the ranks that hold them. The absmax
    of all blocks is kept (replicated; 1/256 of the tensor's elements).

    Codes come from bitsandbytes' own ``quantize_blockwise`` (its nearest-code search is not an
    exact nearest, so we do not reimplement it): a piece of a block is quantised in a 256-slot
    buffer whose slots this rank does not hold carry the block's global absmax, so bitsandbytes
    computes exactly that absmax and gives every held element the code it gives on one device.
    """

    def __init__(self, layout: ParamLayout, device: torch.device) -> None:
        self.layout = layout
        self.n = -(-layout.full_numel // BLOCKSIZE)
        self.ids: torch.Tensor | None = None
        if not layout.is_local:
            flat = layout.full_flat_index(device=device)
            # ZeRO padding (index -1) goes to an extra block whose absmax is 0.
            self.ids = torch.where(flat < 0, self.n, torch.div(flat, BLOCKSIZE, rounding_mode="floor"))
            self.slot = torch.where(flat < 0, 0, flat % BLOCKSIZE)

    @property
    def whole(self) -> bool:
        """Whether this rank holds the whole tensor (bitsandbytes then computes the absmax)."""
        return self.ids is None

    def dequantize_blockwise_8bit(self, codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
        if self.ids is None:
            return dequantize_blockwise_8bit(codes.reshape(-1), absmax, signed).view(codes.shape)
        per_element = torch.cat([absmax, absmax.new_zeros(1)])[self.ids]
        values = qmap(signed, codes.device)[codes.reshape(-1).long()]
        return values.mul_(per_element).view(codes.shape)

    def amax(self, values: torch.Tensor) -> torch.Tensor:
        """This rank's share of the block absmax of a tensor held in pieces (zeros for blocks it
        holds nothing of)."""
        assert self.ids is not None, "a whole tensor's absmax is bitsandbytes' to compute"
        flat = values.detach().reshape(-1).abs()
        out = flat.new_zeros(self.n + 1)
        return out.scatter_reduce_(0, self.ids, flat, reduce="amax")[: self.n].contiguous()

    def quantize_into(
        self,
        values: torch.Tensor,
        absmax: torch.Tensor | None,
        codes: torch.Tensor,
        absmax_out: torch.Tensor,
        signed: bool,
    ) -> None:
        """Codes of ``values`` into ``codes`` and the block absmax into ``absmax_out``; ``absmax``
        is the reduced absmax of a tensor held in pieces (None for a whole tensor)."""
        if self.ids is None:
            quantize_into(values.reshape(-1), codes.view(-1), absmax_out, signed)
            return
        assert absmax is not None, "a tensor held in pieces needs its reduced absmax"
        absmax_out.copy_(absmax)
        if values.is_meta:
            # The planner's simulation: which blocks a piece touches is data (the flat indices),
            # so the 256-slot buffers are allocated for twice the piece's own blocks (every block
            # it touches at least half held: TP rows and ZeRO chunks of a Llama's matrices).
            rows = min(self.n + 1, 2 * -(-values.numel() // BLOCKSIZE))
            torch.empty(rows, BLOCKSIZE, dtype=torch.float32, device=values.device)
            torch.empty(rows, BLOCKSIZE, dtype=torch.uint8, device=values.device)
            return
        # Local elements come in increasing full index (row-major slices, contiguous chunks).
        blocks, row = torch.unique_consecutive(self.ids, return_inverse=True)
        full_absmax = torch.cat([absmax, absmax.new_zeros(1)])
        buf = full_absmax[blocks].unsqueeze(1).repeat(1, BLOCKSIZE)
        buf[row, self.slot] = values.reshape(-1).float()
        out = torch.empty(buf.shape, dtype=torch.uint8, device=buf.device)
        quantize_into(buf.view(-1), out.view(-1), full_absmax.new_empty(blocks.numel()), signed)
        codes.copy_(out[row, self.slot].view(codes.shape))


# ---- the moments as state entries --------------------------------------------------------------
#: The two Adam moments: state key and whether bitsandbytes' signed map quantises it.
MOMENTS = (("exp_avg", True), ("exp_avg_sq", False))


def new_moments_8bit(
    state: dict[str, Any], prefix: str, shape: torch.Size, full_numel: int, buffers: Buffers, device: torch.device
) -> None:
    """Zero 8-bit moments ``{prefix}exp_avg[_sq]`` (codes of ``shape``) with the absmax of the
    blocks of a tensor of ``full_numel`` elements: any code with absmax 0 dequantises to 0, which
    is how bitsandbytes starts them."""
    blocks = -(-full_numel // BLOCKSIZE)
    for key, _ in MOMENTS:
        state[prefix + key] = buffers.zeros(shape, torch.uint8, device)
        state[f"{prefix}{key}_absmax"] = torch.zeros(blocks, dtype=torch.float32, device=device)


# ---- one 8-bit entry (any optimizer's moment) ---------------------------------------------------
def new_8bit(state: dict[str, Any], key: str, shape: torch.Size, full_numel: int, device: torch.device) -> None:
    """A zero 8-bit entry ``key`` (uint8 codes of ``shape``, this rank's piece) with ``key_absmax``,
    the absmax of every block of the full tensor of ``full_numel`` elements (replicated)."""
    state[key] = torch.zeros(shape, dtype=torch.uint8, device=device)
    state[f"{key}_absmax"] = torch.zeros(-(-full_numel // BLOCKSIZE), dtype=torch.float32, device=device)


def read_8bit(state: dict[str, Any], key: str, blocks: FullBlocks, signed: bool) -> torch.Tensor:
    """The fp32 values of the 8-bit entry ``key`` (a new tensor, this rank's piece)."""
    return blocks.dequantize_blockwise_8bit(state[key], state[f"{key}_absmax"], signed)


class Requant(NamedTuple):
    """New fp32 ``values`` to store as the 8-bit entry ``key`` of ``state`` (see :func:`write_8bit_many`)."""

    state: dict[str, Any]
    key: str
    blocks: FullBlocks
    values: torch.Tensor
    signed: bool


def write_8bit_many(entries: list[Requant]) -> None:
    """Quantise every entry's values into its state (codes and block absmax). Blocks are those of
    the full tensor (:class:`FullBlocks`): for a tensor held in pieces each block's absmax is the
    maximum over the ranks that hold a piece of it, reduced for all the entries at once (one
    all-reduce per process group), so that every code equals the single-device one."""
    maxes = comm.MaxBucket()
    reduced = [
        None if e.blocks.whole else maxes.add(e.blocks.amax(e.values), e.blocks.layout.sum_groups) for e in entries
    ]
    maxes.flush()
    for e, absmax in zip(entries, reduced):
        e.blocks.quantize_into(e.values, absmax, e.state[e.key], e.state[f"{e.key}_absmax"], e.signed)


def start_8bit(
    state: dict[str, Any], key: str, blocks: FullBlocks, signed: bool, shape: torch.Size, device: torch.device
) -> torch.Tensor:
    """The fp32 values of the 8-bit entry ``key`` (this rank's piece, of ``shape``), creating the
    entry where it is not 8-bit yet: absent (zeros, as bitsandbytes starts a moment) or a 32-bit
    tensor (a state saved with ``optim_bits=32`` or converted from another optimizer), whose
    values are returned to be stored quantised by :func:`write_8bit_many`."""
    value = state.get(key)
    if isinstance(value, torch.Tensor) and value.dtype == torch.uint8:
        return read_8bit(state, key, blocks, signed)
    new_8bit(state, key, shape, blocks.layout.full_numel, device)
    if not isinstance(value, torch.Tensor):
        return torch.zeros(shape, dtype=torch.float32, device=device)
    return value.to(device=device, dtype=torch.float32, copy=True).reshape(shape)


def to_32bit(state: dict[str, Any], key: str, blocks: FullBlocks, signed: bool, dtype: torch.dtype) -> None:
    """Replace the 8-bit entry ``key`` (codes and absmax) by its values in ``dtype``: a state saved
    with ``optim_bits=8`` loaded by an optimizer built with 32."""
    state[key] = read_8bit(state, key, blocks, signed).to(dtype)
    del state[f"{key}_absmax"]


class Batch8bit:
    """The 8-bit entries of one bucket (any optimizer's moments: Kron's and Muon's momentum,
    Shampoo's momentum buffer and block moments, LAMB's, CAME's and Muon's AdamW moments).

    :meth:`read` hands out an entry's fp32 values for the step to update in place (its codes
    dequantised; zeros for a new entry; the values of a 32-bit entry saved with ``optim_bits=32``,
    carried over) and :meth:`store` quantises all the handed-out values into their states at once
    (:func:`write_8bit_many`: one max-reduction of the block absmax per process group for the
    entries held in pieces, none for whole ones). :meth:`to_32bit` is the other direction: an
    8-bit entry loaded by an optimizer that keeps it in 32 bits, dequantised into the state.
    The :class:`FullBlocks` of a layout are made once per batch (shared by a parameter's entries)."""

    def __init__(self) -> None:
        self._entries: list[Requant] = []
        self._values: dict[tuple[int, str], torch.Tensor] = {}
        self._blocks: dict[tuple[int, str], tuple[ParamLayout, FullBlocks]] = {}

    def blocks(self, layout: ParamLayout, device: torch.device) -> FullBlocks:
        """The blocks of ``layout``'s full tensor on ``device`` (made once per batch)."""
        key = (id(layout), str(device))
        cached = self._blocks.get(key)
        if cached is None:  # the layout is kept alive with its blocks, so its id stays its own
            cached = self._blocks[key] = (layout, FullBlocks(layout, device))
        return cached[1]

    def read(
        self,
        state: dict[str, Any],
        key: str,
        signed: bool,
        layout: ParamLayout,
        like: torch.Tensor,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """The values of the 8-bit entry ``key`` of ``state`` (this rank's piece, of ``like``'s
        shape and device) in ``dtype``, a new tensor to update in place: stored quantised by
        :meth:`store`. An entry that is not 8-bit yet is made (:func:`start_8bit`: zeros, or the
        values of a 32-bit entry)."""
        blocks = self.blocks(layout, like.device)
        values = start_8bit(state, key, blocks, signed, like.shape, like.device).to(dtype)
        self._entries.append(Requant(state, key, blocks, values, signed))
        self._values[(id(state), key)] = values
        return values

    def value(self, state: dict[str, Any], key: str) -> torch.Tensor | None:
        """The values :meth:`read` handed out for ``state[key]`` since the last :meth:`store`."""
        return self._values.get((id(state), key))

    def to_32bit(
        self,
        state: dict[str, Any],
        key: str,
        signed: bool,
        layout: ParamLayout,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        """Replace ``state[key]`` by its values in ``dtype`` where it is an 8-bit entry (a state
        saved with ``optim_bits=8`` loaded by an optimizer that keeps it in 32 bits); local, no
        collective."""
        value = state.get(key)
        if isinstance(value, torch.Tensor) and value.dtype == torch.uint8:
            to_32bit(state, key, self.blocks(layout, device), signed, dtype)

    def __len__(self) -> int:
        return len(self._entries)

    def store(self) -> None:
        """Quantise every value handed out since the last call into its state (collective where an
        entry's tensor is held in pieces: call it on every rank of the bucket) and forget them."""
        entries, self._entries = self._entries, []
        self._values = {}
        if entries:
            write_8bit_many(entries)


# ---- paged memory ------------------------------------------------------------------------------
def paging_supported(device: torch.device) -> bool:
    """bitsandbytes' paged (CUDA unified) memory exists on CUDA devices only."""
    return device.type == "cuda"


def paged_on_device(buf: torch.Tensor, device: torch.device) -> torch.Tensor:
    """bitsandbytes' paged buffer as a tensor on ``device`` over the same memory.

    bitsandbytes (0.45-0.50) allocates paged state with ``cudaMallocManaged`` and hands it to
    torch through ``torch.frombuffer``, so torch sees a CPU tensor; its own paged optimizers only
    pass the pointer to their CUDA kernels, but our update mixes the moments with CUDA tensors in
    torch operations, which refuse a CPU operand. Managed memory is addressable from the device
    with the same pointer, so the buffer is re-described as a CUDA tensor (``__cuda_array_interface__``,
    as bytes, then viewed in its dtype and shape); ``is_paged`` and ``page_deviceid`` are kept for
    ``prefetch_tensor``. A buffer already on ``device`` is returned as it is. bitsandbytes never
    frees managed buffers, so the view cannot outlive its memory."""
    if buf.device == device:
        return buf
    nbytes = buf.numel() * buf.element_size()

    class _Managed:
        __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (buf.data_ptr(), False), "version": 3}

    out = torch.as_tensor(_Managed(), device=device).view(buf.dtype).view(buf.shape)
    out.is_paged = True  # type: ignore[attr-defined]
    out.page_deviceid = getattr(buf, "page_deviceid", device.index)  # type: ignore[attr-defined]
    return out


class Buffers:
    """Where state buffers live: ordinary zero tensors, or with ``is_paged`` bitsandbytes' paged
    memory for buffers of at least :data:`PAGED_MIN_NUMEL` elements on CUDA (as its paged
    optimizers do). On other devices paging is refused once, with a warning, naming ``owner``."""

    def __init__(self, is_paged: bool, owner: str) -> None:
        self.is_paged = is_paged
        self.owner = owner
        self._warned = False

    def zeros(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        if self.is_paged and paging_supported(device) and numel >= PAGED_MIN_NUMEL:
            import bitsandbytes.functional as bnbf

            buf = paged_on_device(bnbf.get_paged(*shape, dtype=dtype, device=device), device)
            buf.zero_()
            return buf
        if self.is_paged and not paging_supported(device) and not self._warned:
            self._warned = True
            warnings.warn(
                f"{self.owner}: is_paged=True needs CUDA (bitsandbytes' paged memory); on "
                f"{device.type} the states are ordinary tensors",
                stacklevel=5,
            )
        return torch.zeros(shape, dtype=dtype, device=device)

    def prefetch(self, *tensors: torch.Tensor) -> None:
        """Ask bitsandbytes to bring paged buffers to their device before they are used."""
        if not self.is_paged:
            return
        for t in tensors:
            if getattr(t, "is_paged", False):
                import bitsandbytes.functional as bnbf

                bnbf.prefetch_tensor(t)


# ---- bitsandbytes' arguments -------------------------------------------------------------------
def quant_args(args: Any, owner: str) -> dict[str, Any]:
    """Read bitsandbytes-style quantisation arguments (a MockArgs object or a dict).

    ColossalAI's ``cast_to_distributed`` passes ``args=optim.args`` for its GaLoreAdamW8bit:
    bitsandbytes' ``MockArgs`` with ``optim_bits``, ``min_8bit_size`` and, depending on the
    bitsandbytes version, ``percentile_clipping``, ``block_wise``, ``max_unorm``, ``skip_zeros``.
    Options we cannot honour raise ValueError (naming ``owner``)."""
    get = args.get if isinstance(args, Mapping) else (lambda k, d=None: getattr(args, k, d))
    out: dict[str, Any] = {}
    for key in ("optim_bits", "min_8bit_size"):
        value = get(key)
        if value is not None:
            out[key] = int(value)
    bad = []
    if get("percentile_clipping", 100) != 100:
        bad.append(f"percentile_clipping={get('percentile_clipping')!r}")
    if not get("block_wise", True):
        bad.append("block_wise=False")
    if get("max_unorm", 0.0):
        bad.append(f"max_unorm={get('max_unorm')!r}")
    if get("skip_zeros", False):
        bad.append("skip_zeros=True")
    if bad:
        raise ValueError(
            f"{owner}: bitsandbytes option(s) " + ", ".join(bad) + " are not supported "
            "(only percentile_clipping=100, block_wise=True, max_unorm=0, skip_zeros=False)"
        )
    return out
