"""Conversions from heavyball (PyPI ``heavyball``, HomebrewML's compile-first optimizer library).

``heavyball.Muon`` becomes :class:`~dist_optim.muon.DistributedMuon` with the same update: its
default chain is ``nesterov_ema`` (``B <- lerp(B, G, 1 - beta1)``, ``C = G + B``: our
``momentum_ema`` with ``nesterov_sum``), then ``orthogonalize_update`` (``C / max(||C||_F, 1e-7)``,
five Newton-Schulz iterations with the per-iteration triples of :data:`HEAVYBALL_NS_COEFFICIENTS`,
the result times ``sqrt(max(1, rows / cols))``: our ``adjust_lr_fn="original"``), then
``W <- W (1 - lr wd) - lr X``. Equal in float64 (tests/unit/test_heavyball.py), where heavyball is
deterministic. Deviation: on fp32 parameters heavyball iterates in bfloat16 after rounding ``C``
*stochastically* (``stochastic_round_``), a random dither no other run reproduces; the conversion
iterates in bfloat16 with round-to-nearest (``ns_dtype=torch.bfloat16``), the same precision without
the dither. Anything else heavyball adds to the chain (``caution``, ``mars``, ``palm``, clipping,
warm-up, ECC states, stochastic rounding of bf16 parameters) is refused, naming the option.

heavyball's other orthogonalizing classes (its Muon variants routed per parameter or combined with
LaProp) have no exact equivalent: they are refused with the class to build instead, rather than
passed through by the plugins to orthogonalize a TP slice or ZeRO chunk as if it were the matrix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..kernels.newton_schulz import Coefficients
from ..registry import ANY, HEAVYBALL_NEUTRAL, Conversion, register, register_refusals
from .optimizer import DistributedMuon

__all__ = ["HEAVYBALL_NS_COEFFICIENTS"]

#: heavyball's ``zeropower_via_newtonschulz5`` schedule (from the modded-nanogpt speedrun records),
#: one triple per iteration.
HEAVYBALL_NS_COEFFICIENTS: tuple[Coefficients, ...] = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)

# heavyball.Muon's default chain (nesterov=True), by the innermost function of each transform.
_MUON_CHAIN = ("nesterov_ema", "orthogonalize_update")
# Group keys accepted only at heavyball's default (anything else changes the update).
_NEUTRAL: dict[str, Any] = {
    **HEAVYBALL_NEUTRAL,
    "palm": False,
    "beta2_scale": ANY,  # read only with palm
    "eps": ANY,  # heavyball's Muon floors the norm at a fixed 1e-7, not at eps
    "multi_tensor": ANY,  # how heavyball batches its kernels, not the update
    "heavyball_momentum": False,
    # Without nesterov heavyball steps a bias-corrected average whose correction counts the group's
    # steps, not the parameter's: a parameter that missed a step then moves differently.
    "nesterov": True,
}


def _chain(opt: torch.optim.Optimizer) -> tuple[str, ...]:
    names = []
    for fn in getattr(opt, "fns", ()):
        inner = fn.get_fn() if hasattr(fn, "get_fn") else fn
        names.append(getattr(inner, "__name__", type(inner).__name__))
    return tuple(names)


def _check_parameters(group: Mapping[str, Any]) -> None:
    storage = group.get("storage_dtype", "float32")
    for p in group["params"]:
        if p.dim() < 2:
            raise ValueError(
                f"holds a parameter of shape {tuple(p.shape)}, which heavyball.Muon steps by its momentum alone; "
                "DistributedMuon steps vectors with AdamW: convert with matrices only, or build "
                "DistributedMuon(dist_optim.muon_param_groups(model))"
            )
        if p.dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"holds a {p.dtype} parameter, which heavyball rounds stochastically; convert with fp32 "
                "parameters (ColossalAI's mixed precision keeps fp32 masters)"
            )
        if str(p.dtype).removeprefix("torch.") != storage:
            raise ValueError(
                f"keeps its momentum in storage_dtype={storage!r} for {p.dtype} parameters; DistributedMuon keeps "
                f"it in the parameter's dtype: use storage_dtype={str(p.dtype).removeprefix('torch.')!r}"
            )


def _heavyball_muon(opt: torch.optim.Optimizer, g: Mapping[str, Any]) -> dict[str, Any]:
    chain = _chain(opt)
    if chain != _MUON_CHAIN:
        raise ValueError(
            f"convert: heavyball.Muon runs the transforms {list(chain)}; only its default chain {list(_MUON_CHAIN)} "
            "(without gradient_clipping or update_clipping) has an equivalent"
        )
    if "params" in g:
        try:
            _check_parameters(g)
        except ValueError as exc:
            raise ValueError(f"convert: heavyball.Muon {exc}") from None
    beta1, _ = g["betas"]
    return dict(
        lr=g["lr"],
        weight_decay=g["weight_decay"],
        momentum=beta1,
        nesterov=True,
        momentum_ema=True,
        nesterov_sum=True,
        ns_coefficients=list(HEAVYBALL_NS_COEFFICIENTS),
        eps=1e-7,
        eps_form="max",
        adjust_lr_fn="original",
        ns_dtype=None if all(p.dtype == torch.float64 for p in g.get("params", ())) else torch.bfloat16,
        use_muon=True,
    )


register(
    Conversion(
        "heavyball.Muon",
        DistributedMuon,
        _heavyball_muon,
        frozenset({"lr", "weight_decay", "betas"}),
        neutral=_NEUTRAL,
    )
)

register_refusals(
    {
        "heavyball.MuonAdamW": "routes the matrices and vectors of one group to Muon and to its own Adam",
        "heavyball.MuonLaProp": "orthogonalizes LaProp's normalised update",
        "heavyball.OrthoLaProp": "orthogonalizes the gradient before LaProp",
        "heavyball.LaPropOrtho": "orthogonalizes LaProp's update",
        "heavyball.Scion": "steps each parameter by its norm's linear minimization oracle",
        "heavyball.HyperBallAdamW": "keeps every parameter on the sphere of its initial norm",
    },
    DistributedMuon,
    "it needs whole parameters and has no dist_optim equivalent: build "
    "DistributedMuon(dist_optim.muon_param_groups(model)) instead, or keep it on whole parameters "
    "(ColossalAI's stock TorchDDPPlugin)",
)
