"""Muon's momentum on the ranks that hold the parameter (element-wise, before ``C`` travels to the
matrices' owners), 32-bit or bitsandbytes' block-wise 8-bit (``optim_bits=8``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from .. import bnb_states as bnb
from ..layout import ParamLayout

__all__ = ["momentum_directions", "momentum_direction"]

KEY = "momentum_buffer"


def momentum_directions(
    states: Mapping[torch.Tensor, dict[str, Any]],
    bucket: list[tuple[dict[str, Any], torch.Tensor, torch.Tensor, ParamLayout]],
    eight_bit: Callable[[ParamLayout], bool],
) -> list[torch.Tensor]:
    """Each matrix's momentum updated and its local part of ``C`` (``bucket``: group, parameter,
    local gradient, layout). An 8-bit momentum is dequantised, updated and ``C`` made from it in
    fp32 (as bitsandbytes' 8-bit kernels use the fp32 moment before storing it), then stored
    quantised again, all of the bucket's at once (:class:`dist_optim.bnb_states.Batch8bit`: blocks
    of the full tensor, one max-reduction of the absmax per process group). A momentum saved
    with the other ``optim_bits`` is carried over (quantised, or dequantised into the state)."""
    out = []
    batch = bnb.Batch8bit()
    for group, p, g, layout in bucket:
        state = states[p]
        if eight_bit(layout):
            buf = batch.read(state, KEY, True, layout, g)
            out.append(momentum_direction(buf, g.float(), group).to(g.dtype))
            continue
        if KEY not in state:
            state[KEY] = torch.zeros_like(g, memory_format=torch.preserve_format)
        else:
            batch.to_32bit(state, KEY, True, layout, g.device, g.dtype)
        out.append(momentum_direction(state[KEY], g, group))
    batch.store()
    return out


def momentum_direction(buf: torch.Tensor, g: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """Update the momentum ``buf`` of a parameter's local elements in place and return its local
    part of ``C`` (element-wise: the same bits on a TP slice or ZeRO chunk as on the full tensor)."""
    mu = group["momentum"]
    if group["momentum_ema"]:
        buf.lerp_(g, 1.0 - mu)
        return g.lerp(buf, mu) if group["nesterov"] else buf
    buf.mul_(mu).add_(g)
    return g.add(buf, alpha=mu) if group["nesterov"] else buf
