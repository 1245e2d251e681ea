"""Tolerance used across the suite: errors relative to a tensor's scale."""

from __future__ import annotations

import torch


def max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (elements near zero are judged at the tensor's scale)."""
    actual = actual.detach().double()
    expected = expected.detach().double()
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if expected.numel() == 0:
        return 0.0
    scale = max(expected.abs().max().item(), 1e-12)
    return (actual - expected).abs().max().item() / scale


def assert_rel(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5, msg: str = "") -> None:
    err = max_rel_err(actual, expected)
    assert err <= rtol, f"{msg}: max relative error {err:.3g} > {rtol:g}"
