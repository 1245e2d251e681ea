"""Conversion of heavyball's PSGD Kron (PyPI ``heavyball`` 3.2.1: ``heavyball.PSGDKron``).

PSGD (Li 2015, arXiv:1512.04202; Kronecker factors on the Lie group, Li 2018, arXiv:1809.10232) as
heavyball runs it becomes :class:`~dist_optim.kron.DistributedKron` with ``variant="heavyball"``
(:mod:`.variant`: heavyball's momentum, running-sum update rule, noise, balancing, lower-bounded
factor steps, trust-region clip, weight decay and dropped unit dims) and the options that carry
heavyball's values: ``lr``, ``b1`` (``beta``, else ``betas[0]``; ``exp_avg_input=False``: 0),
``weight_decay``, the update probability (a float, or heavyball's default schedule as
:class:`~.variant.HeavyballSchedule`), ``max_size_triangular``, ``min_ndim_triangular``,
``memory_save_mode``, ``momentum_into_precond_update``, ``precond_lr``, ``precond_init_scale`` (and
with None its ``_scale`` and ``_power``, None meaning heavyball's 0.5), ``dampening``,
``lower_bound_beta``, ``precond_update_power_iterations``, ``q_dtype`` (``precond_dtype``),
``storage_dtype`` (the parameters' dtype: ``mu_dtype``), ``update_clipping`` (heavyball's default
trust-region clip or None: ``clip_update_rms``). ``store_triu_as_line`` is how heavyball stores the
same factors. In float64 the converted optimizer steps as heavyball's
(``tests/unit/test_heavyball_psgd.py``). Deviations: heavyball rounds the momentum's weight to
float32 (a Python float raised to its int64 step tensor) and its learning rate too; ours are
float64. The probes come from the optimizer's generator (``seed``), not torch's global one.

Refused by name: ``delayed``, ``cached``, ``precond_grad_accum``, ``caution``, ``mars``, ``palm``,
``warmup_steps``, ``cautious_weight_decay``, gradient clipping, an update clipping other than
heavyball's default, ``split``, ``merge_dims`` on a tensor of more than 2 dims (heavyball merges
trailing dims up to ``max_size_triangular``), ``memory_save_mode="one_triu"``, a schedule other than
a float or heavyball's own, ECC states, ``q_dtype`` other than float32/float64, a ``storage_dtype``
other than the parameters', low-precision parameters (stochastic rounding), the Hessian-vector
modes.

With ``precond_init_scale=None`` and ``multi_tensor=True`` (heavyball's defaults) parameters of one
shape that start together share their initial scale, from their stacked gradients
(``precond_init_scale_by_shape``, :mod:`dist_optim.kron.init_scale`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from ..registry import ANY, HEAVYBALL_NEUTRAL, Conversion, register
from .optimizer import DistributedKron
from .variant import HeavyballSchedule

__all__: list[str] = []

_NEUTRAL: dict[str, Any] = {
    **HEAVYBALL_NEUTRAL,
    "eps": ANY,  # not read by PSGD
    "split": False,
    "delayed": False,  # True preconditions with the factors before their update
    "cached": False,
    "precond_grad_accum": False,
    "store_triu_as_line": ANY,  # the same factors stored as their upper triangle
    "exp_avg_input": ANY,  # b1 below
    "beta": ANY,
    "merge_dims": ANY,  # checked below
    "q_dtype": ANY,
}
_READS = frozenset(
    {
        "lr",
        "betas",
        "weight_decay",
        "max_size_triangular",
        "min_ndim_triangular",
        "memory_save_mode",
        "momentum_into_precond_update",
        "precond_lr",
        "precond_init_scale",
        "precond_init_scale_scale",
        "precond_init_scale_power",
        "lower_bound_beta",
        "dampening",
        "precond_update_power_iterations",
        "multi_tensor",  # the initial scale by shape
    }
)
_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _chain(opt: torch.optim.Optimizer) -> tuple[str, ...]:
    names = []
    for fn in getattr(opt, "fns", ()):
        inner = fn.func if isinstance(fn, functools.partial) else fn
        inner = inner.get_fn() if hasattr(inner, "get_fn") else inner
        names.append(getattr(inner, "__name__", type(inner).__name__))
    return tuple(names)


def _schedule(opt: torch.optim.Optimizer) -> Any:
    prob = getattr(opt, "precond_schedule", None)
    if isinstance(prob, float):
        return prob
    if (
        isinstance(prob, functools.partial)
        and getattr(prob.func, "__name__", "") == "_inner_precond_update_prob_schedule"
    ):
        return HeavyballSchedule(**{k: float(v) for k, v in prob.keywords.items()})
    raise ValueError(
        f"updates its preconditioner by the schedule {prob!r}; only a float or heavyball's "
        "precond_update_prob_schedule(...) converts"
    )


def _check_parameters(group: Mapping[str, Any]) -> torch.dtype:
    dtypes = {p.dtype for p in group["params"]}
    if not dtypes <= set(_DTYPES.values()) or len(dtypes) > 1:
        raise ValueError(
            f"holds {sorted(str(d) for d in dtypes)} parameters; convert groups of one of float32 or float64 "
            "(heavyball rounds lower precisions stochastically)"
        )
    (dtype,) = dtypes or {torch.float32}
    if _DTYPES.get(group["storage_dtype"]) != dtype:
        raise ValueError(f"keeps its momentum in storage_dtype={group['storage_dtype']!r}: use the parameters' dtype")
    if group["q_dtype"] not in _DTYPES:
        raise ValueError(f"keeps its factors in q_dtype={group['q_dtype']!r}: use 'float32' or 'float64'")
    if group["merge_dims"] and any(p.dim() > 2 for p in group["params"]):
        raise ValueError("merge_dims=True merges trailing dims its own way (dim_merger): use merge_dims=False")
    return dtype


def _heavyball_psgd_kron(opt: torch.optim.Optimizer, g: Mapping[str, Any]) -> dict[str, Any]:
    chain = _chain(opt)
    clip = chain[-1:] == ("apply_trust_region_clip__to_2",)
    core = chain[:-1] if clip else chain
    want = ("exp_avg", "scale_by_psgd") if g.get("exp_avg_input", True) else ("scale_by_psgd",)
    fused = want[:-1] + ("update_by_psgd",)
    if core not in (want, fused) or (clip and core == fused):
        raise ValueError(
            f"convert: heavyball.PSGDKron runs the transforms {list(chain)}; only its default chain (without "
            "gradient_clipping or palm; update_clipping heavyball's default or None) has an equivalent"
        )
    try:
        prob = _schedule(opt)
        if getattr(opt, "hessian_approx", False):
            raise ValueError("hessian_approx=True fits Hessian-vector products: use hessian_approx=False")
        if g.get("memory_save_mode") == "one_triu":
            raise ValueError(
                "memory_save_mode='one_triu' has no equivalent: use None, 'one_diag', 'smart_one_diag' or 'all_diag'"
            )
        dtype = _check_parameters(g) if "params" in g else torch.float32
    except ValueError as exc:
        raise ValueError(f"convert: heavyball.PSGDKron {exc}") from None
    beta = g.get("beta")
    b1 = beta if beta is not None else g["betas"][0]
    power = g["precond_init_scale_power"]
    return dict(
        lr=g["lr"],
        b1=b1 if g.get("exp_avg_input", True) else 0.0,
        weight_decay=g["weight_decay"],
        preconditioner_update_probability=prob,
        max_size_triangular=g["max_size_triangular"],
        min_ndim_triangular=g["min_ndim_triangular"],
        memory_save_mode=g["memory_save_mode"],
        momentum_into_precond_update=g["momentum_into_precond_update"],
        precond_lr=g["precond_lr"],
        precond_init_scale=g["precond_init_scale"],
        merge_dims=False,
        mu_dtype=dtype,
        precond_dtype=_DTYPES.get(g.get("q_dtype", "float32"), torch.float32),
        clip_update_rms=clip,
        variant="heavyball",
        dampening=g["dampening"],
        lower_bound_beta=g["lower_bound_beta"],
        power_iterations=g["precond_update_power_iterations"],
        precond_init_scale_power=0.5 if power is None else float(power),
        precond_init_scale_scale=float(g["precond_init_scale_scale"] or 1),
        precond_init_scale_by_shape=bool(g.get("multi_tensor", True)) and g["precond_init_scale"] is None,
    )


register(Conversion("heavyball.PSGDKron", DistributedKron, _heavyball_psgd_kron, _READS, neutral=_NEUTRAL))
