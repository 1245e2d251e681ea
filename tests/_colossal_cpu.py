"""Test-only shims that let ColossalAI 0.5.0's booster plugins run on CPU processes (gloo).

ColossalAI's ``CpuAccelerator`` raises on calls that its plugins make (seeding, device count,
streams, memory statistics), ZeRO asserts a CUDA/NPU accelerator, and pipeline p2p probes
``torch.distributed.is_hccl_available`` and ``Backend.HCCL``, which builds without HCCL lack
(DESIGN.md §5). None of this
belongs in the library: the plugins run unchanged on GPUs.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

_INSTALLED = False


def install() -> None:
    """Idempotently patch ColossalAI for CPU use in this process."""
    global _INSTALLED
    if _INSTALLED:
        return
    from colossalai.accelerator import set_accelerator
    from colossalai.accelerator.cpu_accelerator import CpuAccelerator
    from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

    class TestCpuAccelerator(CpuAccelerator):
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
            return torch.cpu.Stream()

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

    set_accelerator(TestCpuAccelerator())

    original_checks = LowLevelZeroOptimizer._sanity_checks

    def _sanity_checks(self: Any) -> None:
        # Keep ColossalAI's dtype checks; drop only its "device is required" accelerator assertion.
        import colossalai.zero.low_level.low_level_optim as llo

        real = llo.get_accelerator
        fake = type("_Named", (), {"name": "cuda"})()
        llo.get_accelerator = lambda: fake
        try:
            original_checks(self)
        finally:
            llo.get_accelerator = real

    LowLevelZeroOptimizer._sanity_checks = _sanity_checks
    if not hasattr(dist, "is_hccl_available"):
        dist.is_hccl_available = lambda: False  # type: ignore[attr-defined]
    # Pipeline p2p asks whether the group is NCCL/HCCL by comparing with Backend.HCCL, which torch
    # builds without HCCL lack; on gloo the answer is simply no.
    import colossalai.pipeline.p2p as p2p

    p2p._check_for_nccl_hccl_backend = lambda group: dist.get_backend(group) == "nccl"
    # gloo has no all_to_all (sequence parallelism "all_to_all" uses it): one gather per rank.
    import colossalai.shardformer.layer._operation as operation

    operation.dist = _GlooAllToAll(dist)
    _INSTALLED = True


class _GlooAllToAll:
    """``torch.distributed`` with ``all_to_all`` emulated by gathers (for gloo process groups)."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def all_to_all(self, output_list: list[torch.Tensor], input_list: list[torch.Tensor], group: Any = None) -> None:
        real = self._real
        if real.get_backend(group) != "gloo":
            real.all_to_all(output_list, input_list, group=group)
            return
        me = real.get_rank(group)
        for dst in range(real.get_world_size(group)):
            # Rank ``dst`` receives input_list[dst] of every rank, in rank order.
            gathered = [torch.empty_like(output_list[i]) for i in range(len(output_list))] if me == dst else None
            real.gather(input_list[dst].contiguous(), gathered, dst=real.get_global_rank(group, dst), group=group)
            if me == dst:
                for out, got in zip(output_list, gathered):
                    out.copy_(got)


@contextlib.contextmanager
def quiet_colossal() -> Any:
    """Silence ColossalAI's INFO logging inside a test."""
    import logging

    logger = logging.getLogger("colossalai")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)
