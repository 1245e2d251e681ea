"""AdamW on local tensors (no communication): the low-rank moments of GaLore parameters and the
moments of plain parameters, in fp32 (or the gradient's dtype) or as 8-bit block-wise codes
(:mod:`dist_optim.bnb_states`; paged buffers through its ``Buffers``).

``adam_style`` picks the reference arithmetic (see :mod:`dist_optim.galore`): ``"hf"``
(transformers' AdamW, as galore_torch.GaLoreAdamW) or ``"bnb"`` (bitsandbytes' Adam kernel).
"""

from __future__ import annotations

import collections
import math
from typing import Any

import torch

from .. import bnb_states as bnb
from ..fused_adam import fused_applies
from ..layout import ParamLayout
from .state import init_low_rank_state

__all__ = [
    "step_size_and_denom",
    "low_rank_adamw",
    "plain_moments_8bit",
    "plain_adamw_update",
    "fused_plain_adamw",
]


def step_size_and_denom(
    group: dict[str, Any], adam_style: str, exp_avg_sq: torch.Tensor, t: float
) -> tuple[float, torch.Tensor]:
    """The step size and the denominator of ``m / denom`` at step ``t`` (1-based) of ``adam_style``."""
    beta1, beta2 = group["betas"]
    if adam_style == "hf":
        denom = exp_avg_sq.sqrt().add_(group["eps"])
        step_size = group["lr"]
        if group["correct_bias"]:
            step_size = step_size * math.sqrt(1.0 - beta2**t) / (1.0 - beta1**t)
        return step_size, denom
    c1, c2 = (1.0 - beta1**t, math.sqrt(1.0 - beta2**t)) if group["correct_bias"] else (1.0, 1.0)
    denom = (exp_avg_sq.sqrt() / c2).add_(group["eps"])
    return group["lr"] / c1, denom


def low_rank_adamw(
    state: dict[str, Any],
    low: torch.Tensor,
    group: dict[str, Any],
    adam_style: str,
    eight_bit: bool,
    buffers: bnb.Buffers,
) -> tuple[float, torch.Tensor]:
    """One AdamW step of a GaLore parameter's low-rank moments from its low-rank gradient ``low``
    (counts the parameter's ``step``; 8-bit moments are read, updated in fp32 and re-quantised, as
    bitsandbytes' kernel does). Returns the step size and the normalised step ``m / denom``.

    ``low`` may be this rank's partition of the low-rank gradient (1-D; the moments are then the
    same partition of the full moments): 8-bit partitions begin on a block boundary, so
    bitsandbytes' blocks of the partition are those of the full tensor. An empty partition (more
    ranks than blocks) only counts the step."""
    beta1, beta2 = group["betas"]
    if "low_rank_exp_avg" not in state:
        init_low_rank_state(state, low, eight_bit, buffers)
    state["step"] += 1
    t = float(state["step"])
    buffers.prefetch(state["low_rank_exp_avg"], state["low_rank_exp_avg_sq"])
    # Whole moments or a partition of whole blocks: bitsandbytes' own blocks of them.
    blocks = bnb.FullBlocks(ParamLayout(tuple(low.shape)), low.device) if eight_bit and low.numel() else None
    if blocks is not None:
        exp_avg, exp_avg_sq = (m.to(low.dtype) for m in bnb.read_moments_8bit(state, "low_rank_", blocks))
    elif eight_bit:  # an empty partition
        exp_avg, exp_avg_sq = torch.zeros_like(low), torch.zeros_like(low)
    else:
        exp_avg, exp_avg_sq = state["low_rank_exp_avg"], state["low_rank_exp_avg_sq"]
    exp_avg.mul_(beta1).add_(low, alpha=1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(low, low, value=1.0 - beta2)
    step_size, denom = step_size_and_denom(group, adam_style, exp_avg_sq, t)
    norm = exp_avg / denom
    if blocks is not None:
        bnb.write_moments_8bit(state, "low_rank_", blocks, [exp_avg, exp_avg_sq])
    return step_size, norm


def plain_moments_8bit(
    state: dict[str, Any], grad: torch.Tensor, blocks: bnb.FullBlocks, beta1: float, beta2: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's fp32 moments of a plain parameter from its 8-bit state (not stored)."""
    g = grad.float()
    m, v = bnb.read_moments_8bit(state, "", blocks)
    m.mul_(beta1).add_(g, alpha=1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    return m, v


def plain_adamw_update(
    state: dict[str, Any],
    p: torch.Tensor,
    grad: torch.Tensor,
    group: dict[str, Any],
    adam_style: str,
    eight_bit: tuple[bnb.FullBlocks, list[torch.Tensor] | None] | None,
) -> None:
    """One AdamW step of a plain parameter, weight decay aside (counts its ``step``).
    ``eight_bit``: None for moments in the parameter's dtype, else the blocks of the full tensor
    and the absmax of every block (None for a whole tensor: bitsandbytes' quantiser computes it)."""
    beta1, beta2 = group["betas"]
    state["step"] += 1
    if eight_bit is not None:
        blocks, absmax = eight_bit
        m, v = plain_moments_8bit(state, grad, blocks, beta1, beta2)
    else:
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    step_size, denom = step_size_and_denom(group, adam_style, v, float(state["step"]))
    p.addcdiv_(m.to(p.dtype), denom.to(p.dtype), value=-step_size)
    if eight_bit is not None:
        bnb.write_moments_8bit(state, "", blocks, [m, v], absmax)


def fused_plain_adamw(
    group: dict[str, Any],
    adam_style: str,
    states: list[dict[str, Any]],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
) -> bool:
    """fp32-moment AdamW of plain params through torch's fused kernel (one pass over param,
    grad and moments; on the CPU ~5x faster than the per-op path, which allocates
    param-sized temporaries). Returns False, having changed nothing, where the kernel does not
    apply: it always bias-corrects, and wants dense tensors of one dtype per param.

    The kernel computes ``p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``
    (bitsandbytes' form). transformers' form ``lr * sqrt(1 - b2^t) / (1 - b1^t) * m /
    (sqrt(v) + eps)`` is the same update with ``eps / sqrt(1 - b2^t)`` in its place, so the
    "hf" style passes that (one call per distinct step count); its weight decay follows the
    update, as before."""
    if not group["correct_bias"] or not all(
        fused_applies(p, g, st["exp_avg"], st["exp_avg_sq"]) for p, g, st in zip(params, grads, states)
    ):
        return False
    beta1, beta2 = group["betas"]
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    by_step: dict[tuple[float, torch.device], list[int]] = collections.defaultdict(list)
    for i, (p, st) in enumerate(zip(params, states)):
        st["step"] += 1
        by_step[(float(st["step"]), p.device)].append(i)
    for (t, device), idx in by_step.items():
        ps = [params[i] for i in idx]
        sts = [states[i] for i in idx]
        steps = [st["step"] if device.type == "cpu" else st["step"].to(device) for st in sts]
        step_eps = eps / math.sqrt(1.0 - beta2**t) if adam_style == "hf" else eps
        torch._fused_adamw_(
            ps,
            [grads[i] for i in idx],
            [st["exp_avg"] for st in sts],
            [st["exp_avg_sq"] for st in sts],
            [],
            steps,
            amsgrad=False,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=wd if adam_style == "bnb" else 0.0,
            eps=step_eps,
            maximize=False,
        )
    if adam_style == "hf" and wd > 0.0:
        torch._foreach_add_(params, params, alpha=-lr * wd)
    return True
