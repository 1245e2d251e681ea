"""The conversion from Meta's ``distributed_shampoo.DistributedShampoo`` (facebookresearch/optimizers,
built with its current option classes: ``PreconditionerConfig`` subclasses for the preconditioner
and for grafting, ``WeightDecayType``, ``DistributedConfig``) to :class:`DistributedShampoo`;
imported by the package so that it registers on ``import dist_optim``.

Meta's package is not on PyPI: a user who has its checkout on the path and passes its optimizer to
``booster.boost`` gets ours, with the same hyperparameters, or a ``ValueError`` naming the option
that has no equivalent. Meta's objects are read by their class names and fields, so nothing here
imports Meta's code. ``bench/meta_shampoo_conversion.py`` steps converted optimizers beside Meta's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..registry import ANY, Conversion, register, register_refusals
from .optimizer import DistributedShampoo
from .options import AdaGradGraftingConfig, AdamGraftingConfig, RMSpropGraftingConfig, SGDGraftingConfig

__all__: list[str] = []

#: Where Meta's class lives (``class_path`` of it).
META_SHAMPOO = "distributed_shampoo.distributed_shampoo.DistributedShampoo"

#: Meta's preconditioner configs by class name -> (our eigenvalue_correction, our kl_statistics).
_PRECONDITIONERS = {
    "RootInvShampooPreconditionerConfig": (False, False),
    "EigendecomposedShampooPreconditionerConfig": (False, False),
    "RootInvKLShampooPreconditionerConfig": (False, True),
    "EigendecomposedKLShampooPreconditionerConfig": (False, True),
    "EigenvalueCorrectedShampooPreconditionerConfig": (True, False),
}
#: Meta's distributed configs whose only effect on the math is the merging of dims (ours
#: distribute through the plugins' layouts instead).
_DISTRIBUTED = ("SingleDeviceDistributedConfig", "DDPDistributedConfig")


def _name(obj: Any) -> str:
    return type(obj).__name__


def _refuse(option: str, value: Any, fix: str) -> ValueError:
    shown = f"{_name(value)}(...)" if hasattr(value, "__dataclass_fields__") else repr(value)
    return ValueError(f"convert: DistributedShampoo (Meta's) option {option}={shown} has no equivalent: {fix}")


def _grafting(config: Any) -> Any:
    """Meta's grafting ``PreconditionerConfig`` as ours."""
    if config is None:
        return None
    if getattr(config, "drop_weighting_factor_on_gsquare", False):
        raise _refuse("grafting_config", config, "only drop_weighting_factor_on_gsquare=False converts")
    kind = _name(config)
    if kind == "SGDPreconditionerConfig":
        return SGDGraftingConfig()
    if kind == "AdaGradPreconditionerConfig":
        return AdaGradGraftingConfig(epsilon=config.epsilon)
    if kind == "RMSpropPreconditionerConfig":
        return RMSpropGraftingConfig(beta2=config.beta2, epsilon=config.epsilon)
    if kind == "AdamPreconditionerConfig":
        return AdamGraftingConfig(beta2=config.beta2, epsilon=config.epsilon)
    raise _refuse("grafting_config", config, "use SGD, AdaGrad, RMSprop or Adam grafting, or None")


def _root_method(config: Any) -> str:
    """Our ``root_inverse`` for Meta's amortized computation of a root-inverse preconditioner."""
    computation = config.amortized_computation_config
    stability = getattr(computation, "rank_deficient_stability_config", None)
    if stability is not None and not getattr(stability, "perturb_before_computation", False):
        raise _refuse(
            "preconditioner_config", config, "only PerturbationConfig(perturb_before_computation=True) converts"
        )
    kind = _name(computation)
    if kind in ("EigenConfig", "EighEigendecompositionConfig"):
        return "eigh"
    if kind == "CoupledNewtonConfig":
        return "coupled_newton"
    raise _refuse("preconditioner_config", config, "its roots by EigenConfig or CoupledNewtonConfig convert")


def _eigenbasis(config: Any) -> str:
    """Our SOAP ``eigenbasis`` for Meta's eigendecomposition of an eigenvalue-corrected config: its
    ``DefaultSOAPConfig`` (one QR step from the previous basis at each refresh) is ``"qr"``; its
    ``EighEigendecompositionConfig`` (recomputed at every refresh, columns in ``eigh``'s increasing
    order) is ``"eigh-ascending"`` (``bench/meta_shampoo_conversion.py --soap-eigh``)."""
    computation = config.amortized_computation_config
    kind = _name(computation)
    if kind == "QREigendecompositionConfig" and computation.max_iterations == 1 and computation.tolerance == 0:
        return "qr"
    if kind == "EighEigendecompositionConfig" and computation.tolerance == 0:
        return "eigh-ascending"
    raise _refuse(
        "preconditioner_config",
        config,
        "an eigenvalue-corrected config converts with QREigendecompositionConfig(max_iterations=1, tolerance=0) "
        "(Meta's DefaultSOAPConfig) or EighEigendecompositionConfig(tolerance=0); build "
        "DistributedShampoo(eigenvalue_correction=True) for the others",
    )


def _preconditioner(config: Any) -> dict[str, Any]:
    kind = _name(config)
    if kind not in _PRECONDITIONERS:
        raise _refuse("preconditioner_config", config, f"one of {', '.join(_PRECONDITIONERS)} converts")
    for flag in ("use_trace_scaling", "drop_weighting_factor_on_gsquare"):
        if getattr(config, flag, False):
            raise _refuse("preconditioner_config", config, f"only {flag}=False converts")
    if getattr(config, "inverse_exponent_override", {}):
        raise _refuse("preconditioner_config", config, "only inverse_exponent_override={} (1 / (2 order)) converts")
    if getattr(config, "ignored_basis_change_dims", {}):
        raise _refuse("preconditioner_config", config, "only ignored_basis_change_dims={} converts")
    dtype = config.factor_matrix_dtype
    for other in ("inv_factor_matrix_dtype", "factor_matrix_eigenvectors_dtype", "corrected_eigenvalues_dtype"):
        if getattr(config, other, dtype) != dtype:
            raise _refuse("preconditioner_config", config, f"{other} must equal factor_matrix_dtype ({dtype})")
    if dtype not in (torch.float32, torch.float64):
        raise _refuse("preconditioner_config", config, "factor_matrix_dtype float32 or float64")
    soap, kl = _PRECONDITIONERS[kind]
    out: dict[str, Any] = dict(
        eigenvalue_correction=soap,
        kl_statistics=kl,
        preconditioner_dtype=dtype,
        use_symmetric_packing=bool(getattr(config, "use_symmetric_packing", False)),
    )
    if soap:
        out["eigenbasis"] = _eigenbasis(config)
    else:
        out["root_inverse"] = _root_method(config)
    return out


def _options(opt: torch.optim.Optimizer, g: Mapping[str, Any]) -> dict[str, Any]:
    betas = tuple(g["betas"])
    if g.get("beta3", betas[0]) not in (-1.0, betas[0]):
        raise _refuse("beta3", g["beta3"], f"only beta3=-1 or betas[0] ({betas[0]}): our first moment is one EMA")
    decay, kind = g["weight_decay"], getattr(g["weight_decay_type"], "name", str(g["weight_decay_type"]))
    if decay and kind not in ("DECOUPLED", "L2"):
        raise _refuse("weight_decay_type", g["weight_decay_type"], "WeightDecayType.DECOUPLED or L2")
    if g.get("iterate_averaging_config") is not None:
        raise _refuse("iterate_averaging_config", g["iterate_averaging_config"], "only None converts")
    max_dim = g["max_preconditioner_dim"]
    if isinstance(max_dim, float) and not math.isfinite(max_dim):
        raise _refuse("max_preconditioner_dim", max_dim, "give the largest block side as an integer")
    distributed = g["distributed_config"]
    if _name(distributed) not in _DISTRIBUTED:
        raise _refuse(
            "distributed_config", distributed, "SingleDevice or DDP configs convert (the plugins distribute ours)"
        )
    target = getattr(distributed, "target_parameter_dimensionality", 1)
    if target not in (1, math.inf):
        raise _refuse(
            "distributed_config", distributed, "target_parameter_dimensionality 1 (merge dims) or inf (keep them)"
        )
    start = g["start_preconditioning_step"]
    return dict(
        lr=g["lr"],
        betas=betas,
        epsilon=g["epsilon"],
        weight_decay=decay,
        use_decoupled_weight_decay=kind != "L2",
        max_preconditioner_dim=int(max_dim),
        precondition_frequency=g["precondition_frequency"],
        start_preconditioning_step=None if start == -1 else start,
        use_bias_correction=g["use_bias_correction"],
        grafting_config=_grafting(g["grafting_config"]),
        merge_small_dims=target == 1,
        **_preconditioner(g["preconditioner_config"]),
    )


def _state(state: Mapping[str, Any]) -> dict[str, Any]:
    """Nothing, before Meta's first step (it builds its blocks' state at construction); after it, a
    refusal: its factors are kept per Meta block, in Meta's layout."""
    step = state.get("step")
    if step is None or float(step) == 0:
        return {}
    raise ValueError(
        "convert: Meta's DistributedShampoo has already stepped (step "
        f"{float(step):g}) and its blocks' state has no equivalent here; convert it before the first step"
    )


_READS = frozenset(
    {
        "lr",
        "betas",
        "beta3",
        "epsilon",
        "weight_decay",
        "peak_lr",
        "weight_decay_type",
        "max_preconditioner_dim",
        "precondition_frequency",
        "start_preconditioning_step",
        "use_bias_correction",
        "iterate_averaging_config",
        "grafting_config",
        "distributed_config",
        "preconditioner_config",
    }
)
register(Conversion(META_SHAMPOO, DistributedShampoo, _options, _READS, neutral={"use_pin_memory": ANY}, state=_state))

# heavyball's (PyPI) SOAP and KLSOAP convert (.heavyball); the rest of its SOAP family runs another
# optimizer in the basis (NAdam, AdEMAMix, LaProp), transports the second moment across a refresh
# ("Heavy" variants) or preconditions by the factors' eigenvalues alone (KL-Shampoo).
register_refusals(
    {
        f"heavyball.{name}": "preconditions with a SOAP variant of heavyball's own (another optimizer in the basis, "
        "a transported second moment, or KL-Shampoo)"
        for name in (
            "KLShampoo",
            "SOAPNAdam",
            "SOAPAdEMAMix",
            "SOLP",
            "HeavySOAP",
            "HeavyKLSOAP",
            "HeavyKLShampoo",
            "HeavySOAPNAdam",
            "HeavySOAPAdEMAMix",
        )
    },
    DistributedShampoo,
    "dist_optim does not reproduce them: convert heavyball.SOAP or heavyball.KLSOAP, or build "
    "dist_optim.DistributedShampoo(eigenvalue_correction=True, soap_step='heavyball') instead, or keep heavyball "
    "on whole parameters (ColossalAI's stock TorchDDPPlugin)",
)

from . import heavyball  # noqa: E402, F401  (registers the conversions from heavyball's SOAP and KLSOAP)
