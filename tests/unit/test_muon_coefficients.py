"""Muon's named coefficient schedules (dist_optim.muon.coefficients): Polar Express computed from its
definition against the paper's published polynomial, optimality of each polynomial (Chebyshev
equioscillation, and no perturbation doing better), the composed schedules on singular values in
float64, and the names through DistributedMuon (the same steps as the triples they name)."""

from __future__ import annotations

import pytest
import torch

import dist_optim
from dist_optim.muon.coefficients import CUSHION, PRESETS, optimal_odd_quintic, polar_express


def _p(coeffs: tuple[float, float, float], x: torch.Tensor) -> torch.Tensor:
    a, b, c = coeffs
    return a * x + b * x**3 + c * x**5


def test_polar_express_is_the_papers_schedule() -> None:
    """Amsel et al. 2025 publish their first polynomial for [1e-3, 1] before its x / 1.01 scaling."""
    published = (8.28721201814563, -23.595886519098837, 17.300387312530933)
    first = polar_express(5, 1e-3, safety=1.0)[0]
    for got, want in zip(first, published):
        assert abs(got - want) <= 1e-12 * abs(want), (first, published)
    scaled = polar_express()[0]
    assert all(abs(s * 1.01 ** (2 * i + 1) - f) <= 1e-12 * abs(f) for i, (s, f) in enumerate(zip(scaled, first)))
    assert polar_express()[-1] == polar_express(safety=1.0)[-1], "the last iteration is not scaled"


@pytest.mark.parametrize("lower,upper", [(1e-3, 1.0), (CUSHION, 1.0), (0.3, 1.7), (0.9, 1.1)])
def test_each_polynomial_is_the_best_odd_quintic_on_its_interval(lower: float, upper: float) -> None:
    x = torch.linspace(lower, upper, 40001, dtype=torch.float64)
    coeffs = optimal_odd_quintic(lower, upper)
    err = 1 - _p(coeffs, x)
    worst = err.abs().max()
    # Chebyshev: the error reaches its maximum at both ends and two interior points, alternating.
    assert err[0] > 0 and err[-1] < 0 and abs(err[0] - worst) <= 1e-9 * worst and abs(-err[-1] - worst) <= 1e-9 * worst
    turns = (
        (err[1:-1].abs() >= worst * (1 - 1e-6))
        & (err[1:-1].abs() >= err[:-2].abs())
        & (err[1:-1].abs() >= err[2:].abs())
    )
    signs = torch.sign(err[1:-1][turns]).unique_consecutive()
    assert signs.tolist() == [-1.0, 1.0], signs
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):  # no nearby polynomial does better
        other = tuple(v * (1 + 1e-3 * float(torch.randn((), generator=gen))) for v in coeffs)
        assert (1 - _p(other, x)).abs().max() >= worst * (1 - 1e-12)


def test_polar_express_brings_singular_values_closest_to_one() -> None:
    """On singular values in [1e-3, 1] (float64 scalars: the polynomials act on each one), five
    iterations of Polar Express end nearer 1 than Jordan's or Newton-Schulz's five."""
    sigma = torch.logspace(-3, 0, 100001, dtype=torch.float64)
    worst = {}
    for name, make in PRESETS.items():
        x = sigma.clone()
        for coeffs in make(5):
            x = _p(coeffs, x)
        worst[name] = float((x - 1).abs().max())
    assert worst["polar_express"] < worst["jordan"] and worst["polar_express"] < worst["newton_schulz"], worst


def _muon_run(ns_coefficients: object, ns_steps: int = 5) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    params = [
        torch.nn.Parameter(torch.randn(12, 8, generator=gen)),
        torch.nn.Parameter(torch.randn(8, 20, generator=gen)),
    ]
    opt = dist_optim.DistributedMuon(params, lr=2e-2, ns_coefficients=ns_coefficients, ns_steps=ns_steps)
    for step in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * (step + 1)
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("steps", [3, 5])
def test_a_named_schedule_steps_as_its_triples(name: str, steps: int) -> None:
    named, listed = _muon_run(name, steps), _muon_run(list(PRESETS[name](steps)))
    assert all(torch.equal(a, b) for a, b in zip(named, listed))


def test_the_default_is_jordans_schedule_and_a_bad_name_is_refused() -> None:
    assert all(
        torch.equal(a, b) for a, b in zip(_muon_run("jordan"), _muon_run(dist_optim.muon.DEFAULT_NS_COEFFICIENTS))
    )
    with pytest.raises(ValueError, match=r"ns_coefficients='polar' is not a schedule; name one of \['jordan'"):
        dist_optim.DistributedMuon([torch.nn.Parameter(torch.zeros(3, 3))], ns_coefficients="polar")
