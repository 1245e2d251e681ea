"""Muon's momentum on the ranks that hold the parameter (element-wise, before ``C`` travels to the
matrices' owners), 32-bit or bitsandbytes' block-wise 8-bit (``optim_bits=8``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..kernels.multi_tensor import FOREACH_DTYPES, scale_
from ..layout import ParamLayout
from ..states import bnb, codecs

__all__ = ["MOMENTUM", "momentum_directions", "momentum_direction", "momentum_foreach"]

KEY = "momentum_buffer"
#: Muon's momentum, bitsandbytes' signed 8-bit codes with ``optim_bits=8``.
MOMENTUM = codecs.Entry(KEY, codecs.BNB_SIGNED)


def momentum_directions(
    states: Mapping[torch.Tensor, dict[str, Any]],
    bucket: list[tuple[dict[str, Any], torch.Tensor, torch.Tensor, ParamLayout]],
    eight_bit: Callable[[ParamLayout], bool],
) -> list[torch.Tensor]:
    """Each matrix's momentum updated and its local part of ``C`` (``bucket``: group, parameter,
    local gradient, layout). An 8-bit momentum is dequantised, updated and ``C`` made from it in
    fp32 (as bitsandbytes' 8-bit kernels use the fp32 moment before storing it), then stored
    quantised again, all of the bucket's at once (:class:`dist_optim.states.bnb.Batch8bit`: blocks
    of the full tensor, one max-reduction of the absmax per process group). A momentum saved
    with the other ``optim_bits`` is carried over (quantised, or dequantised into the state). The
    fp32/fp64 momenta of one param group and dtype are updated together (:func:`momentum_foreach`:
    a few launches per group on a GPU instead of a few per matrix;
    :data:`dist_optim.kernels.multi_tensor.FOREACH_DTYPES`)."""
    out: list[torch.Tensor | None] = [None] * len(bucket)
    plain: dict[tuple[int, torch.dtype], tuple[dict[str, Any], list[int]]] = {}
    batch = bnb.Batch8bit()
    for i, (group, p, g, layout) in enumerate(bucket):
        state = states[p]
        if eight_bit(layout):
            buf = MOMENTUM.codec.read(batch, state, KEY, layout, g)
            out[i] = momentum_direction(buf, g.float(), group).to(g.dtype)
            continue
        if KEY not in state:
            state[KEY] = torch.zeros_like(g, memory_format=torch.preserve_format)
        else:
            MOMENTUM.codec.to_plain(batch, state, KEY, layout, g.device, g.dtype)
        if g.dtype in FOREACH_DTYPES:
            plain.setdefault((id(group), g.dtype), (group, []))[1].append(i)
        else:
            out[i] = momentum_direction(state[KEY], g, group)
    batch.store()
    for group, idx in plain.values():
        bufs = [states[bucket[i][1]][KEY] for i in idx]
        for i, c in zip(idx, momentum_foreach(bufs, [bucket[i][2] for i in idx], group)):
            out[i] = c
    assert all(c is not None for c in out)  # every matrix took the 8-bit, per-tensor or foreach path
    return out  # type: ignore[return-value]


def momentum_foreach(bufs: list[torch.Tensor], gs: list[torch.Tensor], group: dict[str, Any]) -> list[torch.Tensor]:
    """:func:`momentum_direction` of each ``(buf, g)`` pair, by ``torch._foreach_*`` (on the CPU
    the per-tensor kernels, bit for bit :func:`momentum_direction`'s in
    :data:`dist_optim.kernels.multi_tensor.FOREACH_DTYPES`)."""
    mu = group["momentum"]
    if group["momentum_ema"]:
        torch._foreach_lerp_(bufs, gs, 1.0 - mu)
    else:
        scale_(bufs, mu)
        torch._foreach_add_(bufs, gs)
    if not group["nesterov"]:
        return bufs
    if group["nesterov_sum"]:
        return list(torch._foreach_add(gs, bufs))
    return list(torch._foreach_lerp(gs, bufs, mu) if group["momentum_ema"] else torch._foreach_add(gs, bufs, alpha=mu))


def momentum_direction(buf: torch.Tensor, g: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """Update the momentum ``buf`` of a parameter's local elements in place and return its local
    part of ``C`` (element-wise: the same bits on a TP slice or ZeRO chunk as on the full tensor)."""
    mu = group["momentum"]
    if group["momentum_ema"]:
        buf.lerp_(g, 1.0 - mu)
    else:
        buf.mul_(mu).add_(g)
    if not group["nesterov"]:
        return buf
    if group["nesterov_sum"]:
        return g.add(buf)
    return g.lerp(buf, mu) if group["momentum_ema"] else g.add(buf, alpha=mu)
