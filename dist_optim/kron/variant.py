"""``variant="heavyball"``: heavyball's PSGD Kron (PyPI ``heavyball`` 3.2.1, ``PSGDKron``), the same
whitening fit of Li's PSGD (arXiv:1512.04202, 1809.10232) with other choices than kron_torch's.

Per parameter (dims of size 1 dropped from its shape, :func:`~dist_optim.kron.structure.plan_factors`)
and optimizer step ``t`` (the optimizer's, counted whether the parameter had a gradient or not):

* momentum: the bias-corrected average ``m <- m (1 - a) + g a``, ``a = (1 - b1) / (1 - b1^t)``
  (:func:`momentum_weight`), preconditioned as is (not noised); kron_torch keeps ``b1 m + (1 - b1)
  g`` and divides by ``1 - b1^s`` in the parameter's own steps ``s``;
* update decision: a running float sum of the probability, an update where its integer part grows,
  the schedule called with the 1-based step (:class:`HeavyballSchedule` is heavyball's default);
  kron_torch: a counter reaching ``1 / p``;
* initial scale (``precond_init_scale=None``): ``(precond_init_scale_scale mean(|g|^4)^(-1/8)) **
  precond_init_scale_power`` of the first gradient (heavyball: power 0.5);
* fit (:func:`fit_factors`): the noised input ``G + (dampening + eps_f32 |G|) V`` (kron_torch:
  ``G + sqrt(eps_f32) mean|G| V``), the factors balanced to a common max-abs on every update
  (kron_torch: on 1% of them), each factor's step divided by a running lower bound ``ell <-
  max(ell_t, lb + (ell_t - lb)(1 - lower_bound_beta))`` of ``||T1 + T2||`` (triangular:
  ``power_iterations`` power steps from the row of largest norm, :func:`top_eigenvalue`; diagonal:
  ``max(T1 + T2)``; a scalar: ``T1 + T2``), kept per factor in the state (``Q_lower_bound``,
  float64, on the owner); kron_torch: a one-step bound, no state;
* direction: ``clip_update_rms`` clips with heavyball's ``trust_region_clip_`` (:func:`trust_region_clip_`)
  instead of the RMS at 1.1; weight decay ``p (1 - lr wd)`` on every tensor (kron_torch: >= 2 dims).

The distribution is the package's (the owner holds the whole momentum): exact under TP and ZeRO.
Tensors are never worked on in blocks (:mod:`.blocks`) with this variant: a large one is whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..base import check_range
from ..states.saved import register_option_class

__all__ = [
    "VARIANTS",
    "HeavyballSchedule",
    "heavy",
    "momentum_weight",
    "cumulative_decision",
    "top_eigenvalue",
    "fit_factors",
    "balance_all",
    "noised",
    "trust_region_clip_",
    "LOWER_BOUND",
]

#: The state key of the running lower bounds (float64, one per factor, on the owner): a factor key
#: (:mod:`dist_optim.kron.state`), kept and shared as the factors are.
LOWER_BOUND = "Q_lower_bound"

VARIANTS = ("kron_torch", "heavyball")


def heavy(group: dict[str, Any]) -> bool:
    """Whether a param group runs heavyball's variant."""
    return group.get("variant", "kron_torch") == "heavyball"


@dataclass(frozen=True)
class HeavyballSchedule:
    """heavyball's ``precond_update_prob_schedule``: ``max(min_prob, max_prob * decay ** max(n -
    flat_start, 0))`` at the 1-based step ``n``, in Python floats."""

    max_prob: float = 1.0
    min_prob: float = 0.03
    decay: float = 0.999
    flat_start: float = 1000.0

    def __post_init__(self) -> None:
        check_range("max_prob", self.max_prob, 0.0, 1.0, closed_high=True)
        check_range("min_prob", self.min_prob, 0.0, 1.0, closed_high=True)
        check_range("decay", self.decay, 0.0, 1.0, closed_high=True)

    def __call__(self, n: int) -> float:
        return max(self.min_prob, self.max_prob * self.decay ** max(n - self.flat_start, 0))


register_option_class(HeavyballSchedule)


def momentum_weight(b1: float, step: int) -> float:
    """The weight ``a`` of the gradient in the bias-corrected average at optimizer step ``step``."""
    return (1 - b1) / (1 - b1**step)


def cumulative_decision(total: float, prob: Any, step: int) -> tuple[bool, float]:
    """heavyball's ``psgd_should_update``: (update?, new running sum) at the 1-based ``step``."""
    p = float(prob(step)) if callable(prob) else float(prob)
    if not 0 < p <= 1:
        raise ValueError(f"preconditioner_update_probability must be in (0, 1], got {p}")
    new = total + p
    return int(new) > int(total), new


def top_eigenvalue(sym: torch.Tensor, iterations: int) -> torch.Tensor:
    """heavyball's ``max_eigenvalue_spd``: ``iterations`` power steps on the symmetric ``sym``
    scaled by its largest row norm, from that row."""
    norms = sym.norm(dim=-1)
    x_norm, idx = norms.max(dim=-1)
    x_norm = x_norm.clamp(min=torch.finfo(torch.float32).tiny)
    scaled = sym / x_norm
    x = sym[idx] / x_norm

    def mv(v: torch.Tensor) -> torch.Tensor:
        return (v @ scaled.T) @ scaled.T

    for _ in range(iterations):
        x = torch.nn.functional.normalize(mv(x), dim=-1)
    return (x * mv(x)).sum(dim=-1).sqrt() * x_norm


def _grams(t: torch.Tensor, k: int, diagonal: bool) -> torch.Tensor:
    rows = t.movedim(k, 0).reshape(t.shape[k], -1)
    return (rows * rows).sum(1) if diagonal else rows @ rows.T


def fit_factors(
    factors: list[torch.Tensor],
    bounds: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    group: dict[str, Any],
) -> None:
    """Every factor's step from ``A``, ``B`` (of the balanced factors before the step), in place,
    with the running lower bounds ``bounds`` (float64, one per factor, updated)."""
    lr, beta = group["precond_lr"], group["lower_bound_beta"]
    for k, q in enumerate(factors):
        if a.dim() == 0:
            t1, t2 = a * a, b * b
            ell = t1 + t2
        else:
            diagonal = q.dim() < 2
            t1, t2 = _grams(a, k, diagonal), _grams(b, k, diagonal)
            ell = (t1 + t2).max() if diagonal else top_eigenvalue(t1 + t2, group["power_iterations"])
        lb = bounds[k]
        ell64 = torch.maximum(ell.double(), lb + (ell.double() - lb) * (1 - beta))
        bounds[k] = ell64
        step = q * (t1 - t2) if q.dim() < 2 else (t1 - t2).triu() @ q
        q.copy_(q - step / ell64.to(q.dtype) * lr)


def balance_all(factors: list[torch.Tensor]) -> None:
    """heavyball's ``psgd_balance_Q``: each factor times ``exp(mean_j log max|Q_j| - log max|Q_k|)``."""
    if len(factors) < 2:
        return
    logs = [q.abs().max().log() for q in factors]
    mean = sum(logs) / len(factors)
    for q, n in zip(factors, logs):
        q.mul_((mean - n).exp())


def noised(g: torch.Tensor, v: torch.Tensor, dampening: float) -> torch.Tensor:
    """heavyball's ``dampen_grad``: ``G + (dampening + eps_f32 |G|) V``, a new tensor."""
    return g + (dampening + torch.finfo(torch.float32).eps * g.abs()) * v


def trust_region_clip_(x: torch.Tensor, lerp: float = 0.9, scale: float = 1.5) -> torch.Tensor:
    """heavyball's ``trust_region_clip_``: ``clamp(scale (lerp tanh(x / scale) + (1 - lerp)
    sgn(x) log1p|x / scale|), -2, 2)``, in place."""
    y = x / scale
    tanh = y.tanh()
    y = y.abs().log1p().copysign(tanh) * (1 - lerp) + tanh * lerp
    return x.copy_((y * scale).clamp(min=-2, max=2))
