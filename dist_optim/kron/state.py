"""What Kron keeps per parameter in ``optimizer.state`` (what ``state_dict``, ZeRO's sharded state
and the checkpoints serialise), and the one place that spells its keys.

* ``step``: a CPU float tensor (torch's convention; kron_torch: the same), on every rank;
* ``momentum_buffer``: the parameter's shape and local form (its TP slice / ZeRO chunk;
  kron_torch: the merged shape), dtype ``mu_dtype`` or the parameter's; with ``optim_bits=8``
  (tensors of at least ``min_8bit_size`` elements) uint8 codes of that shape plus
  ``momentum_buffer_absmax``, the fp32 absmax of every block of the full tensor, replicated
  (:mod:`dist_optim.kron.momentum`);
* ``Q_0, Q_1, ...``: the factors of :class:`~dist_optim.kron.structure.FactorPlan`, full, in
  ``precond_dtype``, on the parameter's owner only (kron_torch: a list ``Q`` plus einsum strings).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .structure import FactorPlan

__all__ = [
    "MOMENTUM",
    "init_param_state",
    "factor_key",
    "is_factor_key",
    "has_factors",
    "factors",
    "store_factors",
    "without_factors",
    "keeps_saved_dtype",
]


#: The momentum's key (its 8-bit absmax: ``MOMENTUM + "_absmax"``).
MOMENTUM = "momentum_buffer"


def init_param_state(
    state: dict[str, Any], p: torch.Tensor, mu_dtype: torch.dtype | None, eight_bit: bool = False
) -> None:
    """A parameter's state at its first step with a gradient: step 0 and a zero momentum (an 8-bit
    one is made by :func:`dist_optim.bnb_states.start_8bit` at its first update)."""
    state["step"] = torch.zeros((), dtype=torch.float32)
    if not eight_bit:
        state[MOMENTUM] = torch.zeros_like(p, dtype=mu_dtype or p.dtype, memory_format=torch.preserve_format)


def factor_key(k: int) -> str:
    """The state key of factor ``k``."""
    return f"Q_{k}"


def is_factor_key(key: str) -> bool:
    return key.startswith("Q_")


def has_factors(state: dict[str, Any]) -> bool:
    """Whether the factors exist (made on the owner at its first step)."""
    return factor_key(0) in state


def factors(state: dict[str, Any], plan: FactorPlan) -> list[torch.Tensor]:
    """The factors of ``plan`` in dim order (the stored tensors, updated in place)."""
    return [state[factor_key(k)] for k in range(len(plan.factor_shapes()))]


def store_factors(state: dict[str, Any], tensors: Sequence[torch.Tensor]) -> None:
    for k, t in enumerate(tensors):
        state[factor_key(k)] = t


def without_factors(state: dict[str, Any]) -> dict[str, Any]:
    """A full-form state as a rank that does not own the parameter keeps it."""
    return {k: v for k, v in state.items() if not is_factor_key(k)}


def keeps_saved_dtype(key: str) -> bool:
    """The factors (``precond_dtype``), the momentum (``mu_dtype``, or 8-bit codes) and its 8-bit
    fp32 absmax keep their saved dtype on load; torch's loader would cast them to the parameter's."""
    return is_factor_key(key) or key.startswith(MOMENTUM)
