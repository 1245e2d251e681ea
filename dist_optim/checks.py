"""Checks of option values shared by every optimizer, and the learning rate as the math reads it.

Each check raises one ``ValueError`` or ``TypeError`` line that names the option and the value; the
optimizers call them from their one validation hook (``DistOptimizer.validate_group``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["check_range", "check_adam_options", "check_lr", "group_lr"]


def check_range(
    name: str,
    value: float,
    low: float,
    high: float | None = None,
    *,
    closed_high: bool = False,
    open_low: bool = False,
) -> None:
    """Raise a ValueError naming ``name`` unless ``value`` is a finite number with ``low <= value``
    (``low < value`` with ``open_low``) and ``value < high`` (``<= high`` with ``closed_high``).
    Infinity and NaN are refused whatever the bounds: an ``lr=inf`` step turns every parameter
    into NaN or Inf."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    ok = math.isfinite(value) and (value > low if open_low else value >= low)
    if high is not None:
        ok = ok and (value <= high if closed_high else value < high)
    if not ok:
        lower = f"({low}" if open_low else f"[{low}"
        bound = (
            f"in {lower}, {high}{']' if closed_high else ')'}"
            if high is not None
            else f"{'>' if open_low else '>='} {low}"
        )
        raise ValueError(f"{name} must be a finite number {bound}, got {value}")


def check_lr(value: Any, *, open_low: bool = False) -> None:
    """The learning rate: a number, or a one-element floating-point tensor as torch's optimizers
    take it (what its LR schedulers then update in place), checked like a number (>= 0, or > 0
    with ``open_low``)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise ValueError(
                f"lr must be a number or a one-element floating-point tensor, got a {value.dtype} tensor of "
                f"shape {tuple(value.shape)}"
            )
        value = float(value)
    check_range("lr", value, 0.0, open_low=open_low)


def group_lr(group: Mapping[str, Any]) -> float:
    """A param group's learning rate as a Python number, read anew at every step: a tensor ``lr``
    (:func:`check_lr`) gives the same step as the float it holds."""
    lr = group["lr"]
    return float(lr) if isinstance(lr, torch.Tensor) else lr


def check_adam_options(**options: Any) -> None:
    """Validate the Adam-family options present in ``options`` (lr, betas, eps, weight_decay),
    raising a ValueError that names the option."""
    if "lr" in options:
        check_lr(options["lr"])
    if "betas" in options:
        betas = options["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        check_range("betas[0]", betas[0], 0.0, 1.0)
        check_range("betas[1]", betas[1], 0.0, 1.0)
    if "eps" in options:
        check_range("eps", options["eps"], 0.0)
    if "weight_decay" in options:
        check_range("weight_decay", options["weight_decay"], 0.0)
