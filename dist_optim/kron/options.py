"""Kron's options: the defaults of a param group and their checks.

:func:`validate_options` is what :meth:`DistributedKron.validate_group
<dist_optim.kron.optimizer.DistributedKron.validate_group>` runs on every group (from ``__init__``,
``add_param_group`` and ``load_state_dict``). :func:`check_optimizer_options` checks the three
arguments that are not group options (``seed``, ``communication_dtype``, ``probe_rng``: one value
for the whole optimizer, never in a param group), so ``validate_group`` never sees them; the
constructor calls it before the groups are checked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..base import check_lr, check_range
from ..comm.dtypes import check_communication_dtype
from .variant import VARIANTS

__all__ = [
    "MEMORY_SAVE_MODES",
    "PROBE_RNGS",
    "group_defaults",
    "check_optimizer_options",
    "validate_options",
    "check_probability",
    "check_preconditioner_bits",
    "precond_dtype",
    "HEAVYBALL_DEFAULTS",
]

MEMORY_SAVE_MODES = (None, "smart_one_diag", "one_diag", "all_diag")
PROBE_RNGS = ("sequential", "per_parameter")


def group_defaults(
    *,
    lr: float,
    b1: float,
    weight_decay: float,
    preconditioner_update_probability: float | Callable[[int], Any],
    max_size_triangular: int,
    min_ndim_triangular: int,
    memory_save_mode: str | None,
    momentum_into_precond_update: bool,
    precond_lr: float,
    precond_init_scale: float | None,
    merge_dims: bool,
    mu_dtype: torch.dtype | None,
    precond_dtype: torch.dtype | None,
    clip_update_rms: bool,
    use_symmetric_packing: bool,
    preconditioner_bits: int = 32,
    heavyball: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The param-group defaults in the order saved param groups list them (flags as bools)."""
    return dict(
        lr=lr,
        b1=b1,
        weight_decay=weight_decay,
        preconditioner_update_probability=preconditioner_update_probability,
        max_size_triangular=max_size_triangular,
        min_ndim_triangular=min_ndim_triangular,
        memory_save_mode=memory_save_mode,
        momentum_into_precond_update=bool(momentum_into_precond_update),
        precond_lr=precond_lr,
        precond_init_scale=precond_init_scale,
        merge_dims=bool(merge_dims),
        mu_dtype=mu_dtype,
        precond_dtype=precond_dtype,
        clip_update_rms=bool(clip_update_rms),
        use_symmetric_packing=use_symmetric_packing,  # checked, not converted: a non-bool is refused
        preconditioner_bits=preconditioner_bits,
        **{**HEAVYBALL_DEFAULTS, **(heavyball or {})},
    )


#: The options of ``variant="heavyball"`` (:mod:`dist_optim.kron.variant`) and the initial-scale
#: rule's, at their defaults (kron_torch's algorithm; heavyball's are in :mod:`dist_optim.kron.heavyball`).
HEAVYBALL_DEFAULTS: dict[str, Any] = dict(
    variant="kron_torch",
    dampening=1e-9,
    lower_bound_beta=0.9,
    power_iterations=2,
    precond_init_scale_power=1.0,
    precond_init_scale_scale=1.0,
    precond_init_scale_by_shape=False,
)


def _check_variant_options(group: dict[str, Any], optim_bits: int) -> None:
    if group["variant"] not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {group['variant']!r}")
    check_range("dampening", group["dampening"], 0.0)
    check_range("lower_bound_beta", group["lower_bound_beta"], 0.0, 1.0)
    check_range("precond_init_scale_scale", group["precond_init_scale_scale"], 0.0)
    check_range("precond_init_scale_power", group["precond_init_scale_power"], 0.0)
    by_shape = group.get("precond_init_scale_by_shape", False)
    if not isinstance(by_shape, bool):
        raise ValueError(f"precond_init_scale_by_shape must be a bool, got {by_shape!r}")
    if by_shape and group["precond_init_scale"] is not None:
        raise ValueError(
            "precond_init_scale_by_shape=True shares a scale computed from the first gradients: "
            f"use precond_init_scale=None, got {group['precond_init_scale']!r}"
        )
    value = group["power_iterations"]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"power_iterations must be an int >= 0, got {value!r}")
    # heavyball's variant is checked against heavyball with whole float factors and momenta only.
    if group["variant"] == "heavyball" and (group["use_symmetric_packing"] or group["preconditioner_bits"] != 32):
        raise ValueError(
            "variant='heavyball' keeps whole float factors: use use_symmetric_packing=False and "
            f"preconditioner_bits=32, got {group['use_symmetric_packing']!r} and {group['preconditioner_bits']!r}"
        )
    if group["variant"] == "heavyball" and optim_bits != 32:
        raise ValueError(f"variant='heavyball' keeps a float momentum: use optim_bits=32, got {optim_bits}")


def check_optimizer_options(seed: Any, communication_dtype: Any, probe_rng: Any) -> None:
    """The optimizer-wide arguments (not group options; see the module docstring)."""
    if probe_rng not in PROBE_RNGS:
        raise ValueError(f"probe_rng must be one of {PROBE_RNGS}, got {probe_rng!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int, got {seed!r}")
    check_communication_dtype(communication_dtype)


def validate_options(group: dict[str, Any], optim_bits: int = 32) -> None:
    """Check one param group's Kron options (``optim_bits``: the optimizer's), raising a ValueError
    that names the option."""
    check_lr(group["lr"])
    check_range("b1", group["b1"], 0.0, 1.0)
    check_range("weight_decay", group["weight_decay"], 0.0)
    check_range("precond_lr", group["precond_lr"], 0.0)
    if group["precond_init_scale"] is not None:
        check_range("precond_init_scale", group["precond_init_scale"], 0.0)
        if group["precond_init_scale"] <= 0:
            raise ValueError(
                f"precond_init_scale must be > 0, or None to set it from the first gradient, "
                f"got {group['precond_init_scale']}"
            )
    for name in ("max_size_triangular", "min_ndim_triangular"):
        value = group[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if group["memory_save_mode"] not in MEMORY_SAVE_MODES:
        raise ValueError(f"memory_save_mode must be one of {MEMORY_SAVE_MODES}, got {group['memory_save_mode']!r}")
    check_probability(group["preconditioner_update_probability"])
    if not isinstance(group["use_symmetric_packing"], bool):
        raise ValueError(f"use_symmetric_packing must be True or False, got {group['use_symmetric_packing']!r}")
    check_preconditioner_bits(group["preconditioner_bits"])
    _check_variant_options(group, optim_bits)
    for name in ("mu_dtype", "precond_dtype"):
        value = group[name]
        if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
            raise ValueError(f"{name} must be None or a floating-point torch.dtype, got {value!r}")


def check_preconditioner_bits(bits: Any) -> None:
    """32 (factors in ``precond_dtype``) or 8 (block-wise codes rounded stochastically,
    :mod:`dist_optim.kron.state`). 4 is refused: a 4-bit code is 1/7 of its block's absmax, and
    Kron's fit changes a factor by at most ``precond_lr`` (0.1) of it per update; with the same
    stochastic rounding 4-bit factors end further above full precision's held-out loss than the 2%
    the compact states are held to (``bench/compact_quality.py``; 8 bits end within it)."""
    if bits == 4 and not isinstance(bits, bool):
        raise ValueError(
            "preconditioner_bits=4 is not supported by DistributedKron: a 4-bit code is 1/7 of its block's "
            "absmax and a factor update changes at most precond_lr of it, so training ends beyond the 2% of "
            "held-out loss the compact states are held to (bench/compact_quality.py); use preconditioner_bits=8"
        )
    if isinstance(bits, bool) or bits not in (32, 8):
        raise ValueError(f"preconditioner_bits must be 32 or 8, got {bits!r}")


def check_probability(prob: Any) -> None:
    """A probability in (0, 1] or a callable of the step (checked when it is called:
    :func:`dist_optim.kron.schedule.threshold`)."""
    if callable(prob):
        return
    if not isinstance(prob, (int, float)) or isinstance(prob, bool) or not 0 < prob <= 1:
        raise ValueError(f"preconditioner_update_probability must be in (0, 1] or a callable of the step, got {prob!r}")


def precond_dtype(group: dict[str, Any]) -> torch.dtype:
    """The dtype of a group's factors, probes and directions (``precond_dtype``, default fp32)."""
    return group["precond_dtype"] or torch.float32
