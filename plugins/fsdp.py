"""PyTorch FSDP's fragments of the original parameters, as dist_optim layouts.

With ``use_orig_params=True`` FSDP (version 1) keeps the user's ``nn.Parameter`` objects and makes
each one a view of the part of its flat parameter that this rank holds: the flat parameter, every
parameter of an FSDP unit laid end to end, is cut by ``torch.chunk`` into one equal piece per rank,
so a parameter's fragment is a contiguous, unpadded range of it, anywhere, empty on the ranks whose
piece misses it. :func:`fsdp_layouts` reads those ranges for every rank (FSDP records only this
rank's), as flat-range :class:`~dist_optim.layout.ZeroShard` layouts; the optimizer's owner work
then gathers what a matrix needs, as under ZeRO.

An optimizer handed these fragments without their layout treats each as a tensor of its own (Meta's
Shampoo preconditions each FSDP fragment alone by design); bound here, every optimizer computes the
single-device algorithm. This module and
``plugins/colossal.py`` are the places that know framework internals; FSDP's are checked against
the rank's own record (``_shard_param_infos``) so that a torch whose internals moved fails at boost,
naming itself, instead of binding wrong ranges.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from dist_optim.layout import ParamLayout, ZeroShard, shard_bounds, whole_layout

__all__ = [
    "FSDPBinding",
    "fsdp_layouts",
    "clean_name",
    "empty_fragments",
    "fill_empty_grads",
    "fsdp_units",
    "decoder_layer_classes",
    "flat_param_bounds",
    "aligned_numel",
]


@dataclass
class FSDPBinding:
    """What binding an optimizer to an FSDP model needs: every parameter's layout, the flat
    parameter each sharded one lives in (whose gradient says whether a step has gradients for its
    empty fragments), and every parameter's name in the unwrapped model."""

    layouts: dict[torch.Tensor, ParamLayout]
    flat_of: dict[torch.Tensor, torch.Tensor]
    names: dict[torch.Tensor, str]


def clean_name(name: str) -> str:
    """A parameter's name in the model FSDP wrapped (FSDP inserts ``_fsdp_wrapped_module.``):
    checkpoints key state by it, whatever plugin saved them."""
    return name.replace("_fsdp_wrapped_module.", "")


def fsdp_layouts(model: torch.nn.Module) -> FSDPBinding:
    """The layout of every parameter of an FSDP-wrapped ``model`` built with ``use_orig_params=True``."""
    layouts: dict[torch.Tensor, ParamLayout] = {}
    flat_of: dict[torch.Tensor, torch.Tensor] = {}
    for unit in FSDP.fsdp_modules(model):
        handle = getattr(unit, "_handle", None)
        if handle is None:
            continue
        flat = handle.flat_param
        params = getattr(flat, "_params", None)
        if params is None:
            raise ValueError(
                "dist_optim: FSDP was built without use_orig_params=True, so the optimizer sees flat "
                "parameters mixing every tensor of a unit; build it with use_orig_params=True "
                "(dist_optim.plugins.TorchFSDPPlugin does)"
            )
        shapes = [tuple(int(s) for s in shape) for shape in flat._shapes]
        if not handle.uses_sharded_strategy:
            for p, shape in zip(params, shapes):
                layouts[p] = whole_layout(shape)
            continue
        size, rank, group = handle.world_size, handle.rank, handle.process_group
        width = flat._sharded_size.numel()
        # Every rank's piece of the flat parameter is [width * r, width * (r + 1)); FSDP keeps the
        # metadata of its own only, and computes it with this same function.
        infos = [handle._get_shard_metadata(width * r, width * (r + 1) - 1) for r in range(size)]
        if tuple(infos[rank]) != tuple(flat._shard_param_infos):
            raise RuntimeError(
                f"dist_optim: FSDP's shard metadata of torch {torch.__version__} does not match the ranges "
                "computed from it; this torch's FSDP internals changed, please report it"
            )
        for i, (p, shape) in enumerate(zip(params, shapes)):
            bounds = [0]
            for r in range(size):
                info = infos[r][i]
                if info.in_shard:
                    if info.intra_param_start_idx != bounds[-1]:
                        raise RuntimeError(f"dist_optim: FSDP's ranks do not hold parameter {i} in rank order")
                    bounds.append(info.intra_param_end_idx + 1)
                else:
                    bounds.append(bounds[-1])
            if bounds[-1] != math.prod(shape) or p.numel() != bounds[rank + 1] - bounds[rank]:
                raise RuntimeError(f"dist_optim: FSDP's fragments of parameter {i} do not tile its {shape} elements")
            layouts[p] = ParamLayout(shape, None, ZeroShard(size, rank, 0, group, tuple(bounds)))
            flat_of[p] = flat
    names: dict[torch.Tensor, str] = {p: clean_name(n) for n, p in model.named_parameters()}
    for p in names:
        if p not in layouts:  # outside every FSDP unit (ignored modules): whole on every rank
            layouts[p] = whole_layout(tuple(p.shape))
    return FSDPBinding(layouts, flat_of, names)


def empty_fragments(binding: FSDPBinding, params: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Those of ``params`` whose fragment on this rank is empty, each with its flat parameter
    (fixed once FSDP has sharded: looked up at bind, not every step)."""
    return [(p, binding.flat_of[p]) for p in params if p.numel() == 0 and p in binding.flat_of]


def fill_empty_grads(empty: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Give each empty fragment (:func:`empty_fragments`) an empty gradient where its flat
    parameter has one: FSDP leaves ``None`` there, which an optimizer reads as "no gradient this
    step" while the ranks holding the rest of the parameter step it, so their collectives differ."""
    for p, flat in empty:
        if p.grad is None and flat.grad is not None:
            p.grad = torch.empty_like(p)


# ---- FSDP's rule, for a model that is not wrapped (the planner's meta models) ----------------------
def decoder_layer_classes(model: torch.nn.Module) -> set[type]:
    """The class of a Hugging Face causal LM's decoder layers (``model.model.layers``): the FSDP
    unit the recipe wraps and the planner plans (empty without such layers)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return {type(layers[0])} if layers is not None and len(layers) else set()


def fsdp_units(model: torch.nn.Module, unit_classes: set[type]) -> dict[str, list[tuple[str, int]]]:
    """The parameters of each FSDP unit of ``model`` wrapped with ``ModuleWrapPolicy(unit_classes)``,
    as (name, numel) in FSDP's order, by the unit module's name: one unit per module of those
    classes (the innermost), and the root's unit (name ``""``) with everything else; a shared
    (tied) parameter where it first appears."""
    owner: dict[str, str] = {}
    for name, module in model.named_modules():
        if type(module) in unit_classes:
            for pname, _ in module.named_parameters(prefix=name):
                owner[pname] = name
    units: dict[str, list[tuple[str, int]]] = {}
    for name, p in model.named_parameters():
        units.setdefault(owner.get(name, ""), []).append((name, p.numel()))
    return units


def flat_param_bounds(
    units: Iterable[Sequence[tuple[str, int]]], world: int, aligned_numel: int
) -> dict[str, tuple[int, ...]]:
    """Every parameter's flat-range bounds over ``world`` ranks, by name, as torch 2.5's FSDP lays
    out a unit with ``use_orig_params=True`` (``FlatParamHandle._init_flat_param_and_metadata``):
    each parameter starts at a multiple of ``aligned_numel`` (16 bytes of the compute dtype), the
    unit is padded to a multiple of ``world``, and ``torch.chunk`` cuts it into one piece per rank.
    ``tests/distributed/test_fsdp.py`` checks it against FSDP's own ranges."""
    out: dict[str, tuple[int, ...]] = {}
    for unit in units:
        starts: list[tuple[str, int, int]] = []
        total = 0
        for name, numel in unit:
            if aligned_numel and total % aligned_numel:
                total += aligned_numel - total % aligned_numel
            starts.append((name, total, numel))
            total += numel
        if aligned_numel and total % world:
            total += world - total % world
        width = -(-total // world)
        for name, start, numel in starts:
            out[name] = shard_bounds(start, numel, width, world)
    return out


def aligned_numel(compute_dtype: torch.dtype) -> int:
    """FSDP's address alignment in elements of the dtype it computes in (``_get_aligned_numel``)."""
    return 16 // compute_dtype.itemsize
