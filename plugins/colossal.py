"""Everything dist_optim knows about ColossalAI's internals, in one module.

* how a working param says it is TP-split (``dist_layout`` sharding spec), or an expert split over
  MoeHybridParallelPlugin's expert-parallel group;
* how each optimizer wrapper maps the tensors the optimizer steps (fp32 masters, flat ZeRO
  shards) back to working params, and which process group really sharded each param;
* how to make ColossalAI's own ``isinstance(optim, DistributedOptim)`` check accept our classes.

Read against colossalai 0.5.0 (the same on its main branch at the time of writing).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from colossalai.interface.optimizer import DistributedOptim, OptimizerWrapper
from colossalai.tensor.d_tensor import get_sharding_spec, is_distributed_tensor
from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

from dist_optim.base import DistOptimizer
from dist_optim.layout import register_tp_reader

from .contract import ColossalContract, setup_distributed

__all__ = ["tp_dim_of", "is_expert", "bind_from_wrapper", "as_colossal_optimizer", "record_param_names"]


def tp_dim_of(working: torch.Tensor) -> int | None:
    """The dim a ColossalAI working param is sharded along, or None if it is replicated."""
    if not is_distributed_tensor(working):
        return None
    spec = get_sharding_spec(working)
    dims = [d for d, dim_spec in enumerate(spec.sharding_sequence) if not dim_spec.is_replica]
    if len(dims) > 1:
        raise ValueError(
            f"dist_optim supports 1-D tensor parallelism; a parameter of shape {tuple(working.shape)} is sharded "
            f"along dims {dims}"
        )
    return dims[0] if dims else None


register_tp_reader(tp_dim_of)


def is_expert(param: torch.Tensor) -> bool:
    """Whether ``param`` belongs to an expert that MoeHybridParallelPlugin split over its
    expert-parallel group (ColossalAI marks them when ShardFormer builds its EP MoE blocks; their
    ZeRO group is the MoE data-parallel group, not the data-parallel group)."""
    from colossalai.tensor.moe_tensor.api import is_moe_tensor

    return bool(is_moe_tensor(param))


def _single_group(pg: Any) -> Any:
    if isinstance(pg, tuple):
        raise ValueError(
            "dist_optim: ZeRO over a 2-D (extra_dp_group, dp_group) mesh is not supported; use a single ZeRO group"
        )
    return pg


def bind_from_wrapper(wrapper: OptimizerWrapper, tp_group: Any, dp_group: Any) -> None:
    """Bind the dist_optim optimizer inside a ColossalAI optimizer wrapper to the real layouts.

    ``dp_group`` is the data-parallel group (used to split per-parameter work); the group that
    ZeRO-sharded each parameter is read from the wrapper itself (dp×sp under sequence
    parallelism, the MoE dp group for experts), never assumed.
    """
    optim = wrapper.optim
    if not isinstance(optim, DistOptimizer):
        return
    if isinstance(wrapper, LowLevelZeroOptimizer):
        shard_map = wrapper.get_master_to_working_map()
        padding_map = wrapper.get_param_padding_map()
        param_to_pg = wrapper.param_to_pg

        def zero_group_of(working: torch.Tensor) -> Any:
            return _single_group(param_to_pg[working])

        # Masters are flat chunks even when the ZeRO group has one rank: keep the ZeRO layout
        # then too (ColossalAI itself passes is_zero=False there, and a factored optimizer would
        # take the flat master for a vector).
        setup_distributed(optim, tp_group, dp_group, shard_map, padding_map, True, zero_group_of=zero_group_of)
        return
    master_to_working = wrapper.get_master_to_working_map() if hasattr(wrapper, "get_master_to_working_map") else None
    setup_distributed(optim, tp_group, dp_group, {}, {}, False, master_to_working=master_to_working or {})


_COLOSSAL_CLASSES: dict[type, type] = {}


def as_colossal_optimizer(optimizer: DistOptimizer) -> DistOptimizer:
    """Make ``optimizer`` pass ColossalAI's ``isinstance(optim, DistributedOptim)`` check.

    Its class becomes a subclass of its own class, :class:`~dist_optim.plugins.contract.ColossalContract`
    and ColossalAI's ``DistributedOptim``; the contract's ``setup_distributed`` comes before
    ColossalAI's in the MRO, so ColossalAI's positional call reaches it.
    """
    cls = type(optimizer)
    if issubclass(cls, DistributedOptim):
        return optimizer
    sub = _COLOSSAL_CLASSES.get(cls)
    if sub is None:
        sub = type(
            cls.__name__,
            (cls, ColossalContract, DistributedOptim),
            {"__module__": cls.__module__, "__qualname__": cls.__qualname__},
        )
        _COLOSSAL_CLASSES[cls] = sub
    optimizer.__class__ = sub
    return optimizer


def world_group() -> Any:
    return dist.group.WORLD


def record_param_names(wrapper: OptimizerWrapper, model: Any) -> None:
    """Give the optimizer the model name of every tensor it steps (masters and shards included):
    checkpoints key state by name, which does not depend on the parallel layout."""
    optim = wrapper.optim
    module = model.unwrap() if hasattr(model, "unwrap") else model
    names = {id(p): n for n, p in module.named_parameters()}
    to_working = wrapper.get_master_to_working_map() if hasattr(wrapper, "get_master_to_working_map") else None
    out: dict[torch.Tensor, str] = {}
    for group in optim.param_groups:
        for p in group["params"]:
            working = to_working.get(id(p), p) if to_working else p
            if id(working) in names:
                out[p] = names[id(working)]
    optim.param_names = out
    # fp32 masters that are not the working params (ZeRO shards, mixed-precision copies): their
    # full precision exists nowhere else, so optimizer checkpoints carry them.
    optim.separate_masters = bool(to_working)
