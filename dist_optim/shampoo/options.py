"""Shampoo's options: the grafting configurations (Meta's names) and the checks of a param group.

:func:`validate_options` is what :meth:`DistributedShampoo.validate_group
<dist_optim.shampoo.optimizer.DistributedShampoo.validate_group>` runs on every group; the
grafting configurations check their own fields when made.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..base import check_lr, check_range
from ..comm.dtypes import check_communication_dtype
from ..kernels import matrix_functions
from ..states import lowbit
from ..states.codecs import check_8bit_options
from ..states.saved import register_option_class

__all__ = [
    "SGDGraftingConfig",
    "AdaGradGraftingConfig",
    "RMSpropGraftingConfig",
    "AdamGraftingConfig",
    "GraftingConfig",
    "GRAFTING_TYPES",
    "SQUARED_GRAFTING_TYPES",
    "EIGENBASES",
    "SOAP_STEPS",
    "MERGE_RULES",
    "ROOT_INVERSES",
    "WARM",
    "uses_warm_refresh",
    "COMM_DTYPES",
    "check_int",
    "check_positive",
    "check_beta2",
    "check_communication",
    "validate_options",
    "start_step",
    "GROUP_OPTIONS",
    "group_defaults",
]


def check_positive(name: str, value: Any) -> None:
    """A finite number > 0."""
    check_range(name, value, 0.0, open_low=True)


def check_beta2(name: str, value: Any) -> None:
    """A finite number in (0, 1]: a second-moment EMA (1: a plain sum)."""
    check_range(name, value, 0.0, 1.0, open_low=True, closed_high=True)


def check_int(name: str, value: Any, low: int) -> None:
    """An integer (not a bool) >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


# ---- grafting configurations (Meta's names) ---------------------------------------------------
@dataclass(frozen=True)
class SGDGraftingConfig:
    """Graft the per-block norm of ``Mhat`` (SGD with the first moment)."""


@dataclass(frozen=True)
class AdaGradGraftingConfig:
    """Graft the per-block norm of AdaGrad's direction: ``V += G^2``, ``Mhat / (sqrt(V) + epsilon)``."""

    epsilon: float = 1e-10

    def __post_init__(self) -> None:
        check_positive("AdaGradGraftingConfig.epsilon", self.epsilon)


@dataclass(frozen=True)
class RMSpropGraftingConfig:
    """Graft RMSprop: ``V <- beta2 V + (1 - beta2) G^2``, ``Mhat / (sqrt(V) + epsilon)``."""

    beta2: float = 0.99
    epsilon: float = 1e-8

    def __post_init__(self) -> None:
        check_beta2("RMSpropGraftingConfig.beta2", self.beta2)
        check_positive("RMSpropGraftingConfig.epsilon", self.epsilon)


@dataclass(frozen=True)
class AdamGraftingConfig:
    """Graft Adam: as RMSprop, with ``V`` bias-corrected by ``1 - beta2^t``."""

    beta2: float = 0.999
    epsilon: float = 1e-8

    def __post_init__(self) -> None:
        if isinstance(self.beta2, (int, float)) and not isinstance(self.beta2, bool) and self.beta2 == 1:
            # 1 - beta2^t would be 0: V would never move and the bias correction divide by zero.
            raise ValueError(
                "AdamGraftingConfig.beta2 must be in (0, 1), got 1; use AdaGradGraftingConfig for a plain sum"
            )
        check_beta2("AdamGraftingConfig.beta2", self.beta2)
        check_positive("AdamGraftingConfig.epsilon", self.epsilon)


GraftingConfig = SGDGraftingConfig | AdaGradGraftingConfig | RMSpropGraftingConfig | AdamGraftingConfig
GRAFTING_TYPES = (SGDGraftingConfig, AdaGradGraftingConfig, RMSpropGraftingConfig, AdamGraftingConfig)
# Saved param groups (state_dict, checkpoints) hold a grafting config as its fields.
for _cls in GRAFTING_TYPES:
    register_option_class(_cls)
#: The grafting methods that keep a second moment ``V`` per block (state ``graft_sq``).
SQUARED_GRAFTING_TYPES = (AdaGradGraftingConfig, RMSpropGraftingConfig, AdamGraftingConfig)
#: The refresh of ``root_inverse`` / ``eigenbasis`` warm-started from the block's previous
#: eigenvectors (:func:`dist_optim.kernels.matrix_functions.warm_eigh`, options ``refresh_tolerance`` and
#: ``refresh_iterations``); the block keeps its eigenvectors (state ``basis<k>``).
WARM = "warm"
EIGENBASES = ("eigh", "eigh-ascending", "qr", "qr-eigh-start", "qr-lifted", WARM)
#: SOAP's step: ``"default"`` (statistics, refresh, then Adam in the refreshed bases, as Meta's) or
#: ``"heavyball"`` (heavyball's SOAP: :mod:`dist_optim.shampoo.preconditioner.heavyball`).
SOAP_STEPS = ("default", "heavyball")
#: ``merge_small_dims``: off, Anil et al.'s rule (True), or heavyball's (``"trailing"``: the first dim
#: kept, the others merged from the last while their product stays within the block side).
MERGE_RULES = (False, True, "trailing")
ROOT_INVERSES = (*matrix_functions.ROOT_METHODS, WARM)
COMM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


#: The per-group options of :class:`~dist_optim.shampoo.optimizer.DistributedShampoo` (its other
#: arguments, ``communication_dtype``, ``bucket_bytes`` and ``nonfinite``, are optimizer-wide).
GROUP_OPTIONS = (
    "lr",
    "betas",
    "epsilon",
    "momentum",
    "weight_decay",
    "max_preconditioner_dim",
    "precondition_frequency",
    "start_preconditioning_step",
    "use_nesterov",
    "use_bias_correction",
    "use_decoupled_weight_decay",
    "grafting_config",
    "root_inverse",
    "eigenvalue_correction",
    "eigenbasis",
    "merge_small_dims",
    "exponent_override",
    "exponent_multiplier",
    "preconditioner_dtype",
    "statistics_compute_steps",
    "skip_preconditioning_dim_size_gt",
    "inverse_failure_threshold",
    "higher_order_degree",
    "refresh_tolerance",
    "refresh_iterations",
    "use_symmetric_packing",
    "optim_bits",
    "min_8bit_size",
    "preconditioner_bits",
    "kl_statistics",
    "shampoo_beta",
    "soap_step",
    "precondition_1d",
)
_FLAGS = (
    "use_nesterov",
    "use_bias_correction",
    "use_decoupled_weight_decay",
    "eigenvalue_correction",
    "kl_statistics",
    "precondition_1d",
)


def group_defaults(**options: Any) -> dict[str, Any]:
    """The param-group defaults, in :data:`GROUP_OPTIONS` order, from the constructor's arguments:
    ``start_preconditioning_step=None`` is ``precondition_frequency``, ``betas`` a tuple, flags bools."""
    out = {name: options[name] for name in GROUP_OPTIONS}
    if out["start_preconditioning_step"] is None:
        out["start_preconditioning_step"] = out["precondition_frequency"]
    if isinstance(out["betas"], (tuple, list)):
        out["betas"] = tuple(out["betas"])
    for name in _FLAGS:
        out[name] = bool(out[name])
    merge = out["merge_small_dims"]
    if merge != "trailing" and merge in MERGE_RULES:  # another value is refused by validate_options
        out["merge_small_dims"] = bool(merge)
    return out


def uses_warm_refresh(group: dict[str, Any]) -> bool:
    """Whether the group's refresh is :data:`WARM` (Shampoo's ``root_inverse``, SOAP's ``eigenbasis``)."""
    return (group["eigenbasis"] if group["eigenvalue_correction"] else group["root_inverse"]) == WARM


def start_step(group: dict[str, Any]) -> int:
    """The first step that uses the preconditioner (``start_preconditioning_step`` 0 and 1 alike)."""
    return max(1, group["start_preconditioning_step"])


def check_communication(communication_dtype: Any) -> None:
    """The optimizer-wide communication option (not per group; ``bucket_bytes`` is checked by
    :func:`dist_optim.sharding.budget.check_bucket_bytes`)."""
    # Not None: owners round their shared results in this dtype, so it must name one.
    check_communication_dtype(communication_dtype, COMM_DTYPES)


def validate_options(group: dict[str, Any]) -> None:
    """Check one param group's Shampoo options, raising a ValueError (TypeError for a non-number)
    that names the option."""
    _check_step_options(group)
    _check_integers(group)
    _check_methods(group)
    _check_roots(group)
    if group["preconditioner_dtype"] not in (torch.float32, torch.float64):
        raise ValueError(
            f"preconditioner_dtype must be torch.float32 or torch.float64, got {group['preconditioner_dtype']}"
        )
    skip = group["skip_preconditioning_dim_size_gt"]
    if skip is not None:
        check_int("skip_preconditioning_dim_size_gt", skip, 1)
    check_positive("inverse_failure_threshold", group["inverse_failure_threshold"])
    check_8bit_options(group["optim_bits"], group["min_8bit_size"], "8-bit block-wise moments and grafting state")
    if not isinstance(group["use_symmetric_packing"], bool):
        raise ValueError(f"use_symmetric_packing must be True or False, got {group['use_symmetric_packing']!r}")
    _check_preconditioner_bits(group)
    _check_kl(group)
    _check_heavyball_step(group)


def _check_heavyball_step(group: dict[str, Any]) -> None:
    """``shampoo_beta``, ``merge_small_dims`` and ``soap_step``; heavyball's step keeps its factors
    and moments as bias-corrected averages of whole matrices, with Adam's own moments."""
    beta = group["shampoo_beta"]
    if beta is not None:
        check_range("shampoo_beta", beta, 0.0, 1.0)
    if group["merge_small_dims"] not in MERGE_RULES:
        raise ValueError(f"merge_small_dims must be True, False or 'trailing', got {group['merge_small_dims']!r}")
    step = group["soap_step"]
    if step not in SOAP_STEPS:
        raise ValueError(f"soap_step must be one of {SOAP_STEPS}, got {step!r}")
    if step == "default":
        return
    needs = {
        "eigenvalue_correction": (True, "it is SOAP's step"),
        "grafting_config": (None, "its Adam runs in the bases alone"),
        "use_bias_correction": (True, "its averages are bias-corrected"),
        "statistics_compute_steps": (1, "its factors take every step's gradient"),
        "use_symmetric_packing": (False, "it updates whole factors"),
        "preconditioner_bits": (32, "it keeps whole bases"),
    }
    for name, (value, why) in needs.items():
        if group[name] != value:
            raise ValueError(f"soap_step='heavyball' needs {name}={value!r} ({why}), got {group[name]!r}")
    if group["betas"][1] == 1:
        raise ValueError("soap_step='heavyball' needs betas[1] < 1 (its bias-corrected average of 1 is 0/0), got 1")


def _check_kl(group: dict[str, Any]) -> None:
    """KL-Shampoo's statistics read the roots, KL-SOAP's the bases: only where they are kept whole."""
    if not group["kl_statistics"]:
        return
    if group["preconditioner_bits"] < 32:
        kept = "bases" if group["eigenvalue_correction"] else "roots"
        raise ValueError(
            f"kl_statistics=True reads whole {kept} at every statistics step, which preconditioner_bits="
            f"{group['preconditioner_bits']} keeps as quantised eigenvectors: use preconditioner_bits=32"
        )


def _check_preconditioner_bits(group: dict[str, Any]) -> None:
    bits = group["preconditioner_bits"]
    if isinstance(bits, bool) or bits not in lowbit.BITS:
        raise ValueError(f"preconditioner_bits must be 32, 8 or 4, got {bits!r}")
    method = group["root_inverse"]
    if bits < 32 and not group["eigenvalue_correction"] and method not in ("eigh", WARM):
        # The quantised form is the eigenvectors, which the iterative methods never compute.
        raise ValueError(
            f"preconditioner_bits={bits} keeps the roots' eigenvectors, which root_inverse={method!r} does not "
            "compute; use root_inverse='eigh' or 'warm', or preconditioner_bits=32"
        )


def _check_step_options(group: dict[str, Any]) -> None:
    check_lr(group["lr"])
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    check_range("betas[0]", betas[0], 0.0, 1.0)
    check_beta2("betas[1]", betas[1])
    check_positive("epsilon", group["epsilon"])
    check_range("momentum", group["momentum"], 0.0, 1.0)
    check_range("weight_decay", group["weight_decay"], 0.0)


def _check_integers(group: dict[str, Any]) -> None:
    check_int("max_preconditioner_dim", group["max_preconditioner_dim"], 1)
    check_int("precondition_frequency", group["precondition_frequency"], 1)
    check_int("statistics_compute_steps", group["statistics_compute_steps"], 1)
    check_int("higher_order_degree", group["higher_order_degree"], 3)
    check_int("refresh_iterations", group["refresh_iterations"], 0)
    check_range("refresh_tolerance", group["refresh_tolerance"], 0.0, 1.0, closed_high=True)
    start, pf = group["start_preconditioning_step"], group["precondition_frequency"]
    check_int("start_preconditioning_step", start, 0)
    if start not in (0, 1) and start < pf:
        raise ValueError(
            f"start_preconditioning_step ({start}) must be >= precondition_frequency ({pf}), or 0/1 to "
            "precondition from the first step"
        )


def _check_methods(group: dict[str, Any]) -> None:
    if group["root_inverse"] not in ROOT_INVERSES:
        raise ValueError(f"root_inverse must be one of {ROOT_INVERSES}, got {group['root_inverse']!r}")
    if group["eigenbasis"] not in EIGENBASES:
        raise ValueError(f"eigenbasis must be one of {EIGENBASES}, got {group['eigenbasis']!r}")
    graft = group["grafting_config"]
    if graft is not None and not isinstance(graft, GRAFTING_TYPES):
        raise ValueError(
            "grafting_config must be None or one of SGDGraftingConfig, AdaGradGraftingConfig, "
            f"RMSpropGraftingConfig, AdamGraftingConfig; got {graft!r}"
        )


def _check_roots(group: dict[str, Any]) -> None:
    override = group["exponent_override"]
    if isinstance(override, bool) or not isinstance(override, (int, float)) or not 0 <= override < math.inf:
        raise ValueError(f"exponent_override must be a finite number >= 0 (0: 2 * order), got {override!r}")
    check_positive("exponent_multiplier", group["exponent_multiplier"])
    if group["root_inverse"] not in ("eigh", WARM) and not group["eigenvalue_correction"]:
        if group["exponent_multiplier"] != 1.0 or float(override) != int(override):
            raise ValueError(
                f"root_inverse={group['root_inverse']!r} needs exponent_multiplier=1 and an integer "
                "exponent_override; use root_inverse='eigh'"
            )
