"""The preconditioner-update schedule (kron_torch 0.3.3's, not the seed's coin flip).

The probability ``p`` of step ``n`` (a float, or a callable of ``n = 0, 1, ...``; default
:func:`precond_update_prob_schedule`) drives a counter: the preconditioner is updated when the
number of steps since the last update reaches ``1 / p`` (:func:`threshold`). Deterministic, so
every rank takes the same decision without communicating; the counters themselves are kept by
:class:`~dist_optim.kron.randomness.KronRandomness`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..base import check_range
from ..states.saved import register_option_class

__all__ = ["ProbabilitySchedule", "precond_update_prob_schedule", "threshold"]


@dataclass(frozen=True)
class ProbabilitySchedule:
    """Exponential anneal with a flat start: ``clamp(max_prob * exp(-decay * (n - flat_start)),
    min_prob, max_prob)`` at step ``n`` (computed in fp32, like kron_torch's ``ProbScheduler``)."""

    max_prob: float = 1.0
    min_prob: float = 0.03
    decay: float = 0.001
    flat_start: float = 500.0

    def __post_init__(self) -> None:
        check_range("max_prob", self.max_prob, 0.0, 1.0, closed_high=True)
        check_range("min_prob", self.min_prob, 0.0, 1.0, closed_high=True)
        if self.min_prob <= 0 or self.max_prob <= 0:
            raise ValueError(f"max_prob and min_prob must be in (0, 1], got {self.max_prob}, {self.min_prob}")
        check_range("decay", self.decay, 0.0)

    def __call__(self, n: int | float | torch.Tensor) -> torch.Tensor:
        f32 = torch.float32
        step = torch.as_tensor(n, dtype=f32)
        prob = torch.tensor(self.max_prob, dtype=f32) * torch.exp(
            -torch.tensor(self.decay, dtype=f32) * (step - torch.tensor(self.flat_start, dtype=f32))
        )
        return prob.clamp(min=torch.tensor(self.min_prob, dtype=f32), max=torch.tensor(self.max_prob, dtype=f32))


# Saved param groups (state_dict, checkpoints) hold the schedule as its fields.
register_option_class(ProbabilitySchedule)


def precond_update_prob_schedule(
    max_prob: float = 1.0, min_prob: float = 0.03, decay: float = 0.001, flat_start: float = 500
) -> ProbabilitySchedule:
    """The default preconditioner-update schedule of the seed and kron_torch: probability 1 for
    ``flat_start`` steps, then an exponential decay to ``min_prob`` (about 4000 steps with the
    defaults)."""
    return ProbabilitySchedule(float(max_prob), float(min_prob), float(decay), float(flat_start))


def threshold(prob: Any) -> float:
    """``1 / prob`` as kron_torch compares it with its int counter: in fp32 (a float tensor
    keeps its dtype; a Python float is divided in double, then compared in fp32)."""
    if isinstance(prob, torch.Tensor):
        value = prob.detach().to("cpu")
        if not value.is_floating_point():
            value = value.float()
        p = float(value)
        recip = float(1 / value)
    else:
        p = float(prob)
        recip = float(torch.tensor(1.0 / p, dtype=torch.float32)) if p > 0 else math.inf
    if not 0 < p <= 1:
        raise ValueError(f"preconditioner_update_probability must be in (0, 1], got {p}")
    return recip
