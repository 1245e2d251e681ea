"""bench/convergence.py's bookkeeping: the rates swept, the best rate per optimizer, the steps to a
target, the table (the training itself is the recipe's, tested in tests/distributed)."""

from __future__ import annotations

import math

import pytest

from bench import convergence


def test_rates_are_log_spaced_over_the_range() -> None:
    low, high = convergence.RANGES["AdamW"]
    got = convergence.rates("AdamW", 4)
    assert got[0] == pytest.approx(low) and got[-1] == pytest.approx(high)
    ratios = [b / a for a, b in zip(got, got[1:])]
    assert ratios == pytest.approx([(high / low) ** (1 / 3)] * 3)
    assert convergence.rates("AdamW", 1) == pytest.approx([math.sqrt(low * high)])
    assert set(convergence.RANGES) == set(convergence.OPTIMIZERS)


def _run(label: str, lr: float, seed: int, losses: list[float]) -> dict:
    curve = [(25 * i, 1.0 * i, loss) for i, loss in enumerate(losses)]
    return {"label": label, "lr": lr, "seed": seed, "curve": curve}


def test_best_rate_is_the_lowest_mean_final_loss_and_a_diverged_rate_never_wins() -> None:
    results = [
        _run("AdamW", 1e-3, 0, [5.0, 4.0, 3.0]),
        _run("AdamW", 1e-3, 1, [5.0, 4.2, 3.2]),  # mean final 3.1
        _run("AdamW", 3e-3, 0, [5.0, 3.5, 2.9]),
        _run("AdamW", 3e-3, 1, [5.0, 3.7, 3.1]),  # mean final 3.0: the best
        _run("Kron", 1e-3, 0, [5.0, float("nan")]),  # diverged in one seed: excluded
        _run("Kron", 1e-3, 1, [5.0, 1.0, 0.5]),
        _run("Kron", 1e-4, 0, [5.0, 3.0, 2.95]),
        _run("Kron", 1e-4, 1, [5.0, 3.2, 3.05]),
        _run("LAMB", 1e-2, 0, [5.0, float("nan")]),
    ]
    summary = convergence.summarise(results)
    assert summary["AdamW"]["lr"] == 3e-3 and summary["AdamW"]["final"] == pytest.approx(3.0)
    assert summary["AdamW"]["spread"] == pytest.approx(0.2)
    assert [p[2] for p in summary["AdamW"]["curve"]] == pytest.approx([5.0, 3.6, 3.0])
    assert summary["Kron"]["lr"] == 1e-4
    assert summary["LAMB"]["lr"] is None
    # AdamW reaches its own 3.0 at its last evaluation (step 50); Kron's mean curve at step 50 too.
    assert convergence.steps_to(summary["AdamW"]["curve"], 3.0) == 50
    assert convergence.steps_to(summary["Kron"]["curve"], 3.1) == 25
    assert convergence.steps_to(summary["Kron"]["curve"], 1.0) is None
    text = convergence.table(summary)
    assert "| AdamW | 0.003 | 3.0000 (0.2000) | 50 | 1.00x |" in text
    assert "| Kron | 0.0001 | 3.0000 (0.1000) | 50 | 1.00x |" in text
    assert "| LAMB | - | diverged at every rate | - | - |" in text
