"""Conversions from heavyball's SOAP (PyPI ``heavyball`` 3.2.1: ``heavyball.SOAP``, ``heavyball.KLSOAP``).

SOAP (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using Adam", arXiv:2409.11321) and
KL-SOAP (Lin et al. 2025, arXiv:2509.03378) become :class:`~dist_optim.shampoo.DistributedShampoo`
with ``eigenvalue_correction=True`` and the options that make heavyball's algorithm:

* ``soap_step="heavyball"`` (:mod:`.preconditioner.heavyball`): a parameter's first step only seeds
  its factors (one Gram matrix each) and bases (``eigh``); later steps take Adam's direction in the
  bases of the previous step, then update the factors, then refresh; moments and factors kept as
  bias-corrected averages counted in the optimizer's steps (heavyball's group step), Adam's from
  the step after the seed (``adam_`` at ``step - 1``), ``epsilon`` flooring ``sqrt(S)``, and the
  refresh when the running float sum of ``1 / precondition_frequency`` passes an integer
  (``psgd_should_update``);
* ``eigenbasis="qr-lifted"``: heavyball's refresh (``get_orthogonal_matrix_QR``), one power step on
  the factor lifted by ``max(epsilon, 64 d eps_dtype)`` times its largest estimated eigenvalue, the
  columns sorted for the QR and put back in place, signs fixed; the first basis by ``eigh`` with
  LAPACK's signs (heavyball.SOAP floors the lift at 1e-8 whatever its eps, KLSOAP at its eps);
* ``shampoo_beta``, ``precondition_1d``, and ``merge_small_dims="trailing"`` for ``merge_dims``
  (heavyball keeps a tensor's first dim and merges the others from the last);
* ``max_preconditioner_dim=max_precond_dim``, decoupled ``weight_decay`` (``W (1 - lr wd) - lr P``),
  ``preconditioner_dtype`` the parameters' (heavyball's factors and bases are in the gradient's).

In float64 the converted optimizer steps as heavyball's (``tests/unit/test_heavyball_soap.py``), the
factors and bases bit for bit. Deviations: heavyball rounds the factors' average weight
``(1 - beta) / (1 - beta^n)`` to float32 (a Python float raised to its int64 step tensor) and its
learning rate too (``base_lr * step / step``); ours keep them in float64. heavyball's same-shape
parameters share one stacked kernel call (its bucket axis), ours are blocks of their own: the
same arithmetic per parameter. A group added to heavyball after it stepped counts its own steps;
ours counts the optimizer's.

Refused by name: what changes the chain (clipping, ``palm``, ``mars``), ``caution``,
``cautious_weight_decay``, ``warmup_steps``, ``split``, ``use_precond_schedule``, ECC states, a
``storage_dtype`` other than the parameters', bf16 parameters (stochastic rounding), a group mixing
fp32 and fp64 parameters, a (merged) dim above ``max_precond_dim`` (heavyball leaves that dim
unpreconditioned; DistributedShampoo cuts it into blocks), for SOAP an ``eps`` that changes its
lift's floor of 1e-8 (with fp32 parameters none below 1.5e-5) and, for KL-SOAP, a
(merged) dim of 1
(heavyball gives it no factor, and then the other factor plain statistics). heavyball's other
SOAP-family classes (NAdam, AdEMAMix or LaProp in the basis, the "Heavy" variants, KL-Shampoo) stay
refused as whole classes (:mod:`.conversions`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..registry import ANY, HEAVYBALL_NEUTRAL, Conversion, register
from .blocking import merge_trailing_dims
from .optimizer import DistributedShampoo

__all__: list[str] = []

# Group keys accepted only at heavyball's default (anything else changes the update).
_NEUTRAL: dict[str, Any] = {
    **HEAVYBALL_NEUTRAL,
    "beta2_scale": ANY,  # read only with palm
    "split": False,
    "use_precond_schedule": False,  # True refreshes by heavyball's precond_scheduler
    # multi_tensor=False steps each parameter alone: its first step then skips the weight decay that
    # the stacked step gives it where other parameters of the group step (soap_step="heavyball").
    "multi_tensor": True,
    "precond_grad_accum": ANY,  # not read by SOAP's chain
}
_READS = frozenset(
    {"lr", "betas", "eps", "weight_decay", "shampoo_beta", "max_precond_dim", "merge_dims", "precondition_1d"}
)


def _chain(opt: torch.optim.Optimizer) -> tuple[str, ...]:
    names = []
    for fn in getattr(opt, "fns", ()):
        inner = fn.get_fn() if hasattr(fn, "get_fn") else fn
        names.append(getattr(inner, "__name__", type(inner).__name__))
    return tuple(names)


def _frequency(opt: torch.optim.Optimizer) -> int:
    """heavyball's ``precondition_frequency`` from the probability it keeps (``1 / frequency``)."""
    prob = getattr(opt, "precond_schedule", None)
    if not isinstance(prob, float):
        raise ValueError(
            "use_precond_schedule=True refreshes by its own schedule (precond_scheduler); only a fixed "
            "precondition_frequency converts: use_precond_schedule=False"
        )
    freq = round(1 / prob)
    if freq < 1 or 1 / freq != prob:
        raise ValueError(
            f"precondition_frequency={1 / prob:g} is not an integer; DistributedShampoo's is: use an integer"
        )
    return freq


def _check_parameters(group: Mapping[str, Any], kl: bool) -> torch.dtype:
    """The parameters' dtype, after the checks of the module docstring."""
    storage = group.get("storage_dtype", "float32")
    dtypes = {p.dtype for p in group["params"]}
    if not dtypes <= {torch.float32, torch.float64}:
        bad = sorted(str(d) for d in dtypes - {torch.float32, torch.float64})
        raise ValueError(
            f"holds {', '.join(bad)} parameters, which heavyball rounds stochastically; convert with fp32 "
            "parameters (ColossalAI's mixed precision keeps fp32 masters)"
        )
    if len(dtypes) > 1:
        raise ValueError(
            "mixes fp32 and fp64 parameters in one group, whose factors heavyball keeps in each one's dtype; "
            "put them in groups of one dtype"
        )
    (dtype,) = dtypes or {torch.float32}
    if str(dtype).removeprefix("torch.") != storage:
        raise ValueError(
            f"keeps its moments in storage_dtype={storage!r} for {dtype} parameters; DistributedShampoo keeps "
            f"them in the parameter's dtype: use storage_dtype={str(dtype).removeprefix('torch.')!r}"
        )
    max_dim = group["max_precond_dim"]
    for p in group["params"]:
        view = tuple(p.shape) or (1,)
        if group["merge_dims"]:
            view = merge_trailing_dims(view, max_dim)
        if (len(view) > 1 or group["precondition_1d"]) and max(view) > max_dim:
            raise ValueError(
                f"holds a parameter of shape {tuple(p.shape)} (merged: {view}) with a dim above "
                f"max_precond_dim={max_dim}, which heavyball leaves unpreconditioned and DistributedShampoo cuts "
                f"into blocks: use max_precond_dim >= {max(view)}"
            )
        if kl and len(view) > 1 and 1 in view:
            raise ValueError(
                f"holds a parameter of shape {tuple(p.shape)} (merged: {view}) with a dim of 1, which heavyball "
                "gives no factor and then the other factor plain statistics: convert it with heavyball.SOAP, "
                "or reshape it to drop the dim"
            )
    return dtype


#: The floor of heavyball.SOAP's lift, whatever its eps (``_apply_soap_preconditioner``'s default;
#: KLSOAP passes its eps, as ``eigenbasis="qr-lifted"`` floors at ``epsilon``).
SOAP_LIFT_FLOOR = 1e-8


def _check_lift(group: Mapping[str, Any], dtype: torch.dtype) -> None:
    """heavyball.SOAP's lift is ``max(1e-8, 64 d eps_dtype)``, ours ``max(epsilon, 64 d eps_dtype)``:
    refused where the two differ for a preconditioned dim ``d`` of a parameter."""
    eps = group["eps"]
    for p in group["params"]:
        view = tuple(p.shape) or (1,)
        if group["merge_dims"]:
            view = merge_trailing_dims(view, group["max_precond_dim"])
        if len(view) == 1 and not group["precondition_1d"]:
            continue
        for d in view:
            noise = torch.tensor(min(64 * d * torch.finfo(dtype).eps, 0.125), dtype=dtype)
            ours, theirs = (torch.maximum(torch.tensor(f, dtype=dtype), noise) for f in (eps, SOAP_LIFT_FLOOR))
            if d > 1 and not torch.equal(ours, theirs):
                raise ValueError(
                    f"lifts the null space of its factors by max(1e-8, 64 d eps_dtype) whatever eps; eps={eps:g} "
                    f"changes that for a dim of {d} ({dtype}): use eps=1e-8 (with fp32 parameters any eps "
                    "below 1.5e-5 converts)"
                )


def _converter(name: str, chain: tuple[str, ...], kl: bool) -> Any:
    def options(opt: torch.optim.Optimizer, g: Mapping[str, Any]) -> dict[str, Any]:
        found = _chain(opt)
        if found != chain:
            raise ValueError(
                f"convert: heavyball.{name} runs the transforms {list(found)}; only its default chain "
                f"{list(chain)} (without gradient_clipping, update_clipping or palm) has an equivalent"
            )
        try:
            frequency = _frequency(opt)
            dtype = _check_parameters(g, kl) if "params" in g else torch.float32
            if "params" in g and not kl:
                _check_lift(g, dtype)
        except ValueError as exc:
            raise ValueError(f"convert: heavyball.{name} {exc}") from None
        return dict(
            lr=g["lr"],
            betas=tuple(g["betas"]),
            epsilon=g["eps"],
            weight_decay=g["weight_decay"],
            use_decoupled_weight_decay=True,
            max_preconditioner_dim=g["max_precond_dim"],
            precondition_frequency=frequency,
            start_preconditioning_step=1,
            eigenvalue_correction=True,
            eigenbasis="qr-lifted",
            soap_step="heavyball",
            shampoo_beta=g["shampoo_beta"],
            precondition_1d=g["precondition_1d"],
            merge_small_dims="trailing" if g["merge_dims"] else False,
            preconditioner_dtype=dtype,
            kl_statistics=kl,
            grafting_config=None,
            use_bias_correction=True,
        )

    return options


for _name, _chain_fns, _kl in (("SOAP", ("scale_by_soap",), False), ("KLSOAP", ("scale_by_kl_soap",), True)):
    register(
        Conversion(
            f"heavyball.{_name}", DistributedShampoo, _converter(_name, _chain_fns, _kl), _READS, neutral=_NEUTRAL
        )
    )
