"""The parameter update from a direction (step 6 of the package docstring), on local tensors."""

from __future__ import annotations

from typing import Any

import torch

from ..checks import group_lr
from ..kernels.multi_tensor import scale_

__all__ = ["apply_update", "apply_updates", "whole_views"]


def apply_update(p: torch.Tensor, update: torch.Tensor, buf: torch.Tensor | None, group: dict[str, Any]) -> None:
    """:func:`apply_updates` of one piece of a parameter, its direction (updated in place) and its
    momentum buffer."""
    apply_updates([p], [update], [buf], group)


def apply_updates(
    ps: list[torch.Tensor], ds: list[torch.Tensor], bufs: list[torch.Tensor | None], group: dict[str, Any]
) -> None:
    """``P + weight_decay W`` (decoupled), momentum / Nesterov where a piece has a buffer,
    ``W <- W - lr P`` on pieces of parameters of ``group`` (``ps``: e.g. blocks of parameters held
    whole), their directions ``ds`` (updated in place) and momentum buffers ``bufs``: one
    ``torch._foreach_*`` call per operation over all of them (one kernel launch per operation on a
    GPU; the same per-tensor operations, so the same bits, on the CPU)."""
    if not ps:
        return
    ds = [d if d.dtype == p.dtype else d.to(p.dtype) for p, d in zip(ps, ds)]
    wd = group["weight_decay"]
    if wd != 0 and group["use_decoupled_weight_decay"]:
        torch._foreach_add_(ds, ps, alpha=wd)
    mom = group["momentum"]
    moving = [(i, b) for i, b in enumerate(bufs) if b is not None] if mom > 0 else []
    if moving:
        held = [b for _, b in moving]
        scale_(held, mom)
        torch._foreach_add_(held, [ds[i] for i, _ in moving])
        if group["use_nesterov"]:
            torch._foreach_add_([ds[i] for i, _ in moving], held, alpha=mom)
        else:
            for i, b in moving:
                ds[i] = b
    torch._foreach_add_(ps, ds, alpha=-group_lr(group))


def whole_views(
    p: torch.Tensor, is_local: bool, buf: torch.Tensor | None, view_shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``p`` and its momentum buffer ``buf`` viewed in the blocking's (merged) shape, where this rank
    holds ``p`` whole (``is_local``) and contiguous (its blocks' updates then apply slice by slice),
    else None."""
    if not (is_local and p.is_contiguous()):
        return None
    return p.detach().view(view_shape), None if buf is None else buf.view(view_shape)
