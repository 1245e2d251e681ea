"""GaLore's options and their checks.

:func:`validate_options` is what :meth:`DistributedGaLore.validate_group
<dist_optim.galore.optimizer.DistributedGaLore.validate_group>` runs on every group (from
``__init__``, ``add_param_group`` and ``load_state_dict``); :func:`check_full_shape` checks a GaLore
parameter's full shape once the layouts are known (bind or the first step).

:func:`check_optimizer_options` checks the optimizer-wide options (``optim_bits``,
``min_8bit_size``, ``adam_style``, ``projector_dtype``), once, from ``__init__``: they are not kept
in param groups (every group shares them, as in bitsandbytes, whose 8-bit state format they fix),
so no group, saved or added, carries them to check. A group that does name one (a conversion's
group) must agree with the optimizer: :func:`validate_options` checks that.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..base import check_adam_options, check_range
from ..states.codecs import check_8bit_options

__all__ = [
    "PROJ_TYPES",
    "ADAM_STYLES",
    "GROUP_DEFAULTS",
    "PROJECTOR_DTYPES",
    "OPTIMIZER_WIDE",
    "is_positive_int",
    "check_optimizer_options",
    "validate_options",
    "check_full_shape",
]

PROJ_TYPES = ("std", "reverse_std", "left", "right", "full")
ADAM_STYLES = ("hf", "bnb")
#: Defaults the paper (and ColossalAI) use for GaLore groups that do not set them.
GROUP_DEFAULTS: dict[str, Any] = {"update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}
PROJECTOR_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
#: Options of the whole optimizer (attributes, not group keys).
OPTIMIZER_WIDE = ("optim_bits", "min_8bit_size", "is_paged", "adam_style")


def is_positive_int(value: Any) -> bool:
    """An int (not a bool) >= 1."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_optimizer_options(
    optim_bits: Any, min_8bit_size: Any, adam_style: Any, projector_dtype: torch.dtype | None
) -> None:
    """The optimizer-wide options (see the module docstring for why they are not checked per group)."""
    # GaLore has always taken any number >= 0 here (truncated), bitsandbytes' MockArgs too.
    check_range("min_8bit_size", min_8bit_size, 0)
    check_8bit_options(optim_bits, int(min_8bit_size), "8-bit block-wise AdamW moments")
    if adam_style not in ADAM_STYLES:
        raise ValueError(f"adam_style must be one of {ADAM_STYLES}, got {adam_style!r}")
    if projector_dtype is not None and projector_dtype not in PROJECTOR_DTYPES:
        raise TypeError(
            f"projector_dtype must be None or one of {PROJECTOR_DTYPES}, got {projector_dtype!r} "
            "(None: float16 with optim_bits=8, else the gradient's dtype)"
        )


def validate_options(group: Mapping[str, Any], wide: Mapping[str, Any]) -> None:
    """One param group (defaults filled in): optimizer-wide options it names agree with the
    optimizer's (``wide``), AdamW's options, and a GaLore group's (a group with ``rank``): positive
    int ``rank`` and ``update_proj_gap``, a finite ``scale``, a known ``proj_type``, parameters that
    can be matrices. Full shapes (2-D, ``rank`` <= both dims) are :func:`check_full_shape`'s."""
    for key in OPTIMIZER_WIDE:
        # Optimizer-wide options may arrive in groups (from a conversion): they must agree.
        if key in group and group[key] != wide[key]:
            raise ValueError(
                f"DistributedGaLore: {key} is optimizer-wide; a param group sets {key}={group[key]!r} "
                f"but the optimizer has {wide[key]!r}"
            )
    check_adam_options(**{k: group[k] for k in ("lr", "betas", "eps", "weight_decay")})
    if "rank" in group:
        _check_galore_options(group)


def _check_galore_options(group: Mapping[str, Any]) -> None:
    rank = group["rank"]
    if not is_positive_int(rank):
        raise ValueError(f"DistributedGaLore: rank must be a positive int, got {rank!r}")
    if not is_positive_int(group["update_proj_gap"]):
        raise ValueError(f"DistributedGaLore: update_proj_gap must be a positive int, got {group['update_proj_gap']!r}")
    scale = group["scale"]
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise ValueError(f"DistributedGaLore: scale must be a finite number, got {scale!r}")
    if group["proj_type"] not in PROJ_TYPES:
        raise ValueError(f"DistributedGaLore: proj_type must be one of {PROJ_TYPES}, got {group['proj_type']!r}")
    for p in group["params"]:
        # TP slices keep their dims and ZeRO chunks are 1-D: a param with more than two
        # dims is never a matrix. Full shapes are checked again at bind / first step.
        if p.dim() > 2:
            raise ValueError(
                f"DistributedGaLore: a GaLore group (rank={rank}) holds a {p.dim()}-D parameter of shape "
                f"{tuple(p.shape)}; GaLore projects 2-D matrices only, put other parameters in a group "
                "without 'rank'"
            )


def check_full_shape(index: int, rank: int, shape: tuple[int, ...]) -> None:
    """A parameter of GaLore param group ``index`` (of ``rank``) has full shape ``shape``: a matrix
    with both dims >= ``rank``."""
    if len(shape) != 2:
        raise ValueError(
            f"DistributedGaLore: param group {index} (rank={rank}) holds a parameter of full "
            f"shape {shape}; GaLore projects 2-D matrices only, put it in a group without 'rank'"
        )
    if rank > min(shape):
        raise ValueError(
            f"DistributedGaLore: rank={rank} exceeds min{shape} = {min(shape)} for a "
            f"parameter in param group {index}; use rank <= {min(shape)}"
        )
