"""Drop-in ColossalAI booster plugins that swap in dist_optim's optimizers.

Change one import line::

    from dist_optim.plugins import HybridParallelPlugin   # was: from colossalai.booster.plugin import ...

and ``booster.boost(model, optimizer, ...)`` replaces an ordinary optimizer (torch, transformers,
torch_optimizer, colossalai, ... see ``dist_optim.registry``) by its dist_optim equivalent with the
same groups and hyperparameters, lets ColossalAI wrap it, then binds it to the real layouts read
from ColossalAI's wrapper: the TP split of every working param, ZeRO's master→working map and
padding, and the group that really sharded each param (also under bf16/fp16, where the fp32
masters have lost their TP annotation). Optimizers without an equivalent (e.g. AdamW, which is
element-wise and already exact under TP/ZeRO) pass through unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from colossalai.accelerator import get_accelerator
from colossalai.booster.plugin import GeminiPlugin as _GeminiPlugin
from colossalai.booster.plugin import HybridParallelPlugin as _HybridParallelPlugin
from colossalai.booster.plugin import LowLevelZeroPlugin as _LowLevelZeroPlugin
from colossalai.booster.plugin import MoeHybridParallelPlugin as _MoeHybridParallelPlugin
from colossalai.booster.plugin import TorchDDPPlugin as _TorchDDPPlugin
from colossalai.booster.plugin import TorchFSDPPlugin as _TorchFSDPPlugin
from colossalai.booster.plugin.torch_fsdp_plugin import FSDPOptimizerWrapper, TorchFSDPModel
from colossalai.logging import get_dist_logger

from dist_optim.base import DistOptimizer
from dist_optim.comm import release_groups
from dist_optim.layout import local_layout
from dist_optim.registry import class_path, convert

from .checkpoint import DistOptimCheckpointMixin
from .colossal import as_colossal_optimizer, bind_from_wrapper, record_param_names, world_group
from .contract import plugin_binds
from .fsdp import FSDPBinding, empty_fragments, fill_empty_grads, fsdp_layouts
from .gemini import GeminiDistOptimizer, configure_gemini
from .qk_clip import watch_boosted

__all__ = [
    "HybridParallelPlugin",
    "MoeHybridParallelPlugin",
    "LowLevelZeroPlugin",
    "TorchDDPPlugin",
    "GeminiPlugin",
    "TorchFSDPPlugin",
    "swap_optimizer",
    "options_summary",
]


def _log(message: str) -> None:
    # ColossalAI's logger inspects the whole call stack (every frame's source) on every rank
    # before it checks the rank; the other ranks print nothing, so they skip the call.
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        get_dist_logger().info(f"dist_optim: {message}")


def options_summary(optimizer: torch.optim.Optimizer) -> str:
    """The options every parameter group runs with, as the swap log shows them (what the
    conversion made of the user's settings, e.g. transformers' relative_step), after our
    optimizers' NaN/Inf gradient policy (a conversion gives the default, ``"raise"``)."""
    parts = []
    if isinstance(optimizer, DistOptimizer):
        parts.append(f"nonfinite={optimizer.nonfinite!r}")
    for i, group in enumerate(optimizer.param_groups):
        opts = ", ".join(
            f"{k}={v.__name__ if inspect.isfunction(v) or inspect.isbuiltin(v) else repr(v)}"
            for k, v in group.items()
            if k != "params"
        )
        parts.append(f"group {i} ({len(group['params'])} params): {opts}")
    return "; ".join(parts)


def swap_optimizer(optimizer: torch.optim.Optimizer | None, lr_scheduler: Any = None) -> Any:
    """Our equivalent of ``optimizer`` (or the optimizer itself if it has none), ready for
    ColossalAI's wrappers; an LR scheduler built on the original is re-pointed at it."""
    if optimizer is None:
        return None
    # The groups of an earlier plugin, destroyed when it was collected, are freed only once
    # dist_optim's caches let them go (a notebook or sweep boosting plugin after plugin).
    release_groups()
    swapped = convert(optimizer, strict=False)
    if swapped is not optimizer:
        _log(f"swapped {class_path(type(optimizer))} for {class_path(type(swapped))}; {options_summary(swapped)}")
        if lr_scheduler is not None and getattr(lr_scheduler, "optimizer", None) is optimizer:
            lr_scheduler.optimizer = swapped
    if isinstance(swapped, DistOptimizer):
        as_colossal_optimizer(swapped)
    return swapped


def _with_dist_optim_checkpoints(io: Any, writer: Callable[[], bool]) -> Any:
    """ColossalAI's checkpoint IO of a plugin, with our optimizers saved in the layout-independent
    format (see plugins/checkpoint.py); everything else is unchanged."""
    cls = type(io)
    sub = type(cls.__name__, (DistOptimCheckpointMixin, cls), {"__module__": __name__})
    wrapped: Any = object.__new__(sub)
    wrapped.__dict__.update(io.__dict__)
    wrapped._dist_optim_is_writer = writer
    return wrapped


def _rank0(*groups: Any) -> Callable[[], bool]:
    return lambda: all(g is None or torch.distributed.get_rank(g) == 0 for g in groups)


class _SwapAndBind:
    """What every drop-in plugin adds to ColossalAI's: swap the optimizer before ColossalAI wraps
    it, bind it to the real layouts after, and save it in the layout-independent format."""

    def _bind(self, wrapper: Any) -> None:
        raise NotImplementedError

    def _checkpoint_writer(self) -> Callable[[], bool]:
        return _rank0(world_group())

    def configure(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Callable | None = None,
        dataloader: Any = None,
        lr_scheduler: Any = None,
    ) -> tuple[Any, ...]:
        optimizer = swap_optimizer(optimizer, lr_scheduler)
        with plugin_binds(optimizer):
            out = super().configure(model, optimizer, criterion, dataloader, lr_scheduler)  # type: ignore[misc]
        model, wrapper = out[0], out[1]
        if wrapper is not None and isinstance(getattr(wrapper, "optim", None), DistOptimizer):
            self._bind(wrapper)
            record_param_names(wrapper, model)
            watch_boosted(self, model, wrapper.optim)
        return out

    def get_checkpoint_io(self) -> Any:
        return _with_dist_optim_checkpoints(super().get_checkpoint_io(), self._checkpoint_writer())  # type: ignore[misc]


class HybridParallelPlugin(_SwapAndBind, _HybridParallelPlugin):
    """``colossalai.booster.plugin.HybridParallelPlugin`` that swaps and binds dist_optim optimizers."""

    def _bind(self, wrapper: Any) -> None:
        bind_from_wrapper(wrapper, self.tp_group, self.dp_group)
        if self.pp_size > 1:
            changed = wrapper.optim.use_layout_independent_randomness()
            if changed:
                _log(f"{type(wrapper.optim).__name__} under pipeline parallelism: {changed}")

    def _state_replicas(self) -> Any:
        """The data-parallel group over which full_state() is replicated."""
        return self.dp_group

    def _checkpoint_writer(self) -> Callable[[], bool]:
        # One writer per pipeline stage: after full_state() the state is replicated over TP, the
        # data-parallel replicas and SP.
        sp = self.sp_group if self.sp_group is not self.tp_group else None
        return _rank0(self.tp_group, self._state_replicas(), sp)


class MoeHybridParallelPlugin(HybridParallelPlugin, _MoeHybridParallelPlugin):
    """``colossalai.booster.plugin.MoeHybridParallelPlugin`` that swaps and binds dist_optim
    optimizers. Expert parameters are ZeRO-sharded over the MoE data-parallel group; the binding
    reads each parameter's group from ColossalAI's optimizer wrapper, so their statistics are
    reduced over the ranks that hold pieces of the same expert."""

    def _state_replicas(self) -> Any:
        # Expert state is replicated over the MoE data-parallel group only: one writer per set of
        # experts (and pipeline stage); the shared parameters' state is written by each of them,
        # identically, and merged by name.
        return self.moe_dp_group


class LowLevelZeroPlugin(_SwapAndBind, _LowLevelZeroPlugin):
    """``colossalai.booster.plugin.LowLevelZeroPlugin`` that swaps and binds dist_optim optimizers."""

    def _bind(self, wrapper: Any) -> None:
        bind_from_wrapper(wrapper, None, world_group())


class TorchDDPPlugin(_SwapAndBind, _TorchDDPPlugin):
    """``colossalai.booster.plugin.TorchDDPPlugin`` that swaps dist_optim optimizers in.

    Parameters are whole and replicated under DDP; the optimizer is bound with the world as its
    data-parallel group so that optimizers which split per-parameter work can share it out.
    """

    def _bind(self, wrapper: Any) -> None:
        optim = wrapper.optim
        optim.bind({p: local_layout(p) for g in optim.param_groups for p in g["params"]}, dp_group=world_group())


class GeminiPlugin(_GeminiPlugin):
    """``colossalai.booster.plugin.GeminiPlugin`` that swaps dist_optim optimizers in and steps them
    in Gemini's chunks (plugins/gemini.py): every parameter bound to its flat ranges of the chunk
    shards over Gemini's ZeRO group (whole where a chunk is kept gathered; a rank whose shards miss
    it holds an empty piece and still takes part in its collectives), handed gradients in the fp32
    masters' dtype already divided by the loss scale and clipping factor, and saved in the
    layout-independent checkpoint format. Our optimizers run with static placement without offload,
    master weights and ``tp_size=1`` (``plugins.gemini.SUPPORTED``): offloading placements, which
    this CPU-tested code does not follow, and the rest are refused at boost with the setting to use.
    Other optimizers behave as with ColossalAI's plugin (its own Adam classes only)."""

    def configure(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Callable | None = None,
        dataloader: Any = None,
        lr_scheduler: Any = None,
    ) -> tuple[Any, ...]:
        optimizer = swap_optimizer(optimizer, lr_scheduler)
        if not isinstance(optimizer, DistOptimizer):
            return super().configure(model, optimizer, criterion, dataloader, lr_scheduler)
        model, wrapper = configure_gemini(self, model, optimizer, self._bind)
        record_param_names(wrapper, model)
        watch_boosted(self, model, optimizer)
        return model, wrapper, criterion, dataloader, lr_scheduler

    def _bind(self, wrapper: GeminiDistOptimizer) -> None:
        wrapper.optim.bind(wrapper.layouts, dp_group=self.zero_group, tp_group=self.tp_group)

    def get_checkpoint_io(self) -> Any:
        return _with_dist_optim_checkpoints(super().get_checkpoint_io(), _rank0(self.tp_group, self.zero_group))


class _FSDPOptimizer(FSDPOptimizerWrapper):
    """ColossalAI's FSDP optimizer wrapper, for an optimizer bound to FSDP's fragments: empty
    fragments get their empty gradient before a step, and clipping sees the whole model's norm
    (ColossalAI's wrapper would clip each rank's fragments by their own norm)."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: Any, binding: FSDPBinding) -> None:
        super().__init__(optimizer, model)
        self._empty = empty_fragments(binding, (p for g in optimizer.param_groups for p in g["params"]))

    def step(self, *args: Any, **kwargs: Any) -> Any:
        fill_empty_grads(self._empty)
        return self.optim.step(*args, **kwargs)

    def clip_grad_by_norm(self, max_norm: float | int, norm_type: float | int = 2.0, **kwargs: Any) -> Any:
        return self.model.module.clip_grad_norm_(max_norm, norm_type)


class TorchFSDPPlugin(_TorchFSDPPlugin):
    """``colossalai.booster.plugin.TorchFSDPPlugin`` that swaps dist_optim optimizers in and binds
    them to FSDP's fragments of the original parameters (``use_orig_params=True``, see
    plugins/fsdp.py): the single-device algorithm on any split, the user's param groups and
    options kept (ColossalAI's plugin re-creates the optimizer on FSDP's flat parameters, one
    group with the defaults), and checkpoints in the layout-independent format."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fsdp_kwargs["use_orig_params"] = True

    def configure(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Callable | None = None,
        dataloader: Any = None,
        lr_scheduler: Any = None,
    ) -> tuple[Any, ...]:
        optimizer = swap_optimizer(optimizer, lr_scheduler)
        fsdp_model = TorchFSDPModel(model, device_id=get_accelerator().get_current_device(), **self.fsdp_kwargs)
        if self.fp8_communication:
            from colossalai.quantization.fp8 import fp8_compress_fsdp_grad_comm_hook, fp8_compress_fsdp_params_comm_hook
            from colossalai.quantization.utils import patch_fsdp_params_comm_hook

            patch_fsdp_params_comm_hook()
            fsdp_model.module.register_params_comm_hook(None, fp8_compress_fsdp_params_comm_hook)
            fsdp_model.module.register_comm_hook(None, fp8_compress_fsdp_grad_comm_hook)
        wrapper = None
        if optimizer is not None:
            # use_orig_params keeps the user's Parameter objects: the optimizer already holds them.
            binding = fsdp_layouts(fsdp_model.module)
            wrapper = _FSDPOptimizer(optimizer, fsdp_model, binding)
            if isinstance(optimizer, DistOptimizer):
                params = [p for g in optimizer.param_groups for p in g["params"]]
                optimizer.bind({p: binding.layouts[p] for p in params}, dp_group=world_group())
                # FSDP's fragments are the masters and the model's state dict gathers them: the
                # optimizer's checkpoint carries no separate masters (plugins/checkpoint.py).
                optimizer.param_names = {p: binding.names[p] for p in params}
                watch_boosted(self, fsdp_model, optimizer)
        return fsdp_model, wrapper, criterion, dataloader, lr_scheduler

    def get_checkpoint_io(self) -> Any:
        return _with_dist_optim_checkpoints(super().get_checkpoint_io(), _rank0(world_group()))
