"""Muon's coefficient schedules: what ``ns_coefficients`` may name, and Polar Express's schedule
computed from its definition.

Each iteration of Muon's orthogonalization applies an odd quintic ``p(x) = a x + b x^3 + c x^5`` to
the singular values of ``X`` (normalized to at most 1). A schedule is one ``(a, b, c)`` per
iteration. The named schedules (:data:`PRESETS`):

* ``"jordan"``: Jordan et al. 2024's ``(3.4445, -4.775, 2.0315)`` at every iteration (torch's and
  KellerJordan's default): fast, but it leaves singular values anywhere in about [0.7, 1.2];
* ``"newton_schulz"``: the classical quintic Newton-Schulz ``(15/8, -10/8, 3/8)``, which converges
  to exactly 1 but slowly from small singular values;
* ``"polar_express"``: Amsel, Persson, Musco and Gower 2025 ("The Polar Express: Optimal Matrix Sign
  Methods and Their Application to the Muon Algorithm"): at each iteration the odd quintic with the
  least maximum distance to 1 over the interval the singular values are known to lie in (found by
  Remez exchange, :func:`optimal_odd_quintic`), starting from ``[1e-3, 1]``; as in the paper's Muon,
  the search interval's lower end is at least ``CUSHION`` times the upper (the polynomial is then
  re-centred on the true interval), and every iteration but the last is evaluated at ``x / 1.01``
  so that bf16 rounding cannot push a singular value past the interval. Computed here, in float64,
  for any ``ns_steps``; with 5 steps and before the ``1.01`` scaling its first triple is the paper's
  ``(8.28721201814563, -23.595886519098837, 17.300387312530933)`` (tests/unit/test_muon_coefficients.py).

How close each comes to the polar factor, in fp32 and bf16: ``python bench/ns_presets.py``
(docs/optimizers.md has its table).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from ..kernels.newton_schulz import Coefficients

__all__ = [
    "DEFAULT_NS_COEFFICIENTS",
    "PRESETS",
    "CUSHION",
    "SAFETY",
    "optimal_odd_quintic",
    "polar_express",
    "schedule",
    "check_coefficients",
]

#: The Polar Express search interval's lower end is at least this fraction of its upper end (the
#: paper's value): far smaller intervals give polynomials whose large coefficients amplify rounding.
CUSHION = 0.02407327424182761
#: Every Polar Express iteration but the last evaluates its polynomial at ``x / SAFETY``.
SAFETY = 1.01
#: Newton-Schulz coefficients of Jordan et al. (torch.optim.Muon's defaults; the ``"jordan"`` schedule).
DEFAULT_NS_COEFFICIENTS: Coefficients = (3.4445, -4.775, 2.0315)
_NEWTON_SCHULZ: Coefficients = (15 / 8, -10 / 8, 3 / 8)


def optimal_odd_quintic(lower: float, upper: float, iterations: int = 100) -> Coefficients:
    """The odd quintic ``a x + b x^3 + c x^5`` with the least maximum of ``|1 - p(x)|`` over
    ``[lower, upper]``: it equioscillates at ``lower``, its two interior extrema and ``upper``
    (Chebyshev), which Remez exchange finds by solving for the four equal errors, then moving the
    interior points to the new extrema until they stay put. A degenerate interval gives the
    Newton-Schulz quintic scaled to it."""
    if not 0 < lower <= upper:
        raise ValueError(f"optimal_odd_quintic: need 0 < lower <= upper, got {lower}, {upper}")
    if upper - lower <= 1e-12 * upper:
        a, b, c = _NEWTON_SCHULZ
        return a / upper, b / upper**3, c / upper**5
    q, r = (3 * lower + upper) / 4, (lower + 3 * upper) / 4
    a = b = c = 0.0
    for _ in range(iterations):
        points = (lower, q, r, upper)
        rows = torch.tensor([[x, x**3, x**5, s] for x, s in zip(points, (1, -1, 1, -1))], dtype=torch.float64)
        a, b, c, _ = torch.linalg.solve(rows, torch.ones(4, dtype=torch.float64)).tolist()
        root = math.sqrt(9 * b * b - 20 * a * c)
        nq, nr = sorted(math.sqrt((-3 * b + sign * root) / (10 * c)) for sign in (-1, 1))
        if abs(nq - q) <= 1e-15 * upper and abs(nr - r) <= 1e-15 * upper:
            break
        q, r = nq, nr
    return a, b, c


@functools.cache
def polar_express(steps: int = 5, lower: float = 1e-3, safety: float = SAFETY) -> tuple[Coefficients, ...]:
    """Polar Express's schedule of ``steps`` iterations for singular values in ``[lower, 1]``
    (module docstring); ``safety=1`` gives the polynomials before their ``x / 1.01`` scaling."""
    lo, hi = lower, 1.0
    out: list[Coefficients] = []
    for _ in range(steps):
        a, b, c = optimal_odd_quintic(max(lo, CUSHION * hi), hi)
        scale = 2 / (a * lo + b * lo**3 + c * lo**5 + a * hi + b * hi**3 + c * hi**5)
        a, b, c = a * scale, b * scale, c * scale
        out.append((a, b, c))
        lo = a * lo + b * lo**3 + c * lo**5
        hi = 2 - lo
    return tuple((a / safety, b / safety**3, c / safety**5) for a, b, c in out[:-1]) + (out[-1],)


#: The schedules ``ns_coefficients`` may name, as functions of ``ns_steps``.
PRESETS: dict[str, Callable[[int], tuple[Coefficients, ...]]] = {
    "jordan": lambda steps: (DEFAULT_NS_COEFFICIENTS,) * steps,
    "newton_schulz": lambda steps: (_NEWTON_SCHULZ,) * steps,
    "polar_express": polar_express,
}


def _is_triple(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and len(value) == 3 and all(isinstance(v, (int, float)) for v in value)


def schedule(coefficients: Any, steps: int) -> list[Coefficients]:
    """The per-iteration triples of ``ns_coefficients`` (checked by :func:`check_coefficients`): a
    preset's for ``steps`` iterations, one triple ``steps`` times, or the given list."""
    if isinstance(coefficients, str):
        return list(PRESETS[coefficients](steps))
    if _is_triple(coefficients):
        return [(float(coefficients[0]), float(coefficients[1]), float(coefficients[2]))] * steps
    return [(float(a), float(b), float(c)) for a, b, c in coefficients]


def check_coefficients(coefficients: Any) -> None:
    """One ``ValueError`` line naming what is wrong with an ``ns_coefficients`` value."""
    if isinstance(coefficients, str):
        if coefficients not in PRESETS:
            raise ValueError(f"ns_coefficients={coefficients!r} is not a schedule; name one of {sorted(PRESETS)}")
        return
    triples = [coefficients] if _is_triple(coefficients) else coefficients
    if not isinstance(triples, (tuple, list)) or not triples or not all(_is_triple(t) for t in triples):
        raise ValueError(
            f"ns_coefficients must be a schedule's name ({', '.join(sorted(PRESETS))}), a triple (a, b, c) of "
            f"numbers or a list of 1 to 100 such triples (one per iteration), got {coefficients!r}"
        )
    if len(triples) > 100:
        raise ValueError(f"ns_coefficients: {len(triples)} triples; at most 100 iterations")
    for i, triple in enumerate(triples):
        for name, v in zip("abc", triple):
            if not math.isfinite(v):
                raise ValueError(f"ns_coefficients[{i}].{name} must be finite, got {v}")
