"""Multi-tensor scaling rounded as the per-tensor operator rounds it.

torch 2.5.1's CPU ``torch._foreach_mul_(tensors, scalar)`` rounds the Python scalar to a bf16 or
fp16 list's own dtype before multiplying, where ``Tensor.mul_`` multiplies in fp32 and rounds once:
bf16(0.99) is 0.98828125, so a momentum of 0.99 on a bf16 buffer would decay it by 1.17% a step
instead of 1% (many entries of a random bf16 or fp16 tensor differ from ``mul_``'s for 0.99:
tests/unit/test_multi_tensor.py's ``test_torch_foreach_is_why``). The other multi-tensor operators
the optimizers use with a scalar (``_foreach_add_`` with ``alpha``, ``_foreach_addcmul_`` with
``value``, ``_foreach_lerp_``, ``add`` of a scalar) and ``_foreach_mul_`` by a list of tensors round
as their per-tensor operators (measured the same way once). So every list of tensors is scaled
through :func:`scale_`: fp32/fp64 tensors in one multi-tensor call (a few launches on a GPU instead
of one per tensor), the others per tensor, on every device, so that a bf16 state steps alike on
CPUs and GPUs. tests/unit/test_multi_tensor.py
checks it bit for bit; tests/unit/test_layering.py that no other module uses ``torch._foreach_mul_``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["FOREACH_DTYPES", "scale_"]

#: Dtypes whose multi-tensor multiplication by a Python scalar rounds as ``mul_`` does.
FOREACH_DTYPES = (torch.float32, torch.float64)


def scale_(tensors: Sequence[torch.Tensor], factor: float | Sequence[torch.Tensor]) -> None:
    """``t *= factor`` for every tensor, in place, rounded as ``Tensor.mul_`` rounds it. ``factor``
    is one number for all, or one tensor per tensor (a multi-tensor call for every dtype)."""
    if not tensors:
        return
    if not isinstance(factor, (int, float)):
        torch._foreach_mul_(list(tensors), list(factor))
        return
    wide = [t for t in tensors if t.dtype in FOREACH_DTYPES]
    if wide:
        torch._foreach_mul_(wide, factor)
    for t in tensors:
        if t.dtype not in FOREACH_DTYPES:
            t.mul_(factor)
