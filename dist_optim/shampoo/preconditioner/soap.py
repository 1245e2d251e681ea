"""SOAP's preconditioner of one block: Adam in the eigenbasis of the factors, the basis refreshed
from them (the SOAP section of the package docstring)."""

from __future__ import annotations

from typing import Any

import torch

from ... import matrix_functions
from ..blocking import apply_each_dim
from ..state import BlockState
from .grafting import Moments, scale_direction

__all__ = ["refresh_bases", "direction"]


def refresh_bases(bs: BlockState, scale: float, group: dict[str, Any], first: bool) -> None:
    """``Q_k`` from ``A = scale L_k`` by ``eigenbasis`` (``first``: the refresh at the start step,
    which ``"qr-eigh-start"`` makes by ``eigh``); a refresh that is not finite keeps the previous
    basis and counts in ``failures``. ``"qr-eigh-start"`` permutes ``S`` with its columns."""
    failures, s = bs.failures, bs.exp_avg_sq
    assert failures is not None and s is not None
    mode = group["eigenbasis"]
    for k, (factor, q) in enumerate(zip(bs.factors, bs.bases)):
        a = factor * scale
        perm = None
        try:
            if mode == "qr":
                q_new, ok = matrix_functions.qr_algorithm_step(a, q, group["epsilon"])
            elif mode == "eigh" or first:
                q_new, ok = matrix_functions.eigenbasis(a)
            else:  # "qr-eigh-start" after its first refresh
                q_new, perm, ok = matrix_functions.qr_power_step(a, q)
        except torch.linalg.LinAlgError:
            q_new, perm, ok = q, None, torch.zeros((), dtype=torch.bool)
        q.copy_(torch.where(ok, q_new.to(q.dtype), q))
        if perm is not None:
            s.copy_(torch.where(ok, s.index_select(k, perm), s))
        failures.add_((~ok).to(failures.dtype))


def direction(
    bs: BlockState, moments: Moments, g: torch.Tensor, group: dict[str, Any], t: int, out: torch.Tensor
) -> torch.Tensor:
    """``S <- b2 S + (1 - b2) Gr^2`` with ``Gr = G x_k Q_k^T``, then
    ``P = (Mhat x_k Q_k^T) / (sqrt(S / (1 - b2^t)) + epsilon)`` rotated back with ``x_k Q_k``, into
    ``out``; grafted to ``||D||`` when grafting is configured. A block without preconditioner has
    no basis: Adam in the identity basis."""
    b2 = group["betas"][1]
    pdt = group["preconditioner_dtype"]
    mats = bs.bases
    s = bs.exp_avg_sq
    assert s is not None
    norm_d = moments.graft_norm(out) if group["grafting_config"] is not None else None
    gr = apply_each_dim(g.to(pdt), mats, transpose=False)
    if b2 == 1:
        s.add_(gr * gr)
    else:
        s.mul_(b2).add_(gr * gr * (1 - b2))
    shat = s / (1 - b2**t) if (group["use_bias_correction"] and b2 < 1) else s
    mr = apply_each_dim(moments.mhat().to(pdt), mats, transpose=False)
    out.copy_(apply_each_dim(mr / (shat.sqrt() + group["epsilon"]), mats, transpose=True))
    return scale_direction(out, 1.0, norm_d)
