"""Gemini's chunks as dist_optim layouts, and the optimizer wrapper that steps our optimizers in them.

Gemini lays every parameter of a model end to end in fixed-size chunks and cuts each chunk into one
equal shard per rank of its ZeRO group, so a parameter's piece on a rank is a contiguous, unpadded
range of it, anywhere, empty where the rank's shard misses it: FSDP's flat ranges again
(plugins/fsdp.py), read here from the chunk as :class:`~dist_optim.layout.ZeroShard` bounds. A chunk
Gemini keeps gathered (a model smaller than its minimum chunk size, ``strict_ddp_mode``) holds every
parameter whole on every rank.

ColossalAI's ``GeminiOptimizer`` hands its inner optimizer a "fake" parameter per range, only where
the range is non-empty, points it at the fp32 master chunk and the bf16/fp16 gradient chunk around
each step only, and passes ``div_scale`` (loss scale times clipping factor) for the optimizer to
apply. :class:`GeminiDistOptimizer` keeps that machinery and changes what ours needs: a fake
parameter for every parameter (an empty one takes part in the parameter's collectives), each bound
to its layout, handed its gradient in the master's dtype already divided by ``div_scale``, and
pointing at its master between steps too (binding, ``full_state`` and checkpoints read it).

This module and ``plugins/colossal.py`` are the places that know ColossalAI's internals (Gemini's
of colossalai 0.5.0: ``Chunk.tensors_info``, ``shard_size``, ``paired_chunk``, ``grad_chunk``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from colossalai.booster.plugin.gemini_plugin import get_param_info
from colossalai.utils import is_ddp_ignored
from colossalai.zero.gemini import gemini_optimizer
from colossalai.zero.gemini.chunk import Chunk
from colossalai.zero.gemini.gemini_ddp import GeminiDDP
from colossalai.zero.gemini.gemini_optimizer import GeminiOptimizer

from dist_optim.base import DistOptimizer
from dist_optim.layout import ParamLayout, ZeroShard, shard_bounds

__all__ = [
    "GeminiDistOptimizer",
    "chunk_layout",
    "local_range",
    "check_gemini_options",
    "configure_gemini",
    "SUPPORTED",
]

#: The Gemini settings our optimizers run under (what the refusals name).
SUPPORTED = 'placement_policy="static", offload_optim_frac=0.0, offload_param_frac=0.0, master_weights=True, tp_size=1'


def chunk_layout(chunk: Chunk, param: torch.Tensor) -> ParamLayout:
    """The layout of ``param``'s piece in this rank's shard of ``chunk`` (its Gemini chunk): flat
    ranges over the chunk's ZeRO group, or the whole parameter when the chunk is kept gathered."""
    info = chunk.tensors_info[param]
    shape = tuple(int(s) for s in param.shape)
    if chunk.keep_gathered:
        return ParamLayout(shape)
    bounds = shard_bounds(info.offset, info.end - info.offset, chunk.shard_size, chunk.pg_size)
    return ParamLayout(shape, None, ZeroShard(chunk.pg_size, chunk.pg_rank, 0, chunk.torch_pg, bounds))


def local_range(chunk: Chunk, param: torch.Tensor) -> tuple[int, int]:
    """Where ``param``'s piece lies in this rank's payload of ``chunk`` (possibly empty)."""
    info = chunk.tensors_info[param]
    if chunk.keep_gathered:
        return info.offset, info.end
    begin = min(max(info.offset - chunk.shard_begin, 0), chunk.shard_size)
    return begin, max(begin, min(chunk.shard_size, info.end - chunk.shard_begin))


class GeminiDistOptimizer(GeminiOptimizer):
    """``GeminiOptimizer`` for a dist_optim optimizer (module docstring)."""

    def __init__(self, optim: DistOptimizer, module: GeminiDDP, **kwargs: Any) -> None:
        self.working_of: dict[torch.Tensor, torch.Tensor] = {}
        self.layouts: dict[torch.Tensor, ParamLayout] = {}
        # ColossalAI asserts its own Adam classes, whose checkpoint code it alone knows; ours are
        # saved by plugins/checkpoint.py.
        accepted = gemini_optimizer._AVAIL_OPTIM_LIST
        added = type(optim) not in accepted
        accepted.add(type(optim))
        try:
            super().__init__(optim, module, **kwargs)
        finally:
            if added:
                accepted.discard(type(optim))
        self.point_masters()

    def _GeminiOptimizer__init__optimizer(self) -> None:  # noqa: N802 - overrides GeminiOptimizer.__init__optimizer
        """A fake parameter for every parameter, empty where this rank's shard misses it."""
        param_id = -1
        for group in self.optim.param_groups:
            fakes, ids = [], []
            backup = {k: v for k, v in group.items() if k != "params"}
            for param in group["params"]:
                param_id += 1
                self.id_to_real_params[param_id] = param
                ids.append(param_id)
                if is_ddp_ignored(param):
                    continue
                chunk16 = self.chunk_manager.get_chunk(param)
                fake = torch.nn.Parameter(torch.empty([0], device=self.module.grads_device[param]))
                self.param_to_chunk16[fake] = chunk16
                self.param_to_range[fake] = local_range(chunk16, param)
                self.id_to_fake_params[param_id] = fake
                self.working_of[fake] = param
                self.layouts[fake] = chunk_layout(chunk16, param)
                fakes.append(fake)
            group["params"] = fakes
            backup["params"] = ids
            self.param_groups_backup.append(backup)

    def get_master_to_working_map(self) -> dict[int, torch.Tensor]:
        return {id(fake): working for fake, working in self.working_of.items()}

    def _view(self, fake: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        layout = self.layouts[fake]
        return flat if layout.zero is not None else flat.view(layout.local_shape)

    def point_masters(self) -> None:
        """Point every fake parameter at its range of the fp32 master chunk (which stays where it
        is between steps under the placements ours run with)."""
        for fake, chunk16 in self.param_to_chunk16.items():
            begin, end = self.param_to_range[fake]
            fake.data = self._view(fake, chunk16.paired_chunk.payload[begin:end])

    def _hand_gradients(self, div_scale: float) -> None:
        """Each fake parameter's gradient: its range of the reduced gradient chunk in the master's
        dtype, divided by ``div_scale`` (-1: nothing to divide by), as the single-device algorithm
        expects it."""
        self.point_masters()
        reuse = self.module.chunk_manager.reuse_fp16_chunk
        for fake, chunk16 in self.param_to_chunk16.items():
            begin, end = self.param_to_range[fake]
            grad_chunk = chunk16 if reuse else chunk16.grad_chunk
            grad = grad_chunk.payload[begin:end].to(fake.dtype, copy=True)
            if div_scale > 0:
                grad.div_(div_scale)
            fake.grad = self._view(fake, grad)

    def _update_fp16_params(self) -> None:
        for fake in self.param_to_chunk16:
            assert fake.grad is None
        for chunk16 in self.chunk16_set:
            chunk16.optim_update()
        self.point_masters()

    def step(self, *args: Any, **kwargs: Any) -> Any:
        if self.mix_precision_mixin.should_skip_step():
            self._clear_global_norm()
            self.zero_grad()
            if self.module.chunk_manager.reuse_fp16_chunk:
                self._update_fp16_params()  # the gradients overwrote the working weights: restore them
            return None
        self._hand_gradients(self._get_combined_scale())
        ret = self.optim.step(*args, **kwargs)
        self._register_states()
        self.zero_grad()
        self._update_fp16_params()
        self.module.chunk_manager.accumulating_grads = False
        return ret


def check_gemini_options(plugin: Any, optimizer: DistOptimizer) -> None:
    """Refuse, before anything is wrapped, the Gemini settings our optimizers are not run with."""
    config = plugin.gemini_config
    name = type(optimizer).__name__
    offload = {k: config[k] for k in ("offload_optim_frac", "offload_param_frac") if config[k]}
    if config["placement_policy"] != "static" or offload:
        raise ValueError(
            f"GeminiPlugin with {name}: placement_policy={config['placement_policy']!r} "
            f"{offload or ''} moves masters and gradients between host and device, which dist_optim does not follow "
            f"yet; use {SUPPORTED}, or LowLevelZeroPlugin(cpu_offload=True) to keep optimizer states in host memory"
        )
    if not config["master_weights"]:
        raise ValueError(
            f"GeminiPlugin with {name}: master_weights=False steps the bf16/fp16 working chunks, which Gemini moves "
            f"between steps; use master_weights=True"
        )
    if plugin.tp_size > 1:
        raise ValueError(
            f"GeminiPlugin with {name}: tp_size={plugin.tp_size} is not run with dist_optim's optimizers yet; use "
            "tp_size=1, or HybridParallelPlugin(tp_size=..., zero_stage=...) for tensor parallelism with ZeRO"
        )
    if plugin.extra_dp_size > 1:
        raise ValueError(
            f"GeminiPlugin with {name}: extra_dp_size={plugin.extra_dp_size} replicates Gemini's shards, which "
            "dist_optim does not bind yet; use extra_dp_size=1"
        )


def configure_gemini(
    plugin: Any, model: torch.nn.Module, optimizer: DistOptimizer, bind: Callable[[GeminiDistOptimizer], None]
) -> tuple[GeminiDDP, GeminiDistOptimizer]:
    """What ``GeminiPlugin.configure`` does with a model and an optimizer, with
    :class:`GeminiDistOptimizer` in place of ``GeminiOptimizer``; ``bind`` binds the result."""
    check_gemini_options(plugin, optimizer)
    params_info = get_param_info(optimizer)
    if not isinstance(model, GeminiDDP):
        model = GeminiDDP(
            model,
            **plugin.gemini_config,
            zero_group=plugin.zero_group,
            extra_dp_group=plugin.extra_dp_group,
            verbose=plugin.verbose,
        )
    wrapper = GeminiDistOptimizer(
        optimizer,
        model,
        **plugin.zero_optim_config,
        **plugin.optim_kwargs,
        tp_group=plugin.tp_group,
        params_info=params_info,
        verbose=plugin.verbose,
    )
    bind(wrapper)
    return model, wrapper
