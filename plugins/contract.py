"""ColossalAI's ``DistributedOptim`` contract, for dist_optim's optimizers.

ColossalAI's plugins call ``optim.setup_distributed(tp_group, dp_group, shard_to_working_param,
padding_map, is_zero)`` positionally on an optimizer that is a ``DistributedOptim``. The core
optimizers know nothing of it: they take layouts (:meth:`dist_optim.base.DistOptimizer.bind`).
Here the contract's arguments become layouts (:func:`colossal_layouts`, avoiding the traps of
docs/design.md, "The ColossalAI contract"), :func:`setup_distributed` binds an optimizer from them,
and :class:`ColossalContract` is the method ColossalAI calls, on the classes
:func:`dist_optim.plugins.colossal.as_colossal_optimizer` makes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from dist_optim.base import DistOptimizer
from dist_optim.comm import group_rank, group_size
from dist_optim.layout import ParamLayout, TPSplit, ZeroShard, read_tp_dim

__all__ = ["colossal_layouts", "setup_distributed", "ColossalContract", "plugin_binds"]


def colossal_layouts(
    params: list[torch.Tensor],
    tp_group: Any,
    dp_group: Any,
    shard_to_working_param: Mapping[int, torch.Tensor] | None,
    padding_map: Mapping[int, int] | None,
    is_zero: bool,
    master_to_working: Mapping[int, torch.Tensor] | None,
    zero_group_of: Callable[[torch.Tensor], Any] | None,
) -> tuple[dict[torch.Tensor, ParamLayout], bool]:
    """The layouts of ``params`` from ColossalAI's ``setup_distributed`` arguments (see
    :func:`setup_distributed`), and whether any parameter carries a TP split; a
    ValueError naming the parameter and the fix where the arguments do not describe them."""
    tp_size = group_size(tp_group) if tp_group is not None else 1
    shard_to_working_param = shard_to_working_param or {}
    padding_map = padding_map or {}
    if is_zero and dp_group is None and zero_group_of is None:
        raise ValueError("setup_distributed: is_zero=True needs the ZeRO group as dp_group")
    layouts: dict[torch.Tensor, ParamLayout] = {}
    saw_tp = False
    for i, p in enumerate(params):
        if is_zero:
            working = shard_to_working_param.get(id(p))
            if working is None:
                raise ValueError(
                    f"setup_distributed: parameter #{i} (a ZeRO shard of {p.numel()} elements) is missing "
                    "from shard_to_working_param; pass the ZeRO optimizer's get_master_to_working_map()"
                )
        else:
            working = (master_to_working or {}).get(id(p), shard_to_working_param.get(id(p), p))
        tp = None
        tp_dim = read_tp_dim(working) if tp_size > 1 else None
        full_shape = list(working.shape)
        if tp_dim is not None:
            saw_tp = True
            tp_dim %= working.dim()
            full_shape[tp_dim] *= tp_size
            tp = TPSplit(tp_dim, tp_size, group_rank(tp_group), tp_group)
        zero = None
        if is_zero:
            zgroup = zero_group_of(working) if zero_group_of is not None else dp_group
            zsize = group_size(zgroup)
            if id(working) not in padding_map:
                raise ValueError(
                    f"setup_distributed: parameter #{i}'s working param is missing from padding_map; "
                    "pass the ZeRO optimizer's get_param_padding_map()"
                )
            padding = int(padding_map[id(working)])
            if p.numel() * zsize != working.numel() + padding:
                raise ValueError(
                    f"setup_distributed: parameter #{i} is a chunk of {p.numel()} elements of a working param "
                    f"of {working.numel()} (+{padding} padding), which does not match a ZeRO group of size "
                    f"{zsize}; pass the group that really sharded it (zero_group_of=...)"
                )
            zero = ZeroShard(zsize, group_rank(zgroup), padding, zgroup)
        elif p.shape != working.shape:
            raise ValueError(
                f"setup_distributed: parameter #{i} has shape {tuple(p.shape)} but its working param has "
                f"{tuple(working.shape)}; with ZeRO pass is_zero=True"
            )
        layouts[p] = ParamLayout(tuple(full_shape), tp, zero)
    return layouts, saw_tp


def setup_distributed(
    optim: DistOptimizer,
    tp_group: Any = None,
    dp_group: Any = None,
    shard_to_working_param: Mapping[int, torch.Tensor] | None = None,
    padding_map: Mapping[int, int] | None = None,
    is_zero: bool = False,
    *,
    master_to_working: Mapping[int, torch.Tensor] | None = None,
    zero_group_of: Callable[[torch.Tensor], Any] | None = None,
) -> None:
    """Bind ``optim`` from ColossalAI's ``DistributedOptim`` arguments.

    Args:
        tp_group: tensor-parallel group; a working param is TP-split when the registered
            reader (``dist_optim.layout.register_tp_reader``) finds a split dim on it.
        dp_group: data-parallel group. With ``is_zero=False`` it is *not* a ZeRO group (ColossalAI
            passes it for ``zero_stage=0`` too); parameters are then whole on every dp rank.
        shard_to_working_param: ``id(master shard) -> working param`` under ZeRO.
        padding_map: ``id(working param) -> padding`` under ZeRO.
        is_zero: whether the optimizer's params are flat ZeRO chunks.
        master_to_working: ``id(fp32 master) -> working param`` for mixed precision without
            ZeRO, where the masters lost the TP annotation of their working params.
        zero_group_of: the group that really sharded a working param (defaults to
            ``dp_group``); e.g. dp x sp under sequence parallelism, the MoE dp group for experts.
    """
    tp_size = group_size(tp_group) if tp_group is not None else 1
    params = [p for group in optim.param_groups for p in group["params"]]
    layouts, saw_tp = colossal_layouts(
        params, tp_group, dp_group, shard_to_working_param, padding_map, is_zero, master_to_working, zero_group_of
    )
    if tp_size > 1 and not saw_tp and master_to_working is None and not is_zero:
        warnings.warn(
            f"{type(optim).__name__}.setup_distributed: tp_group has {tp_size} ranks but no parameter carries "
            "a TP split. Under bf16/fp16 the fp32 masters lose their working params' TP annotation: bind "
            "through dist_optim.plugins, or pass master_to_working=...",
            stacklevel=3,
        )
    optim.bind(layouts, dp_group=dp_group, tp_group=tp_group if tp_size > 1 else None)


#: The optimizers a dist_optim plugin is configuring (by id): ColossalAI's own positional
#: ``setup_distributed`` call is then ignored, the plugin binds right after it from the wrapper,
#: with the groups that really sharded each parameter (ColossalAI passes its dp group even when
#: ZeRO ran over dp x sp).
_CONFIGURING: set[int] = set()


class plugin_binds:  # noqa: N801 - used as a context manager, read as a phrase
    """``with plugin_binds(optim):`` a dist_optim plugin configures ``optim``: ColossalAI's
    positional ``setup_distributed`` call is ignored meanwhile."""

    def __init__(self, optim: Any) -> None:
        self._id = id(optim) if isinstance(optim, DistOptimizer) else None

    def __enter__(self) -> None:
        if self._id is not None:
            _CONFIGURING.add(self._id)

    def __exit__(self, *exc: object) -> None:
        if self._id is not None:
            _CONFIGURING.discard(self._id)


class ColossalContract:
    """The method ColossalAI's plugins call on a ``DistributedOptim``, mixed into our classes by
    :func:`dist_optim.plugins.colossal.as_colossal_optimizer` (before ``DistributedOptim`` in the MRO)."""

    def setup_distributed(self, *args: Any, **kwargs: Any) -> None:
        """ColossalAI's positional contract: :func:`setup_distributed` of this optimizer, unless a
        dist_optim plugin is configuring it (:class:`plugin_binds`)."""
        if id(self) in _CONFIGURING:
            return
        assert isinstance(self, DistOptimizer)
        setup_distributed(self, *args, **kwargs)
