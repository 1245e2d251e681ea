"""The first moment and the grafting direction of one block (step 3 of the package docstring).

:func:`update_moments` updates ``M`` and the grafting state ``V`` and returns a :class:`Moments`
that gives ``Mhat``, the grafting direction ``D`` and its norm. With Adam grafting (the usual
configuration) both moments and ``D`` come from torch's fused Adam kernel in one pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ...fused_adam import fused_applies
from ..options import SQUARED_GRAFTING_TYPES, AdaGradGraftingConfig, AdamGraftingConfig
from ..state import BlockState

__all__ = ["Moments", "update_moments", "updates_in_kernel", "scale_direction"]


@dataclass
class Moments:
    """One block's moments after :func:`update_moments`: ``Mhat = mom / m_div`` (``mom`` is the
    first moment, or G without one); the grafting direction is in ``out`` when ``graft_in_out``
    (otherwise it is ``Mhat``, not materialised); ``applied``: the fused kernel already made the
    whole update on the parameter block."""

    mom: torch.Tensor
    m_div: float
    graft_in_out: bool
    applied: bool = False

    def mhat(self) -> torch.Tensor:
        return self.mom / self.m_div if self.m_div != 1.0 else self.mom

    def graft_direction(self, out: torch.Tensor) -> torch.Tensor:
        """``D``, in ``out``."""
        if not self.graft_in_out:
            torch.div(self.mom, self.m_div, out=out)
        return out

    def graft_norm(self, out: torch.Tensor) -> torch.Tensor:
        """``||D||`` (``out``: as given to :func:`update_moments`)."""
        if self.graft_in_out:
            return torch.linalg.vector_norm(out)
        return torch.linalg.vector_norm(self.mom) / self.m_div


def updates_in_kernel(group: dict[str, Any]) -> bool:
    """Whether a grafting-only step of ``group`` can be made by Adam's fused kernel on the
    parameter itself: Adam grafting with a bias-corrected first moment (the kernel's step size
    is then ``lr``), no momentum on the direction, a plain float learning rate."""
    return (
        isinstance(group["grafting_config"], AdamGraftingConfig)
        and group["betas"][0] > 0
        and group["use_bias_correction"]
        and group["momentum"] == 0
        and isinstance(group["lr"], (float, int))
    )


def scale_direction(p: torch.Tensor, m_div: float, norm_d: torch.Tensor | None) -> torch.Tensor:
    """In place, one pass: ``P = p / m_div`` (``p`` was computed from the moment before its bias
    correction), then grafted to ``||D||`` when ``norm_d`` is given: ``P ||D|| / (||P|| + 1e-16)``."""
    if norm_d is None:
        return p.div_(m_div) if m_div != 1.0 else p
    norm_p = torch.linalg.vector_norm(p)
    return p.mul_(norm_d / (norm_p + 1e-16 * m_div))


def update_moments(
    bs: BlockState,
    g: torch.Tensor,
    group: dict[str, Any],
    t: int,
    step: torch.Tensor,
    out: torch.Tensor,
    fused: bool,
    apply_to: torch.Tensor | None = None,
) -> Moments:
    """First-moment and grafting-state updates of one block (``step``: the parameter's step
    counter tensor, ``t`` its value).

    With Adam grafting both moments and the direction come from torch's fused Adam kernel in one
    pass when ``fused`` (``out`` as a zero "parameter" and ``lr = -1``: it then holds
    ``Mhat / (sqrt(V / (1 - gb2^t)) + eps_g)``), or, with ``apply_to`` (the parameter block) the
    whole update ``W <- W - lr (D + weight_decay W)``; on the CPU that is ~4x faster than separate
    operations, which make block-sized temporaries. The kernel computes the first moment as
    ``lerp`` where the formula reads ``b1 M + (1 - b1) G`` (the same value, rounded once). SOAP
    passes ``fused=False`` and gets the formula's own rounding: its update depends on the basis
    chosen inside degenerate eigenspaces of the factors (early, low-rank ones), i.e. on their last
    bits, so only the same rounding can be compared with a reference at all."""
    b1 = group["betas"][0]
    graft = group["grafting_config"]
    m_div = 1.0 - b1**t if (group["use_bias_correction"] and b1 > 0) else 1.0
    if b1 == 0:
        mom = g
    else:
        m, v = bs.exp_avg, bs.graft_sq
        assert m is not None
        if fused and isinstance(graft, AdamGraftingConfig) and v is not None and fused_applies(out, g, m, v):
            return _fused_adam(bs, g, group, t, step, out, apply_to)
        mom = m.mul_(b1).add_(g, alpha=1 - b1)
    if not isinstance(graft, SQUARED_GRAFTING_TYPES):
        return Moments(mom, m_div, False)
    v = bs.graft_sq
    assert v is not None
    if isinstance(graft, AdaGradGraftingConfig):
        v.addcmul_(g, g)
    else:
        v.mul_(graft.beta2).addcmul_(g, g, value=1 - graft.beta2)
    torch.sqrt(v, out=out)
    if isinstance(graft, AdamGraftingConfig):
        out.div_(math.sqrt(1 - graft.beta2**t))
    moments = Moments(mom, m_div, True)
    torch.div(moments.mhat(), out.add_(graft.epsilon), out=out)
    return moments


def _fused_adam(
    bs: BlockState,
    g: torch.Tensor,
    group: dict[str, Any],
    t: int,
    step: torch.Tensor,
    out: torch.Tensor,
    apply_to: torch.Tensor | None,
) -> Moments:
    """:func:`update_moments` by torch's fused Adam kernel (Adam grafting, ``betas[0] > 0``)."""
    b1 = group["betas"][0]
    graft = group["grafting_config"]
    bc1 = 1.0 - b1**t
    m_div = bc1 if group["use_bias_correction"] else 1.0
    m, v = bs.exp_avg, bs.graft_sq
    assert m is not None and v is not None
    # The kernel reads the step count on the block's device. A copy of the CPU counter would
    # synchronise with the GPU once per block (39 waits a step on the bench set, an H100 idle
    # between them); a fill of the same value ``t`` is queued like any kernel.
    step = step if out.device.type == "cpu" else torch.full((), float(t), dtype=step.dtype, device=out.device)
    if apply_to is not None and fused_applies(apply_to, g):
        # W <- W (1 - lr wd) - lr Mhat / (sqrt(Vhat) + eps_g): AdamW's kernel, one pass over the
        # block instead of the direction's and then the update's.
        wd = group["weight_decay"] if group["use_decoupled_weight_decay"] else 0.0
        kernel = torch._fused_adamw_ if wd != 0 else torch._fused_adam_
        kernel(
            [apply_to],
            [g],
            [m],
            [v],
            [],
            [step],
            lr=float(group["lr"]),
            beta1=b1,
            beta2=graft.beta2,
            weight_decay=wd,
            eps=graft.epsilon,
            amsgrad=False,
            maximize=False,
        )
        return Moments(m, m_div, True, applied=True)
    out.zero_()
    # lr / (1 - b1^t) is the kernel's step size: -1 (bias-corrected) or -(1 - b1^t).
    torch._fused_adam_(
        [out],
        [g],
        [m],
        [v],
        [],
        [step],
        lr=-1.0 if m_div != 1.0 else -bc1,
        beta1=b1,
        beta2=graft.beta2,
        weight_decay=0.0,
        eps=graft.epsilon,
        amsgrad=False,
        maximize=False,
    )
    return Moments(m, m_div, True)
