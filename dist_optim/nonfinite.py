"""The NaN/Inf gradient check every optimizer makes before a step changes anything (the
``nonfinite`` policy of :class:`dist_optim.base.DistOptimizer`, whose ``_gradients_ok`` strings
these together around the job-wide sum of the flag): the policy's values and check, this rank's
flag, the exact per-element search once the flag is set, and the error a ``"raise"`` step gives."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .comm import all_gather_objects

__all__ = ["NONFINITE_POLICIES", "check_nonfinite_policy", "local_flag", "bad_parameters", "refusal"]

#: What a step does with a NaN/Inf gradient.
NONFINITE_POLICIES = ("raise", "skip", "ignore")
_NARROW = (torch.float16, torch.bfloat16)


def check_nonfinite_policy(value: Any) -> str:
    """``value`` if it is one of :data:`NONFINITE_POLICIES`, else a ValueError naming the option."""
    if not isinstance(value, str) or value not in NONFINITE_POLICIES:
        allowed = ", ".join(repr(v) for v in NONFINITE_POLICIES)
        raise ValueError(f"nonfinite must be one of {allowed}, got {value!r}")
    return value


def local_flag(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """This rank's part of the flag (fp32, one element, on ``device``): how many of its gradient
    kinds (dtype, device) have a NaN or Inf 2-norm (one multi-tensor reduction per kind, at least
    fp32; NaN and Inf propagate through its sum of squares); a small integer, exact in any float
    dtype a collective carrying it uses. The 2-norm rather than the sum of magnitudes: torch's
    CPU kernel for it is the faster of the two on gradients out of cache (measured once, not
    benched). Its squares overflow on finite values above about 1.8e19
    (fp32): such a flag is seen for what it is by the exact check (:func:`bad_parameters`)."""
    flag = torch.zeros(1, dtype=torch.float32, device=device)
    kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for g in grads:
        kinds.setdefault((g.dtype, g.device), []).append(g.detach())
    for (dtype, _), gs in kinds.items():
        # fp16/bf16 norms in fp32 (an fp16 sum of squares overflows at 65504); fp32/fp64 in their own dtype
        # (torch refuses to narrow fp64).
        norms = torch._foreach_norm(gs, 2, dtype=torch.float32 if dtype in _NARROW else None)
        flag += (~torch.isfinite(torch.stack(norms))).any().to(device)
    return flag


def bad_parameters(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], label: Callable[[torch.Tensor], str], every: bool
) -> list[str]:
    """The labels of the parameters whose gradient holds a NaN or Inf (element by element), and,
    with ``every``, every rank's, each with its rank (one ``all_gather_object`` over the job);
    empty where the flag came from a sum that overflowed on finite values."""
    bad = [label(p) for p, g in zip(params, grads) if not bool(torch.isfinite(g).all())]
    if every:
        gathered = all_gather_objects(bad)
        bad = [f"{name} on rank {rank}" for rank, names in enumerate(gathered) for name in names]
    return bad


def refusal(optimizer: str, bad: Sequence[str]) -> FloatingPointError:
    """The error a ``"raise"`` step gives: the bad parameters (four named, then a count) and the fix."""
    shown = "; ".join(bad[:4]) + (f"; and {len(bad) - 4} more" if len(bad) > 4 else "")
    return FloatingPointError(
        f"{optimizer}: the gradient of {shown} contains NaN or Inf; the step was not taken and "
        "nothing changed. Lower the learning rate or clip gradients, or choose another policy: "
        "nonfinite='skip' skips such steps (counted in skipped_steps), nonfinite='ignore' does not check "
        "(pass it to the constructor or set optimizer.nonfinite)"
    )
