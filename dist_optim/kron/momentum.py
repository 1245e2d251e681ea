"""Kron's momentum on the ranks that hold the parameter (element-wise, step 1 of
:mod:`dist_optim.kron`, before the momentum travels to its owner): in ``mu_dtype`` (or the
parameter's dtype), or with ``optim_bits=8`` as bitsandbytes' block-wise 8-bit codes.

8 bits (Dettmers et al., 2022, "8-bit Optimizers via Block-wise Quantization", arXiv:2110.02861;
:mod:`dist_optim.states.bnb`): blocks of 256 values of the *full* flattened tensor, one fp32 absmax
each, bitsandbytes' signed dynamic map. As its 8-bit kernels use a moment, a step dequantises the
momentum, updates it in fp32 and hands that fp32 value on (debiasing, the preconditioner's fit and
the direction on the owner are those of a 32-bit momentum of that value); the value is quantised
again before it travels, all of a bucket's at once (:class:`dist_optim.states.bnb.Batch8bit`: one
max-reduction of the block absmax per process group for the bucket, so the codes are the
single-device ones under any TP slicing or ZeRO chunking).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..kernels.dtypes import accumulation_dtype
from ..layout import ParamLayout
from ..states import bnb, codecs
from .state import MOMENTUM, MOMENTUM_ENTRY
from .variant import heavy, momentum_weight

__all__ = ["update_momenta", "momentum_bytes"]


def update_momenta(
    states: Mapping[torch.Tensor, dict[str, Any]],
    work: list[tuple[dict[str, Any], torch.Tensor, torch.Tensor, ParamLayout]],
    eight_bit: Callable[[ParamLayout], bool],
    step: int = 0,
) -> list[torch.Tensor]:
    """``m <- b1 m + (1 - b1) g`` of each parameter's local elements (``work``: group, parameter,
    local gradient, layout); returns the momenta. A 32-bit one is the state's buffer, updated in
    place; an 8-bit one a new fp32 tensor (float64 for float64 gradients), the caller's to
    overwrite, whose value is already stored quantised. A state saved with the other
    ``optim_bits`` is carried over: a 32-bit momentum is quantised here, an 8-bit one loaded by a
    32-bit optimizer dequantised into ``mu_dtype``. ``variant="heavyball"``: the bias-corrected
    average ``m (1 - a) + g a`` at the optimizer's ``step`` (:func:`.variant.momentum_weight`)."""
    out = []
    batch = bnb.Batch8bit()
    for group, p, g, layout in work:
        state = states[p]
        b1 = group["b1"]
        if eight_bit(layout):
            # fp32 as bitsandbytes' kernels (float64 for a float64 parameter, a reference run).
            acc = accumulation_dtype(g.dtype)
            m = MOMENTUM_ENTRY.codec.read(batch, state, MOMENTUM, layout, g, acc)
        else:
            MOMENTUM_ENTRY.codec.to_plain(batch, state, MOMENTUM, layout, g.device, group["mu_dtype"] or p.dtype)
            m = state[MOMENTUM]
        if heavy(group):
            a = momentum_weight(b1, step)
            m.mul_(1 - a).add_(g, alpha=a)
        else:
            m.mul_(b1).add_(g, alpha=1 - b1)
        out.append(m)
    batch.store()
    return out


def momentum_bytes(state: dict[str, Any], p: torch.Tensor, group: dict[str, Any], eight_bit: bool) -> int:
    """Bytes per element of the momentum that travels to the owner (fp32 for an 8-bit one)."""
    if eight_bit:
        return accumulation_dtype(p.dtype).itemsize
    m = state.get(MOMENTUM)
    if isinstance(m, torch.Tensor) and not codecs.quantized(m):
        return m.element_size()
    return (group["mu_dtype"] or p.dtype).itemsize
