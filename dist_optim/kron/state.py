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
  With ``use_symmetric_packing`` an upper-triangular factor ``(n, n)`` is kept as its packed upper
  triangle, 1-D of ``n (n + 1) / 2`` elements (:func:`dist_optim.structured.pack_upper`); diagonal
  factors are vectors either way. The math never sees that form: :func:`whole_factors` unpacks
  the factors of one parameter into reused scratch memory (:class:`FactorScratch`), strict lower
  triangle exactly zero as every unpacked factor keeps it (the identity it starts from and
  ``Q - triu(D) Q`` keep it), and :func:`store_whole` packs back what a step changed: packing
  loses nothing, the packed run equals the unpacked one bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import structured
from .structure import FactorPlan

__all__ = [
    "check_loaded_forms",
    "MOMENTUM",
    "init_param_state",
    "factor_key",
    "is_factor_key",
    "has_factors",
    "factors",
    "store_factors",
    "without_factors",
    "keeps_saved_dtype",
    "packs_factors",
    "stored_shapes",
    "FactorScratch",
    "whole_factors",
    "store_whole",
    "check_factor_shapes",
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


def store_factors(state: dict[str, Any], tensors: Sequence[torch.Tensor], plan: FactorPlan, packed: bool) -> None:
    """Store new whole factors (``packed``: the triangular ones as packed upper triangles)."""
    for k, (t, d) in enumerate(zip(tensors, plan.diag or (True,))):
        state[factor_key(k)] = structured.pack_upper(t) if packed and not d else t


def packs_factors(group: dict[str, Any]) -> bool:
    """Whether a param group keeps its triangular factors packed (``use_symmetric_packing``)."""
    return bool(group["use_symmetric_packing"])


def stored_shapes(plan: FactorPlan, packed: bool) -> list[tuple[int, ...]]:
    """The shapes of the stored factors of ``plan``: :meth:`FactorPlan.factor_shapes`, with
    ``packed`` a triangular factor's ``(n (n + 1) / 2,)``."""
    shapes = plan.factor_shapes()
    if not packed:
        return shapes
    return [(structured.packed_size(s[0]),) if len(s) == 2 else s for s in shapes]


class FactorScratch:
    """Reused memory for one parameter's unpacked triangular factors at a time: one buffer per
    factor index, dtype and device, grown to the largest factor unpacked into it. It stays
    allocated between steps (fresh factor-sized memory costs page faults on the CPU that are
    comparable to the unpacking itself): at most ``max_size_triangular^2`` elements per dim of the
    owned parameters with triangular factors."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, k: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous ``(n, n)`` tensor over factor index ``k``'s buffer (from its start)."""
        key = (k, dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n * n:
            buf = self._buffers[key] = torch.empty(n * n, dtype=dtype, device=device)
        return buf[: n * n].view(n, n)


def whole_factors(
    state: dict[str, Any], plan: FactorPlan, packed: bool, scratch: FactorScratch | None
) -> list[torch.Tensor]:
    """The factors of ``plan`` as the math uses them: the stored tensors (updated in place), or
    with ``packed`` the triangular ones unpacked into ``scratch`` (fresh memory without one), to
    be packed back by :func:`store_whole` where they change."""
    stored = factors(state, plan)
    if not packed:
        return stored
    out = []
    for k, (q, d) in enumerate(zip(stored, plan.diag or (True,))):
        if d:
            out.append(q)
            continue
        n = plan.shape[k]
        buf = scratch.get(k, n, q.dtype, q.device) if scratch is not None else None
        out.append(structured.unpack_upper_triangular(q, n, out=buf))
    return out


def store_whole(state: dict[str, Any], plan: FactorPlan, whole: Sequence[torch.Tensor]) -> None:
    """Pack the unpacked triangular factors ``whole`` (of :func:`whole_factors`) back into the
    stored packed ones; the diagonal ones are the stored tensors themselves."""
    for k, (q, d) in enumerate(zip(whole, plan.diag or (True,))):
        if not d:
            structured.pack_upper(q, out=state[factor_key(k)])


def check_factor_shapes(state: dict[str, Any], plan: FactorPlan, packed: bool, full_shape: tuple[int, ...]) -> None:
    """For ``load_full_state``: the state's factors, where it has them, have this group's stored
    shapes (a state saved with other factor options is refused, before anything is replaced)."""
    if not has_factors(state):
        return
    for k, shape in enumerate(stored_shapes(plan, packed)):
        value = state.get(factor_key(k))
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else value
        if got != tuple(shape):
            raise ValueError(
                f"load_full_state: state {factor_key(k)!r} of a parameter of full shape {full_shape} should be "
                f"a tensor of shape {tuple(shape)}, got {got!r}; was it saved with use_symmetric_packing="
                f"{not packed} or other factor options (max_size_triangular, min_ndim_triangular, "
                "memory_save_mode, merge_dims)?"
            )


def without_factors(state: dict[str, Any]) -> dict[str, Any]:
    """A full-form state as a rank that does not own the parameter keeps it."""
    return {k: v for k, v in state.items() if not is_factor_key(k)}


def keeps_saved_dtype(key: str) -> bool:
    """The factors (``precond_dtype``), the momentum (``mu_dtype``, or 8-bit codes) and its 8-bit
    fp32 absmax keep their saved dtype on load; torch's loader would cast them to the parameter's."""
    return is_factor_key(key) or key.startswith(MOMENTUM)


def check_loaded_forms(saved: Any, groups: list[dict[str, Any]]) -> None:
    """Refuse, before anything is loaded, a state dict with whole (2-D) factors for a param group
    with ``use_symmetric_packing``: a state dict saved before the option existed has none in its
    groups and takes the loading optimizer's value (the base's loader), but its factors are whole.
    (Packed factors always come with the option saved, so the other direction cannot arise.)"""
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list):
        return  # the base's loader names what is wrong
    for built, group in zip(groups, saved["param_groups"]):
        if not {**built, **group}.get("use_symmetric_packing"):
            continue
        for pid in group.get("params", []):
            for key, value in saved.get("state", {}).get(pid, {}).items():
                if is_factor_key(key) and isinstance(value, torch.Tensor) and value.dim() == 2:
                    raise ValueError(
                        f"load_state_dict: factor {key!r} is a whole matrix where the param group has "
                        "use_symmetric_packing=True; build the optimizer with use_symmetric_packing=False to load it"
                    )
