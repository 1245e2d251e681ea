"""What GaLore keeps per parameter, and one GaLore parameter's view in a step.

``optimizer.state[p]`` holds tensors only, so that it can be checkpointed and does not depend on
the layout (galore_torch keeps a projector object instead):

* every parameter: ``step`` (fp32 scalar, its own steps: those with a gradient);
* GaLore parameters: ``proj_left`` (``M x r``) and/or ``proj_right`` (``r x N``) in the projector
  dtype; ``low_rank_exp_avg`` / ``low_rank_exp_avg_sq`` of the low-rank shape. Where ranks share a
  matrix, each keeps only its partition of these (:func:`state_partitions`, the rule of
  :mod:`dist_optim.sharding.partition`): a projector over the matrix's work group, the low-rank moments over
  the ranks that hold its pieces; :meth:`~dist_optim.galore.DistributedGaLore.full_state` assembles
  the full tensors;
* plain parameters: ``exp_avg`` / ``exp_avg_sq``, shaped (and sharded) like the parameter;
* 8-bit moments: uint8 codes under the moment's name plus ``<name>_absmax`` (fp32, one per block of
  256 values of the full tensor; :mod:`dist_optim.states.bnb`). Moments saved with the other
  ``optim_bits`` are carried over to the width kept at the next step (:func:`carry_over`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..layout import ParamLayout
from ..states import bnb, codecs
from .geometry import low_rank_shape, projection_side, projector_shapes

__all__ = [
    "GaLoreMatrix",
    "new_item",
    "low_rank_numel",
    "stored_projectors",
    "keeps_saved_dtype",
    "MOMENTS",
    "LOW_RANK",
    "STATE",
    "read_moments",
    "write_moments",
    "carry_over",
    "init_low_rank_state",
    "init_plain_state",
    "projector_numel",
    "state_partitions",
]


class GaLoreMatrix:
    """One GaLore parameter in one step: its group, gradient, layout, projection side, state,
    whether its projectors are refreshed, the groups its projectors are partitioned over (set by the
    optimizer: the work group's, or none) and the groups its low-rank moments are partitioned over
    besides its ``sum_groups`` (``replicas``: the TP group of a matrix TP replicates), and (set
    during the step) its whole projectors in the
    gradient's dtype and its low-rank gradient (this rank's partition of the sum)."""

    __slots__ = (
        "group",
        "param",
        "grad",
        "layout",
        "side",
        "state",
        "refresh",
        "proj_groups",
        "replicas",
        "proj",
        "low",
    )

    def __init__(
        self,
        group: dict[str, Any],
        param: torch.Tensor,
        grad: torch.Tensor,
        layout: ParamLayout,
        side: str,
        state: dict[str, Any],
        refresh: bool,
    ) -> None:
        self.group = group
        self.param = param
        self.grad = grad
        self.layout = layout
        self.side = side
        self.state = state
        self.refresh = refresh
        self.proj_groups: tuple[Any, ...] = ()
        self.replicas: tuple[Any, ...] = ()
        self.proj: tuple[torch.Tensor, torch.Tensor] | None = None
        self.low: torch.Tensor | None = None


def new_item(
    group: dict[str, Any], param: torch.Tensor, grad: torch.Tensor, layout: ParamLayout, state: dict[str, Any]
) -> GaLoreMatrix:
    """The parameter's item for this step (its ``step`` made at its first); its projectors are
    refreshed at its first step and every ``update_proj_gap`` of its steps."""
    side = projection_side(layout.full_shape, group["proj_type"])
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32)
    step = int(state["step"])
    has_proj = ("proj_left" in state) or ("proj_right" in state)
    refresh = (not has_proj) or step % int(group["update_proj_gap"]) == 0
    return GaLoreMatrix(group, param, grad, layout, side, state, refresh)


def low_rank_numel(item: GaLoreMatrix) -> int:
    """Elements of the item's low-rank gradient (its full low-rank shape)."""
    rows, cols = low_rank_shape(item.layout.full_shape, item.side, int(item.group["rank"]))
    return rows * cols


def projector_numel(item: GaLoreMatrix) -> int:
    """Elements of the item's whole projectors (``M r`` and/or ``r N``)."""
    shapes = projector_shapes(item.layout.full_shape, item.side, int(item.group["rank"]))
    return sum(math.prod(s) for s in shapes.values())


#: How one partitioned state entry is kept: its full shape, the groups it is partitioned over and the
#: alignment of its parts (:func:`dist_optim.sharding.partition.partition_span`).
Partitioned = tuple[tuple[int, ...], tuple[Any, ...], int]


def state_partitions(
    layout: ParamLayout,
    side: str,
    rank: int,
    proj_groups: tuple[Any, ...],
    eight_bit: bool,
    replicas: tuple[Any, ...] = (),
) -> dict[str, Partitioned]:
    """How each entry of a GaLore parameter's state is partitioned: the projectors over
    ``proj_groups`` (the work group's process group where it has more than one rank: every rank of it
    needs whole projectors to project its pieces, and gets them by one all-gather per bucket), the
    low-rank moments over ``layout.sum_groups`` (the ranks that hold pieces of the matrix, whose
    partial low-rank gradients are summed: a reduce-scatter gives each rank its partition of the
    sum) and then ``replicas`` (groups whose ranks hold the same sum: each keeps its part of it),
    8-bit codes aligned to whole blocks and their absmax partitioned as the blocks are. Entries with
    no groups of more than one rank are whole."""
    low = low_rank_shape(layout.full_shape, side, rank)
    out: dict[str, Partitioned] = {
        key: (shape, proj_groups, 1) for key, shape in projector_shapes(layout.full_shape, side, rank).items()
    }
    groups = layout.sum_groups + replicas
    for e in MOMENTS:
        if not eight_bit:
            out[LOW_RANK + e.name] = (low, groups, 1)
            continue
        (codes, _, _), (absmax, blocks, _) = e.codec.stored(LOW_RANK + e.name, low, torch.float32)
        out[codes] = (low, groups, bnb.BLOCKSIZE)
        out[absmax] = (blocks, groups, 1)
    return out


def stored_projectors(state: dict[str, Any], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored projectors in the dtype they multiply (fp16-stored ones are widened per use:
    r x N or M x r, small next to the matrix). A side without one gets an empty tensor: a
    projection that used it would fail on shapes, never compute with a stale value."""
    left, right = state.get("proj_left"), state.get("proj_right")
    absent = torch.empty(0, dtype=dtype)
    return (absent if left is None else left.to(dtype), absent if right is None else right.to(dtype))


#: The AdamW moments, bitsandbytes' 8-bit codes with ``optim_bits=8``: a plain parameter's under
#: these names, a GaLore parameter's low-rank ones after :data:`LOW_RANK`.
MOMENTS = (codecs.Entry("exp_avg", codecs.BNB_SIGNED), codecs.Entry("exp_avg_sq", codecs.BNB_UNSIGNED))
LOW_RANK = "low_rank_"
STATE = codecs.StateSpec(MOMENTS + tuple(codecs.Entry(LOW_RANK + e.name, e.codec) for e in MOMENTS))


def read_moments(state: dict[str, Any], prefix: str, blocks: bnb.FullBlocks) -> list[torch.Tensor]:
    """The fp32 values of the 8-bit moments under ``prefix`` (:data:`MOMENTS` order)."""
    return [e.codec.decode(state, prefix + e.name, blocks=blocks) for e in MOMENTS]


def write_moments(
    state: dict[str, Any],
    prefix: str,
    blocks: bnb.FullBlocks,
    values: list[torch.Tensor],
    absmax: list[torch.Tensor] | None = None,
) -> None:
    """Encode the moments ``values`` (:func:`read_moments` order) into their 8-bit entries;
    ``absmax`` their reduced block absmax when the tensor is held in pieces."""
    for i, (e, value) in enumerate(zip(MOMENTS, values)):
        e.codec.encode(value, state, prefix + e.name, blocks=blocks, absmax=None if absmax is None else absmax[i])


def carry_over(
    state: dict[str, Any], prefix: str, layout: ParamLayout, like: torch.Tensor, eight_bit: bool, batch: bnb.Batch8bit
) -> None:
    """Bring the moments under ``prefix`` that were saved with the other ``optim_bits`` to the width
    kept (``eight_bit``), through their codecs: a 32-bit moment is handed to ``batch`` to be quantised
    by ``batch.store()`` (its values, not zeros: collective where ``layout`` is held in pieces, on
    every rank of it), an 8-bit one dequantised into ``like``'s dtype (local). ``like``: the tensor
    the moments are shaped as (this rank's piece, or partition of the low-rank gradient).

    A state dict holds this rank's partitions, whose bounds depend on the width (8-bit ones are whole
    blocks): one saved with the other width where they are partitioned is refused by name, as only
    ``load_full_state`` can cut the full moments anew."""
    for e in MOMENTS:
        key = prefix + e.name
        value = state.get(key)
        if not isinstance(value, torch.Tensor) or e.codec.holds(value) == eight_bit:
            continue
        if value.numel() != like.numel():
            raise ValueError(
                f"DistributedGaLore: state {key!r} saved with the other optim_bits holds {value.numel()} elements "
                f"where this rank keeps {like.numel()} (partitions of another width); load it with load_full_state"
            )
        if eight_bit:
            e.codec.read(batch, state, key, layout, like)
        else:
            e.codec.to_plain(batch, state, key, layout, like.device, like.dtype)


def keeps_saved_dtype(key: str, value: torch.Tensor) -> bool:
    """8-bit codes, their fp32 absmax and projectors stored in ``proj_dtype`` keep their saved
    dtype on load (torch's loader would cast them to the parameter's dtype)."""
    return STATE.keeps_saved_dtype(key, value) or key.startswith("proj_")


def init_low_rank_state(state: dict[str, Any], low: torch.Tensor, eight_bit: bool, buffers: bnb.Buffers) -> None:
    """Zero low-rank moments of ``low``'s shape: 8-bit codes and absmax, or in ``low``'s dtype."""
    if eight_bit:
        bnb.new_moments_8bit(state, "low_rank_", low.shape, low.numel(), buffers, low.device)
    else:
        state["low_rank_exp_avg"] = buffers.zeros(low.shape, low.dtype, low.device)
        state["low_rank_exp_avg_sq"] = buffers.zeros(low.shape, low.dtype, low.device)


def init_plain_state(
    state: dict[str, Any], p: torch.Tensor, full_numel: int, eight_bit: bool, buffers: bnb.Buffers
) -> None:
    """A plain parameter's first state: ``step`` and zero moments (8-bit: blocks of the full tensor)."""
    state["step"] = torch.zeros((), dtype=torch.float32)
    if eight_bit:
        bnb.new_moments_8bit(state, "", p.shape, full_numel, buffers, p.device)
    else:
        state["exp_avg"] = buffers.zeros(p.shape, p.dtype, p.device)
        state["exp_avg_sq"] = buffers.zeros(p.shape, p.dtype, p.device)
