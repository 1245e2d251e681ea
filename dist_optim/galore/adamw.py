"""AdamW on local tensors (no communication): the low-rank moments of GaLore parameters and the
moments of plain parameters, in fp32 (or the gradient's dtype) or as 8-bit block-wise codes
(:mod:`dist_optim.states.bnb`; paged buffers through its ``Buffers``).

``adam_style`` picks the reference arithmetic (see :mod:`dist_optim.galore`): ``"hf"``
(transformers' AdamW, as galore_torch.GaLoreAdamW) or ``"bnb"`` (bitsandbytes' Adam kernel).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from typing import Any

import torch

from ..checks import group_lr
from ..kernels.fused_adam import fused_applies
from ..kernels.multi_tensor import scale_
from ..layout import ParamLayout
from ..states import bnb
from .state import LOW_RANK, carry_over, init_low_rank_state, read_moments, write_moments

__all__ = [
    "step_size",
    "denominators",
    "step_size_and_denom",
    "low_rank_adamw",
    "plain_moments_8bit",
    "plain_adamw_update",
    "fused_plain_adamw",
]


def step_size(group: dict[str, Any], adam_style: str, t: float) -> float:
    """The step size of ``m / denom`` at step ``t`` (1-based) of ``adam_style``."""
    beta1, beta2 = group["betas"]
    if adam_style == "hf":
        if not group["correct_bias"]:
            return group_lr(group)
        return group_lr(group) * math.sqrt(1.0 - beta2**t) / (1.0 - beta1**t)
    return group_lr(group) / ((1.0 - beta1**t) if group["correct_bias"] else 1.0)


def denominators(
    group: dict[str, Any], adam_style: str, exp_avg_sqs: Sequence[torch.Tensor], ts: Sequence[float]
) -> list[torch.Tensor]:
    """The denominator of ``m / denom`` of each second moment at its step ``t`` (1-based), new
    tensors: ``sqrt(v) + eps`` (``"hf"``), else ``sqrt(v) / sqrt(1 - beta2^t) + eps``. One
    ``torch._foreach_*`` call per operation: a GaLore step has a hundred small partitions, and one
    call from Python per tensor and operation cost more than the arithmetic; on the CPU
    they run the per-tensor kernels, the same bits."""
    beta2 = group["betas"][1]
    denoms = list(torch._foreach_sqrt(list(exp_avg_sqs)))
    if adam_style != "hf":
        corrections = [math.sqrt(1.0 - beta2**t) if group["correct_bias"] else 1.0 for t in ts]
        denoms = list(torch._foreach_div(denoms, corrections))
    torch._foreach_add_(denoms, group["eps"])
    return denoms


def step_size_and_denom(
    group: dict[str, Any], adam_style: str, exp_avg_sq: torch.Tensor, t: float
) -> tuple[float, torch.Tensor]:
    """The step size and the denominator of ``m / denom`` at step ``t`` (1-based) of ``adam_style``."""
    return step_size(group, adam_style, t), denominators(group, adam_style, [exp_avg_sq], [t])[0]


def low_rank_adamw(
    entries: Sequence[tuple[dict[str, Any], torch.Tensor, dict[str, Any], bool]],
    adam_style: str,
    buffers: bnb.Buffers,
) -> list[tuple[float, torch.Tensor]]:
    """One AdamW step of each ``(state, low, group, eight_bit)``: a GaLore parameter's low-rank
    moments from its low-rank gradient ``low`` (counts the parameter's ``step``; 8-bit moments are
    read, updated in fp32 and re-quantised, as bitsandbytes' kernel does). Returns each step size
    and normalised step ``m / denom``.

    ``low`` may be this rank's partition of the low-rank gradient (1-D; the moments are then the
    same partition of the full moments): 8-bit partitions begin on a block boundary, so
    bitsandbytes' blocks of the partition are those of the full tensor. An empty partition (more
    ranks than blocks) only counts the step. The moments of one param group are updated by one
    ``torch._foreach_*`` call per operation (:func:`denominators`)."""
    out: list[tuple[float, torch.Tensor] | None] = [None] * len(entries)
    by_group: dict[int, list[int]] = collections.defaultdict(list)
    for i, (_, _, group, _) in enumerate(entries):
        by_group[id(group)].append(i)
    for idx in by_group.values():
        group = entries[idx[0]][2]
        beta1, beta2 = group["betas"]
        lows, exp_avg, exp_avg_sq, ts = [], [], [], []
        quantised: list[tuple[dict[str, Any], bnb.FullBlocks, torch.Tensor, torch.Tensor]] = []
        for i in idx:
            state, low, _, eight_bit = entries[i]
            if "low_rank_exp_avg" not in state:
                init_low_rank_state(state, low, eight_bit, buffers)
            else:  # moments saved with the other optim_bits; a partition of whole blocks: local
                carry = bnb.Batch8bit()
                carry_over(state, LOW_RANK, ParamLayout(tuple(low.shape)), low, eight_bit, carry)
                carry.store()
            state["step"] += 1
            buffers.prefetch(state["low_rank_exp_avg"], state["low_rank_exp_avg_sq"])
            # Whole moments or a partition of whole blocks: bitsandbytes' own blocks of them.
            blocks = bnb.FullBlocks(ParamLayout(tuple(low.shape)), low.device) if eight_bit and low.numel() else None
            if blocks is not None:
                m, v = (x.to(low.dtype) for x in read_moments(state, LOW_RANK, blocks))
                quantised.append((state, blocks, m, v))
            elif eight_bit:  # an empty partition
                m, v = torch.zeros_like(low), torch.zeros_like(low)
            else:
                m, v = state["low_rank_exp_avg"], state["low_rank_exp_avg_sq"]
            lows.append(low)
            exp_avg.append(m)
            exp_avg_sq.append(v)
            ts.append(float(state["step"]))
        scale_(exp_avg, beta1)
        torch._foreach_add_(exp_avg, lows, alpha=1.0 - beta1)
        scale_(exp_avg_sq, beta2)
        torch._foreach_addcmul_(exp_avg_sq, lows, lows, value=1.0 - beta2)
        norms = torch._foreach_div(exp_avg, denominators(group, adam_style, exp_avg_sq, ts))
        for state, blocks, m, v in quantised:
            write_moments(state, LOW_RANK, blocks, [m, v])
        for i, t, norm in zip(idx, ts, norms):
            out[i] = (step_size(group, adam_style, t), norm)
    return [step for step in out if step is not None]


def plain_moments_8bit(
    state: dict[str, Any], grad: torch.Tensor, blocks: bnb.FullBlocks, beta1: float, beta2: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's fp32 moments of a plain parameter from its 8-bit state (not stored)."""
    g = grad.float()
    m, v = read_moments(state, "", blocks)
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
        write_moments(state, "", blocks, [m, v], absmax)


def fused_plain_adamw(
    group: dict[str, Any],
    adam_style: str,
    states: list[dict[str, Any]],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
) -> bool:
    """fp32-moment AdamW of plain params through torch's fused kernel (one pass over param,
    grad and moments; on the CPU several times faster than the per-op path, which allocates
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
    lr, wd, eps = group_lr(group), group["weight_decay"], group["eps"]
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
