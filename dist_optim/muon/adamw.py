"""Muon's auxiliary AdamW (the ``use_muon=False`` groups: embeddings, heads, norms, biases),
element-wise on each rank's pieces: torch's ``adamw`` for 32-bit moments, and with ``optim_bits=8``
the moments of tensors of at least ``min_8bit_size`` elements kept as bitsandbytes' block-wise
codes.

8 bits (as bitsandbytes' ``AdamW8bit``; Dettmers et al., 2022, "8-bit Optimizers via Block-wise
Quantization", arXiv:2110.02861; :mod:`dist_optim.bnb_states`): ``exp_avg`` with the signed
dynamic map, ``exp_avg_sq`` with the unsigned one, blocks of 256 values of the *full* flattened
tensor with one fp32 absmax each. A step dequantises both, updates them and the parameter in fp32
with torch's AdamW formula (the 32-bit path's), then stores them quantised again, a bucket of
``bucket_bytes`` of fp32 moments at a time (:func:`dist_optim.bnb_states.write_8bit_many`: the
absmax of a block held in pieces max-reduced over its holders, so the codes are the single-device
ones). What stays fp32: the step counter, the absmax, and the moments of smaller tensors (norms and
biases, where an absmax per 256 values saves little and quantising hurts most), as in bitsandbytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.optim.adamw import adamw as _torch_adamw

from .. import bnb_states as bnb
from ..budget import buckets
from ..fused_adam import fused_applies
from ..layout import ParamLayout

__all__ = ["adamw_step"]


def adamw_step(
    states: Mapping[torch.Tensor, dict[str, Any]],
    group: dict[str, Any],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    layouts: list[ParamLayout],
    eight_bit: Callable[[ParamLayout], bool],
    bucket_bytes: int | None,
) -> None:
    """One AdamW step of ``params`` (of ``group``: ``adamw_betas``, ``adamw_eps``, ``lr``,
    ``weight_decay``). A state saved with the other ``optim_bits`` is carried over: 32-bit moments
    are quantised at this step, 8-bit ones loaded by a 32-bit optimizer dequantised here."""
    plain: list[int] = []
    eight: list[int] = []
    for i, (p, layout) in enumerate(zip(params, layouts)):
        state = states[p]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        if eight_bit(layout):
            eight.append(i)
            continue
        plain.append(i)
        for key, signed in bnb.MOMENTS:
            value = state.get(key)
            if value is None:
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif value.dtype == torch.uint8:
                bnb.to_32bit(state, key, bnb.FullBlocks(layout, p.device), signed, p.dtype)
    if plain:
        _adamw_32bit(group, [params[i] for i in plain], [grads[i] for i in plain], [states[params[i]] for i in plain])
    # The fp32 moments of 8 bytes per element live until their bucket's re-quantisation.
    sizes = [params[i].numel() * 8 for i in eight]
    for start, stop in buckets(sizes, bucket_bytes):
        requant: list[bnb.Requant] = []
        for i in eight[start:stop]:
            p, layout = params[i], layouts[i]
            requant += _adamw_8bit(p, grads[i], states[p], bnb.FullBlocks(layout, p.device), group)
        bnb.write_8bit_many(requant)


def _adamw_32bit(
    group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict[str, Any]]
) -> None:
    tensors = [t for p, g, st in zip(params, grads, states) for t in (p, g, st["exp_avg"], st["exp_avg_sq"])]
    beta1, beta2 = group["adamw_betas"]
    _torch_adamw(
        params,
        grads,
        [st["exp_avg"] for st in states],
        [st["exp_avg_sq"] for st in states],
        [],
        [st["step"] for st in states],
        foreach=False,
        # None lets torch choose its per-tensor path where the kernel does not apply.
        fused=True if fused_applies(*tensors) else None,
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["adamw_eps"],
        maximize=False,
    )


def _adamw_8bit(
    p: torch.Tensor, g: torch.Tensor, state: dict[str, Any], blocks: bnb.FullBlocks, group: dict[str, Any]
) -> list[bnb.Requant]:
    """torch's single-tensor AdamW on one parameter's local elements with the moments dequantised
    (fp32, float64 for a float64 parameter); returns their new values to store quantised. As
    bitsandbytes' 8-bit kernels do, the parameter's step uses the fp32 moments, not their
    re-quantised values."""
    beta1, beta2 = group["adamw_betas"]
    lr, eps = group["lr"], group["adamw_eps"]
    acc = torch.promote_types(p.dtype, torch.float32)
    m, v = (bnb.start_8bit(state, key, blocks, signed, p.shape, p.device).to(acc) for key, signed in bnb.MOMENTS)
    state["step"] += 1
    t = float(state["step"])
    g = g.to(acc)
    if group["weight_decay"] != 0:
        p.mul_(1.0 - lr * group["weight_decay"])
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = (v.sqrt() / math.sqrt(1.0 - beta2**t)).add_(eps)
    p.add_((m / denom).to(p.dtype), alpha=-lr / (1.0 - beta1**t))
    return [bnb.Requant(state, key, blocks, value, signed) for (key, signed), value in zip(bnb.MOMENTS, (m, v))]
