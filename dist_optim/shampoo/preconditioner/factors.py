"""The Kronecker factors of one block: their statistics and the steps that refresh what is
computed from them (step 2 and the schedule of step 4 of the package docstring)."""

from __future__ import annotations

from typing import Any

import torch

from ... import structured
from ..blocking import Block, kept_triangle
from ..state import BlockState

__all__ = ["update_factors"]


def update_factors(
    bs: BlockState, block: Block, g: torch.Tensor, group: dict[str, Any], t: int, start: int
) -> float | None:
    """``L_k <- b2 L_k + (1 - b2) G_(k) G_(k)^T`` every ``statistics_compute_steps`` steps (one
    triangle of large factors, :func:`~dist_optim.shampoo.blocking.kept_triangle`). On a refresh
    step (``t == start``, then every ``precondition_frequency`` steps, once the factors have an
    update) every factor's kept triangle is mirrored onto the other (at every size: a factor
    updated whole, small or on a GPU, may round its two triangles apart; the mirror is the form a
    packed factor holds, :mod:`dist_optim.shampoo.state`) and the scale of their bias correction ``1 / (1 - b2^n)``
    is returned (``n`` factor updates so far); None on other steps."""
    b2 = group["betas"][1]
    order = block.order
    scs = group["statistics_compute_steps"]
    if t % scs == 0:
        gp = g.to(group["preconditioner_dtype"])
        for k, factor in enumerate(bs.factors):
            gk = gp.movedim(k, 0).reshape(block.shape[k], -1)
            structured.gram_update_(kept_triangle(factor, order, k), gk, b2, 1.0 if b2 == 1 else 1 - b2)
    n = t // scs  # factor updates so far
    if not (n > 0 and (t == start or (t > start and t % group["precondition_frequency"] == 0))):
        return None
    for k, factor in enumerate(bs.factors):
        structured.mirror_lower_(kept_triangle(factor, order, k))
    return 1.0 / (1 - b2**n) if (group["use_bias_correction"] and b2 < 1) else 1.0
