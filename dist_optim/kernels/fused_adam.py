"""torch's fused Adam/AdamW kernels (``torch._fused_adam_`` / ``torch._fused_adamw_``): whether
they exist and whether they apply to a set of tensors, decided in one place for every optimizer
that takes them (Shampoo's Adam grafting, GaLore's plain-parameter AdamW, Muon's auxiliary AdamW).

The kernels make one pass over parameter, gradient and both moments (on the CPU several times
faster than separate operations, which allocate parameter-sized temporaries; measured once, not
benched); where they do not apply, each optimizer's per-operation path computes the same update.
"""

from __future__ import annotations

import torch

__all__ = ["FUSED", "fused_applies"]

#: Whether this torch has the fused kernels (CPU and CUDA since torch 2.4). Tests switch it off to
#: run the per-operation paths.
FUSED = hasattr(torch, "_fused_adam_") and hasattr(torch, "_fused_adamw_")


def fused_applies(*tensors: torch.Tensor) -> bool:
    """Whether the fused kernels can take ``tensors`` (one parameter's, or a whole list's): dense
    memory of one floating dtype on one CPU or CUDA device; anything else would be misread (a
    strided view) or refused. Meta tensors qualify, as on a GPU (the kernels have meta
    implementations), so that ``dist_optim.plan`` simulates the path a GPU takes."""
    if not FUSED or not tensors:
        return False
    first = tensors[0]
    return (
        first.device.type in ("cpu", "cuda", "meta")
        and first.dtype.is_floating_point
        and all(t.dtype == first.dtype and t.device == first.device and t.is_contiguous() for t in tensors)
    )
