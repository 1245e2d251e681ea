"""Muon's auxiliary AdamW (the ``use_muon=False`` groups: embeddings, heads, norms, biases),
element-wise on each rank's pieces: torch's ``adamw`` for 32-bit moments, and with ``optim_bits=8``
the moments of tensors of at least ``min_8bit_size`` elements kept as bitsandbytes' block-wise
codes.

8 bits (as bitsandbytes' ``AdamW8bit``; Dettmers et al., 2022, "8-bit Optimizers via Block-wise
Quantization", arXiv:2110.02861; :mod:`dist_optim.states.bnb`): ``exp_avg`` with the signed
dynamic map, ``exp_avg_sq`` with the unsigned one, blocks of 256 values of the *full* flattened
tensor with one fp32 absmax each. A step dequantises both, updates them and the parameter in fp32
with torch's AdamW formula (the 32-bit path's), then stores them quantised again, a bucket of
``bucket_bytes`` of fp32 moments at a time (:class:`dist_optim.states.bnb.Batch8bit`: the absmax
of a block held in pieces max-reduced over its holders, one all-reduce per process group and
bucket, so the codes are the single-device ones). What stays fp32: the step counter, the absmax,
and the moments of smaller tensors (norms and biases, where an absmax per 256 values saves little
and quantising hurts most), as in bitsandbytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.optim.adamw import adamw as _torch_adamw

from ..checks import group_lr
from ..kernels.dtypes import accumulation_dtype
from ..kernels.fused_adam import fused_applies
from ..layout import ParamLayout
from ..sharding.budget import buckets
from ..states import bnb, codecs

__all__ = ["MOMENTS", "adamw_step"]

#: The auxiliary AdamW's moments, bitsandbytes' 8-bit codes with ``optim_bits=8``.
MOMENTS = (codecs.Entry("exp_avg", codecs.BNB_SIGNED), codecs.Entry("exp_avg_sq", codecs.BNB_UNSIGNED))


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
    carry = bnb.Batch8bit()
    for i, (p, layout) in enumerate(zip(params, layouts)):
        state = states[p]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        if eight_bit(layout):
            eight.append(i)
            continue
        plain.append(i)
        for entry in MOMENTS:
            if entry.name not in state:
                state[entry.name] = torch.zeros_like(p, memory_format=torch.preserve_format)
            else:
                entry.codec.to_plain(carry, state, entry.name, layout, p.device, p.dtype)
    if plain:
        _adamw_32bit(group, [params[i] for i in plain], [grads[i] for i in plain], [states[params[i]] for i in plain])
    # The fp32 moments of 8 bytes per element live until their bucket's re-quantisation.
    sizes = [layouts[i].largest_chunk_numel * 8 for i in eight]
    for start, stop in buckets(sizes, bucket_bytes):
        batch = bnb.Batch8bit()
        for i in eight[start:stop]:
            p = params[i]
            _adamw_8bit(p, grads[i], states[p], layouts[i], group, batch)
        batch.store()


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
        lr=group_lr(group),
        weight_decay=group["weight_decay"],
        eps=group["adamw_eps"],
        maximize=False,
    )


def _adamw_8bit(
    p: torch.Tensor,
    g: torch.Tensor,
    state: dict[str, Any],
    layout: ParamLayout,
    group: dict[str, Any],
    batch: bnb.Batch8bit,
) -> None:
    """torch's single-tensor AdamW on one parameter's local elements with the moments read from
    ``batch`` (fp32, float64 for a float64 parameter; stored quantised by its ``store``). As
    bitsandbytes' 8-bit kernels do, the parameter's step uses the fp32 moments, not their
    re-quantised values."""
    beta1, beta2 = group["adamw_betas"]
    lr, eps = group_lr(group), group["adamw_eps"]
    acc = accumulation_dtype(p.dtype)
    m, v = (e.codec.read(batch, state, e.name, layout, p, acc) for e in MOMENTS)
    state["step"] += 1
    t = float(state["step"])
    g = g.to(acc)
    if group["weight_decay"] != 0:
        p.mul_(1.0 - lr * group["weight_decay"])
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = (v.sqrt() / math.sqrt(1.0 - beta2**t)).add_(eps)
    p.add_((m / denom).to(p.dtype), alpha=-lr / (1.0 - beta1**t))
