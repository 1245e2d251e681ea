"""The first moment and the grafting direction of a step's blocks (step 3 of the package docstring).

:func:`update_moments` updates one block's ``M`` and grafting state ``V`` and returns a
:class:`Moments` that gives ``Mhat``, the grafting direction ``D`` and its norm;
:func:`update_moments_all` does it for a batch of blocks, with Adam grafting (the usual
configuration) all their moments and ``D`` s from one call of torch's fused Adam kernel.
:func:`graft_norms` and :func:`scale_directions` are the grafting's norms and scaling over a
batch (``torch._foreach_*``: one kernel launch per batch on a GPU, the same per-tensor operations
on the CPU, so a block's bits do not depend on its batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ...checks import group_lr
from ...kernels.fused_adam import fused_applies
from ...kernels.multi_tensor import scale_
from ..options import SQUARED_GRAFTING_TYPES, AdaGradGraftingConfig, AdamGraftingConfig
from ..state import BlockState

__all__ = [
    "Moments",
    "update_moments",
    "update_moments_all",
    "updates_in_kernel",
    "graft_norms",
    "scale_directions",
]


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
    is then ``lr``), no momentum on the direction."""
    return (
        isinstance(group["grafting_config"], AdamGraftingConfig)
        and group["betas"][0] > 0
        and group["use_bias_correction"]
        and group["momentum"] == 0
    )


def graft_norms(moments: list[Moments], outs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``||D||`` of each block (``outs``: as given to :func:`update_moments`), before the
    preconditioned direction overwrites ``out``."""
    if all(m.graft_in_out for m in moments):
        return list(torch._foreach_norm(outs)) if outs else []
    return [m.graft_norm(out) for m, out in zip(moments, outs)]


def scale_directions(ps: list[torch.Tensor], m_div: float, norm_ds: list[torch.Tensor] | None) -> None:
    """In place, each ``P = p / m_div`` (``p`` was computed from the moment before its bias
    correction), then grafted to its ``||D||`` when ``norm_ds`` is given:
    ``P ||D|| / (||P|| + 1e-16)`` (one multiplication: ``p ||D|| / (||p|| + 1e-16 m_div)``)."""
    if not ps:
        return
    if norm_ds is None:
        if m_div != 1.0:
            torch._foreach_div_(ps, m_div)
        return
    norm_ps = torch._foreach_norm(ps)
    torch._foreach_add_(norm_ps, 1e-16 * m_div)
    scale_(ps, torch._foreach_div(norm_ds, norm_ps))


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
    whole update ``W <- W - lr (D + weight_decay W)``: separate operations would make block-sized
    temporaries (``bench/bench_step.py --only shampoo`` times the step). The kernel computes the first moment as
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
            return _fused_adam_all([m], [v], [g], group, t, [step], [out], [apply_to])[0]
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


def update_moments_all(
    bss: list[BlockState],
    gs: list[torch.Tensor],
    group: dict[str, Any],
    t: int,
    steps: list[torch.Tensor],
    outs: list[torch.Tensor],
    fused: bool,
    apply_tos: list[torch.Tensor | None],
) -> list[Moments]:
    """:func:`update_moments` of a batch of blocks of ``group`` at step ``t``. Where the fused
    kernel takes every block (Adam grafting, one dtype and device), it is called once for the
    blocks it updates on their parameter (``apply_tos``) and once for the others, instead of once
    per block: the same per-element arithmetic, so the same bits."""
    graft = group["grafting_config"]
    if fused and group["betas"][0] > 0 and isinstance(graft, AdamGraftingConfig) and bss:
        ms = [bs.exp_avg for bs in bss]
        vs = [bs.graft_sq for bs in bss]
        if all(m is not None for m in ms) and all(v is not None for v in vs):
            if fused_applies(*outs, *gs, *ms, *vs):  # type: ignore[arg-type]
                return _fused_adam_all(ms, vs, gs, group, t, steps, outs, apply_tos)  # type: ignore[arg-type]
    return [
        update_moments(bs, g, group, t, step, out, fused, a)
        for bs, g, step, out, a in zip(bss, gs, steps, outs, apply_tos)
    ]


def _fused_adam_all(
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    gs: list[torch.Tensor],
    group: dict[str, Any],
    t: int,
    steps: list[torch.Tensor],
    outs: list[torch.Tensor],
    apply_tos: list[torch.Tensor | None],
) -> list[Moments]:
    """:func:`update_moments_all` by torch's fused Adam kernel (Adam grafting, ``betas[0] > 0``)."""
    b1 = group["betas"][0]
    graft = group["grafting_config"]
    bc1 = 1.0 - b1**t
    m_div = bc1 if group["use_bias_correction"] else 1.0
    if outs[0].device.type != "cpu":
        # The kernel reads the step count on the blocks' device. A copy of the CPU counter would
        # synchronise with the GPU once per block (39 waits a step on the bench set, an H100 idle
        # between them); a fill of the same value ``t`` is queued like any kernel.
        steps = [torch.full((), float(t), dtype=steps[0].dtype, device=outs[0].device)] * len(outs)
    kw = dict(beta1=b1, beta2=graft.beta2, eps=graft.epsilon, amsgrad=False, maximize=False)
    # A block the kernel cannot update in place (a strided slice of its parameter) gets its
    # direction, which the caller applies; each block's choice is its own, whatever its batch.
    targets = {i: a for i, a in enumerate(apply_tos) if a is not None and fused_applies(a, gs[i])}
    if targets:
        # W <- W (1 - lr wd) - lr Mhat / (sqrt(Vhat) + eps_g): AdamW's kernel, one pass over the
        # block instead of the direction's and then the update's.
        wd = group["weight_decay"] if group["use_decoupled_weight_decay"] else 0.0
        kernel = torch._fused_adamw_ if wd != 0 else torch._fused_adam_
        kernel(
            list(targets.values()),
            [gs[i] for i in targets],
            [ms[i] for i in targets],
            [vs[i] for i in targets],
            [],
            [steps[i] for i in targets],
            lr=group_lr(group),
            weight_decay=wd,
            **kw,
        )
    rest = [i for i in range(len(outs)) if i not in targets]
    if rest:
        rest_outs = [outs[i] for i in rest]
        torch._foreach_zero_(rest_outs)
        # lr / (1 - b1^t) is the kernel's step size: -1 (bias-corrected) or -(1 - b1^t).
        torch._fused_adam_(
            rest_outs,
            [gs[i] for i in rest],
            [ms[i] for i in rest],
            [vs[i] for i in rest],
            [],
            [steps[i] for i in rest],
            lr=-1.0 if m_div != 1.0 else -bc1,
            weight_decay=0.0,
            **kw,
        )
    return [Moments(m, m_div, True, applied=i in targets) for i, m in enumerate(ms)]
