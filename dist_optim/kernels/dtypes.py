"""Type promotion answered once per pair of dtypes.

``torch.promote_types`` is a dispatched operator: under a ``TorchDispatchMode`` (the planner's
recorder, :class:`dist_optim.plan.traffic.LiveBytes`) every call goes through the mode, and the
optimizers ask it per parameter and step. The answer depends on the dtypes alone, so it is cached.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["promote", "accumulation_dtype"]


@functools.cache
def promote(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """``torch.promote_types(a, b)``."""
    return torch.promote_types(a, b)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to accumulate ``dtype`` values in: fp32, or the wider dtype (float64 stays float64)."""
    return promote(dtype, torch.float32)
