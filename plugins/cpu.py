"""Run ColossalAI 0.5.0's booster plugins on CPU processes with gloo, for debugging and CI.

    import dist_optim.plugins.cpu
    dist_optim.plugins.cpu.install()   # once per process, before colossalai.launch*(...)

Every plugin of the README's support table then runs on CPU processes (``torchrun --nproc-per-node
4`` or ``colossalai run`` without GPUs): the demo and the test suite use it. On GPUs nothing here is
needed; the plugins run unchanged with NCCL.

What it fills in, and why (docs/design.md, "Running ColossalAI on CPU"):

* ColossalAI's ``CpuAccelerator`` raises on calls its plugins make (seeding and random state with a
  device argument, device count, streams, memory statistics): replaced by one that answers them;
* LowLevelZero asserts a CUDA/NPU accelerator in its sanity checks: only that assertion is relaxed,
  its dtype checks stay;
* pipeline p2p probes ``torch.distributed.is_hccl_available`` and ``Backend.HCCL``, which torch
  builds without HCCL lack: answered "not NCCL/HCCL" on gloo;
* gloo has no ``all_to_all`` / ``all_to_all_single`` / list-form ``reduce_scatter`` (sequence
  parallelism and MoE dispatch use them): emulated with point-to-point messages and an all-reduce
  for the modules that call them (:class:`GlooCollectives`);
* ColossalAI's FSDP checkpoint IO asks for state dicts offloaded to the CPU, which crashes
  FSDP when the parameters already live there: asked without the offload;
* Gemini tells device from host memory by device type, and on CPU processes both are "cpu": its
  chunks would count as offloaded, be moved to the host between uses and fail to gather. Device and
  host are the same memory there, so Gemini's static placement without offload is run with every
  chunk on the device (:func:`_keep_gemini_chunks_on_device`); offload placements (``"auto"``,
  offload fractions above 0) cannot be told apart from it on CPU and are refused, naming the
  setting that runs. Pinned host memory needs CUDA, so chunks keep no pinned copy, and the
  accelerator's streams answer ``synchronize``;
* on a torch without a CUDA device, ``torch.manual_seed`` still queues a CUDA seeding for a CUDA
  that can never initialise, formatting the caller's stack each time: ColossalAI's sharded layers
  seed 32 times per ``booster.boost``, a measurable share of a small boosted run on these ranks
  (docs/design.md).
  There the queueing is skipped (:func:`_skip_queued_cuda_seeding`).

Limits on CPU: ZeRO needs ``overlap_communication=False`` (``record_stream`` has no CPU
implementation) and fp16 an initial loss scale of 2**16 (2**32 overflows every step).

This module patches ColossalAI's internals; it and ``plugins/colossal.py`` are the places that
know them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from colossalai.accelerator.cpu_accelerator import CpuAccelerator

__all__ = ["install", "is_installed", "quiet_colossal", "FullCpuAccelerator", "GlooCollectives", "GEMINI_ON_CPU"]

_INSTALLED = False


def is_installed() -> bool:
    """Whether :func:`install` has run in this process."""
    return _INSTALLED


def install() -> None:
    """Make ColossalAI's plugins run on CPU processes (gloo) in this process. Idempotent; call it
    before ``colossalai.launch*``."""
    global _INSTALLED
    if _INSTALLED:
        return
    from colossalai.accelerator import set_accelerator

    set_accelerator(FullCpuAccelerator())
    _relax_zero_device_check()
    _patch_pipeline_p2p()
    _patch_gloo_collectives()
    _skip_queued_cuda_seeding()
    _keep_fsdp_state_dicts_in_place()
    _keep_gemini_chunks_on_device()
    _INSTALLED = True


def _keep_fsdp_state_dicts_in_place() -> None:
    """ColossalAI's FSDP checkpoint IO asks FSDP for full state dicts "offloaded to the CPU": on
    CPU processes the unsharded parameters already live there, FSDP frees the storage it copied
    from, which is the copy's own, and rank 0 crashes (SIGSEGV) cloning it. Ask without the
    offload when no CUDA device exists; the result is the same tensors."""
    if torch.cuda.is_available():
        return
    import colossalai.booster.plugin.torch_fsdp_plugin as fsdp_plugin
    from torch.distributed.fsdp import FullStateDictConfig

    def in_place(offload_to_cpu: bool = False, rank0_only: bool = False) -> FullStateDictConfig:
        return FullStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only)

    fsdp_plugin.FullStateDictConfig = in_place  # type: ignore[attr-defined]


def _skip_queued_cuda_seeding() -> None:
    """Without a CUDA device, make ``torch.cuda.manual_seed(_all)`` do nothing: torch would queue
    the seeding (with the caller's formatted stack) until CUDA initialises, which cannot happen, so
    the queued call never runs either way."""
    if torch.cuda.is_available():
        return
    torch.cuda.manual_seed = lambda seed: None  # type: ignore[assignment]
    torch.cuda.manual_seed_all = lambda seed: None  # type: ignore[assignment]


class _CpuStream(torch.cpu.Stream):
    """torch's CPU stream, which runs everything in order, with the ``synchronize`` that Gemini's
    backward calls on its reduction stream."""

    def synchronize(self) -> None:
        pass


#: What Gemini placements run on CPU processes, for the shim's refusal.
GEMINI_ON_CPU = 'GeminiPlugin(placement_policy="static", offload_optim_frac=0.0, offload_param_frac=0.0)'


def _keep_gemini_chunks_on_device() -> None:
    """Run Gemini's chunks as if on a device (see the module docstring): a chunk is never moved to
    the host, keeps its device shard after it is closed, and says it is on the device."""
    from colossalai.zero.gemini.chunk import chunk as gemini_chunk
    from colossalai.zero.gemini.chunk import manager as gemini_manager
    from colossalai.zero.gemini.gemini_mgr import GeminiManager

    chunk_cls = gemini_chunk.Chunk
    chunk_init, close_chunk = chunk_cls.__init__, chunk_cls.close_chunk
    manager_init = GeminiManager.__init__

    def init_manager(self: Any, placement_policy: str, *args: Any, **kwargs: Any) -> None:
        offload = {k: kwargs.get(k, 0.0) for k in ("offload_optim_frac", "offload_param_frac")}
        if placement_policy != "static" or any(offload.values()):
            raise ValueError(
                f"dist_optim.plugins.cpu: Gemini with placement_policy={placement_policy!r} and {offload} offloads to "
                f"host memory, which CPU processes do not have apart from the device's; use {GEMINI_ON_CPU}"
            )
        manager_init(self, placement_policy, *args, **kwargs)

    def init_chunk(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["pin_memory"] = False  # pinned memory needs CUDA; without offload it is only a staging copy
        chunk_init(self, *args, **kwargs)

    def close(self: Any) -> None:
        close_chunk(self)
        if not self.keep_gathered and self.cuda_shard is None:  # "offloaded" because the device is the CPU
            self.cuda_shard, self.cpu_shard = self.cpu_shard, None

    def device_type(self: Any) -> str:
        on_device = self.chunk_temp is not None or self.is_gathered or self.cuda_shard is not None
        return "cuda" if on_device else "cpu"

    def move_chunk(
        self: Any, chunk: Any, device: torch.device, force_copy: bool = False, async_move: bool = False
    ) -> None:
        pass  # every chunk stays on the device: there is no other memory

    GeminiManager.__init__ = init_manager  # type: ignore[method-assign]
    chunk_cls.__init__ = init_chunk  # type: ignore[method-assign]
    chunk_cls.close_chunk = close  # type: ignore[method-assign]
    chunk_cls.device_type = property(device_type)  # type: ignore[method-assign,assignment]
    gemini_manager.ChunkManager.move_chunk = move_chunk  # type: ignore[method-assign]


class FullCpuAccelerator(CpuAccelerator):
    """ColossalAI's CPU accelerator with the calls its plugins make answered for CPU."""

    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(new_state)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def set_device(self, device: Any = None) -> None:
        pass

    def synchronize(self, device: Any = None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def memory_allocated(self, device: Any = None) -> int:
        return 0

    def max_memory_allocated(self, device: Any = None) -> int:
        return 0

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        pass

    def Stream(self, device: Any = None, priority: int = 0, **kwargs: Any) -> Any:  # noqa: N802
        return _CpuStream()

    def Event(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> Any:  # noqa: N802
        return torch.cpu.Event()

    def current_stream(self, device: Any = None) -> Any:
        return torch.cpu.current_stream()

    def default_stream(self, device: Any = None) -> Any:
        return torch.cpu.current_stream()

    def stream(self, stream_: Any) -> Any:
        return torch.cpu.stream(stream_)

    def autocast(self, enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True) -> Any:
        def _ctx() -> Any:
            return torch.autocast("cpu", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

        return _ctx


def _relax_zero_device_check() -> None:
    import colossalai.zero.low_level.low_level_optim as llo

    original_checks = llo.LowLevelZeroOptimizer._sanity_checks

    def sanity_checks(self: Any) -> None:
        # Keep ColossalAI's dtype checks; drop only its "device is required" accelerator assertion.
        real = llo.get_accelerator
        fake = type("NamedCuda", (), {"name": "cuda"})()
        llo.get_accelerator = lambda: fake
        try:
            original_checks(self)
        finally:
            llo.get_accelerator = real

    llo.LowLevelZeroOptimizer._sanity_checks = sanity_checks


def _patch_pipeline_p2p() -> None:
    if not hasattr(dist, "is_hccl_available"):
        dist.is_hccl_available = lambda: False  # type: ignore[attr-defined]
    # Pipeline p2p asks whether the group is NCCL/HCCL by comparing with Backend.HCCL, which torch
    # builds without HCCL lack; on gloo the answer is simply no.
    import colossalai.pipeline.p2p as p2p

    p2p._check_for_nccl_hccl_backend = lambda group: dist.get_backend(group) == "nccl"


def _patch_gloo_collectives() -> None:
    import colossalai.moe._operation as moe_operation
    import colossalai.shardformer.layer._operation as operation
    import colossalai.shardformer.modeling.mixtral as mixtral

    shim = GlooCollectives(dist)
    for module in (operation, moe_operation, mixtral):
        module.dist = shim


class _Done:
    def wait(self) -> None:
        pass


class GlooCollectives:
    """``torch.distributed`` with ``all_to_all`` / ``all_to_all_single`` (point-to-point messages)
    and ``reduce_scatter`` (an all-reduce) emulated on gloo process groups, which have none."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def _exchange(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], group: Any) -> None:
        real = self._real
        me = real.get_rank(group)
        requests = []
        for peer in range(real.get_world_size(group)):
            if peer == me:
                outputs[peer].copy_(inputs[peer])
                continue
            target = real.get_global_rank(group, peer) if group is not None else peer
            requests.append(real.isend(inputs[peer].contiguous(), target, group=group))
            requests.append(real.irecv(outputs[peer], target, group=group))
        for request in requests:
            request.wait()

    def all_to_all(
        self, output_list: list[torch.Tensor], input_list: list[torch.Tensor], group: Any = None, async_op: bool = False
    ) -> Any:
        if self._real.get_backend(group) != "gloo":
            return self._real.all_to_all(output_list, input_list, group=group, async_op=async_op)
        received = [torch.empty_like(t) for t in output_list]
        self._exchange(received, list(input_list), group)
        for out, got in zip(output_list, received):
            out.copy_(got)
        return _Done() if async_op else None

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: Any = None,
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        real = self._real
        op = real.ReduceOp.SUM if op is None else op
        if real.get_backend(group) != "gloo":
            return real.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)
        flat = torch.cat([t.reshape(-1) for t in input_list])
        real.all_reduce(flat, op=op, group=group)
        n = output.numel()
        me = real.get_rank(group)
        output.copy_(flat[me * n : (me + 1) * n].view_as(output))
        return _Done() if async_op else None

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002 - torch's name
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        real = self._real
        if real.get_backend(group) != "gloo":
            return real.all_to_all_single(
                output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
            )
        world = real.get_world_size(group)
        out_sizes = output_split_sizes or [output.shape[0] // world] * world
        in_sizes = input_split_sizes or [input.shape[0] // world] * world
        received = [torch.empty((n, *output.shape[1:]), dtype=output.dtype) for n in out_sizes]
        self._exchange(received, list(torch.split(input, in_sizes)), group)
        if received:
            output.copy_(torch.cat(received))
        return _Done() if async_op else None


@contextlib.contextmanager
def quiet_colossal() -> Iterator[None]:
    """Silence ColossalAI's INFO logging (its per-rank banners) inside the block."""
    logger = logging.getLogger("colossalai")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)
