"""The conversion of Meta's ``DistributedShampoo`` (its current option classes) on stand-ins with
Meta's class names and fields: every option it maps and every one it refuses, in one line. The
steps of converted optimizers against Meta's own code are ``bench/meta_shampoo_conversion.py``'s
(Meta's package is not on PyPI)."""

from __future__ import annotations

import dataclasses
import enum
import math
import sys
from typing import Any

import pytest
import torch

import dist_optim
from tests.helpers.modules import module_of


# ---- stand-ins: Meta's names and fields (facebookresearch/optimizers, distributed_shampoo) ------
@dataclasses.dataclass
class PerturbationConfig:
    perturb_before_computation: bool = True


@dataclasses.dataclass
class EigenConfig:
    rank_deficient_stability_config: Any = dataclasses.field(default_factory=PerturbationConfig)


@dataclasses.dataclass
class QREigendecompositionConfig:
    max_iterations: int = 1
    tolerance: float = 0.0


@dataclasses.dataclass
class EighEigendecompositionConfig:
    tolerance: float = 0.0


@dataclasses.dataclass
class RootInvShampooPreconditionerConfig:
    amortized_computation_config: Any = dataclasses.field(default_factory=EigenConfig)
    factor_matrix_dtype: torch.dtype = torch.float32
    inv_factor_matrix_dtype: torch.dtype = torch.float32
    use_symmetric_packing: bool = True
    use_trace_scaling: bool = False
    drop_weighting_factor_on_gsquare: bool = False
    inverse_exponent_override: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class RootInvKLShampooPreconditionerConfig(RootInvShampooPreconditionerConfig):
    pass


@dataclasses.dataclass
class EigenvalueCorrectedShampooPreconditionerConfig:
    amortized_computation_config: Any = dataclasses.field(default_factory=EighEigendecompositionConfig)
    factor_matrix_dtype: torch.dtype = torch.float32
    factor_matrix_eigenvectors_dtype: torch.dtype = torch.float32
    corrected_eigenvalues_dtype: torch.dtype = torch.float32
    use_symmetric_packing: bool = True
    ignored_basis_change_dims: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class AdamPreconditionerConfig:
    beta2: float = 0.999
    epsilon: float = 1e-10
    drop_weighting_factor_on_gsquare: bool = False


@dataclasses.dataclass
class SingleDeviceDistributedConfig:
    target_parameter_dimensionality: float = 1


@dataclasses.dataclass
class FullyShardDistributedConfig:
    target_parameter_dimensionality: float = 1


class WeightDecayType(enum.Enum):
    L2 = "L2"
    DECOUPLED = "DECOUPLED"
    CORRECTED = "CORRECTED"


class DistributedShampoo(torch.optim.Optimizer):
    """Meta's constructor's group keys and defaults; its state built at construction (step 0)."""

    def __init__(self, params: Any, **options: Any) -> None:
        defaults: dict[str, Any] = dict(
            lr=1e-2, betas=(0.9, 1.0), beta3=-1.0, epsilon=1e-12, weight_decay=0.0,
            weight_decay_type=WeightDecayType.DECOUPLED, max_preconditioner_dim=1024, precondition_frequency=1,
            start_preconditioning_step=-1, use_bias_correction=True, iterate_averaging_config=None,
            grafting_config=None, use_pin_memory=False, distributed_config=SingleDeviceDistributedConfig(),
            preconditioner_config=RootInvShampooPreconditionerConfig(),
        )  # fmt: skip
        defaults.update(options)
        defaults["peak_lr"] = defaults["lr"]
        if defaults["beta3"] == -1.0:
            defaults["beta3"] = defaults["betas"][0]
        if defaults["start_preconditioning_step"] == -1:
            defaults["start_preconditioning_step"] = defaults["precondition_frequency"]
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["step"] = torch.tensor(0)


@pytest.fixture
def meta(monkeypatch: pytest.MonkeyPatch) -> Any:
    mod = module_of("distributed_shampoo.distributed_shampoo", (DistributedShampoo,))
    monkeypatch.setitem(sys.modules, "distributed_shampoo.distributed_shampoo", mod)
    return mod


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(5))]


def test_options_map_to_ours(meta: Any) -> None:
    src = meta.DistributedShampoo(
        _params(),
        lr=0.03,
        betas=(0.95, 0.99),
        epsilon=1e-8,
        weight_decay=0.1,
        weight_decay_type=WeightDecayType.L2,
        max_preconditioner_dim=256,
        precondition_frequency=20,
        grafting_config=AdamPreconditionerConfig(beta2=0.98, epsilon=1e-8),
        preconditioner_config=RootInvKLShampooPreconditionerConfig(
            factor_matrix_dtype=torch.float64, inv_factor_matrix_dtype=torch.float64
        ),
    )
    ours = dist_optim.convert(src)
    g = ours.param_groups[0]
    assert isinstance(ours, dist_optim.DistributedShampoo) and not ours.state
    expected = dict(
        lr=0.03, betas=(0.95, 0.99), epsilon=1e-8, weight_decay=0.1, use_decoupled_weight_decay=False,
        max_preconditioner_dim=256, precondition_frequency=20, start_preconditioning_step=20,
        use_bias_correction=True, merge_small_dims=True, kl_statistics=True, eigenvalue_correction=False,
        root_inverse="eigh", preconditioner_dtype=torch.float64, use_symmetric_packing=True,
        grafting_config=dist_optim.AdamGraftingConfig(beta2=0.98, epsilon=1e-8),
    )  # fmt: skip
    assert {k: g[k] for k in expected} == expected
    soap = dist_optim.convert(
        meta.DistributedShampoo(
            _params(),
            preconditioner_config=EigenvalueCorrectedShampooPreconditionerConfig(
                amortized_computation_config=QREigendecompositionConfig()
            ),
            distributed_config=SingleDeviceDistributedConfig(target_parameter_dimensionality=math.inf),
        )
    )
    g = soap.param_groups[0]
    assert g["eigenvalue_correction"] and g["eigenbasis"] == "qr" and not g["merge_small_dims"]
    # Meta's eigh basis keeps eigh's increasing order (bench/meta_shampoo_conversion.py: within 5.1e-9)
    eigh = dist_optim.convert(
        meta.DistributedShampoo(_params(), preconditioner_config=EigenvalueCorrectedShampooPreconditionerConfig())
    )
    assert eigh.param_groups[0]["eigenbasis"] == "eigh-ascending"


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(beta3=0.5), r"option beta3=0\.5 has no equivalent: only beta3=-1 or betas\[0\]"),
        (dict(weight_decay=0.1, weight_decay_type=WeightDecayType.CORRECTED), "weight_decay_type"),
        (dict(iterate_averaging_config=object()), "iterate_averaging_config"),
        (dict(max_preconditioner_dim=math.inf), "max_preconditioner_dim=inf"),
        (dict(distributed_config=FullyShardDistributedConfig()), r"FullyShardDistributedConfig\(\.\.\.\)"),
        (dict(distributed_config=SingleDeviceDistributedConfig(2)), "target_parameter_dimensionality 1"),
        (dict(preconditioner_config=RootInvShampooPreconditionerConfig(use_trace_scaling=True)), "use_trace_scaling"),
        (
            dict(preconditioner_config=RootInvShampooPreconditionerConfig(inverse_exponent_override={2: 0.2})),
            "inverse_exponent_override",
        ),
        (
            dict(preconditioner_config=RootInvShampooPreconditionerConfig(inv_factor_matrix_dtype=torch.float64)),
            "inv_factor_matrix_dtype must equal factor_matrix_dtype",
        ),
        (
            dict(
                preconditioner_config=EigenvalueCorrectedShampooPreconditionerConfig(
                    amortized_computation_config=EighEigendecompositionConfig(tolerance=0.01)
                )
            ),
            r"DefaultSOAPConfig\) or EighEigendecompositionConfig\(tolerance=0\)",
        ),
        (
            dict(preconditioner_config=RootInvShampooPreconditionerConfig(EigenConfig(PerturbationConfig(False)))),
            "perturb_before_computation=True",
        ),
        (dict(grafting_config=AdamPreconditionerConfig(drop_weighting_factor_on_gsquare=True)), "grafting_config"),
    ],
)
def test_what_has_no_equivalent_is_refused_in_one_line(meta: Any, options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        dist_optim.convert(meta.DistributedShampoo(_params(), **options))
    assert "\n" not in str(info.value)


def test_a_stepped_optimizer_is_refused(meta: Any) -> None:
    src = meta.DistributedShampoo(_params())
    next(iter(src.state.values()))["step"] = torch.tensor(3)
    with pytest.raises(ValueError, match=r"has already stepped \(step 3\).*convert it before the first step"):
        dist_optim.convert(src)
