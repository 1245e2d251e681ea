"""Element-wise comparison used across the suite.

``|actual - expected| <= rtol * |expected| + atol`` for every element, with
``atol = ATOL_SCALE * rtol * max|expected|``. The relative term checks every entry on its own scale
(second moments, norm weights, padding rows); the absolute term only forgives entries that are
results of cancellation, whose rounding error is set by the size of what cancelled, i.e. by the
tensor's scale, not by their own. ``ATOL_SCALE = 0.1``: an entry 10x below its tensor's largest is
allowed ``rtol`` of itself plus ``rtol`` of itself again, one 100x below ~10x its own ``rtol``.
"""

from __future__ import annotations

from typing import Any

import torch

#: atol as a fraction of ``rtol * max|expected|`` (see the module docstring).
ATOL_SCALE = 0.1
#: The parity standard for fp32 results (tests/helpers/parity.py RTOL).
FP32_RTOL = 1e-5
#: Two float64 results of the same arithmetic in another order: ~1e-16 apart where nothing
#: cancels, so 1e-12 leaves four orders of magnitude for cancellation and still fails a learning
#: rate off by 1e-4 (see :func:`default_rtol`).
FLOAT64_RTOL = 1e-12


def excess(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol_scale: float = ATOL_SCALE) -> float:
    """max over elements of ``|actual - expected| / (rtol |expected| + atol)``: <= 1 is within
    tolerance. A shape mismatch or a NaN on one side only is infinitely far."""
    actual = actual.detach().double()
    expected = expected.detach().double()
    if actual.shape != expected.shape:
        return float("inf")
    if expected.numel() == 0:
        return 0.0
    both_nan = actual.isnan() & expected.isnan()
    if bool((actual.isnan() ^ expected.isnan()).any()):
        return float("inf")
    scale = expected.masked_fill(both_nan, 0).abs().max().item()
    allowed = rtol * expected.abs() + max(atol_scale * rtol * scale, 1e-30)
    diff = (actual - expected).abs().masked_fill(both_nan, 0)
    return (diff / allowed.masked_fill(both_nan, 1)).max().item()


def describe(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """Where the worst element is, for failure messages."""
    actual = actual.detach().double()
    expected = expected.detach().double()
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    diff = (actual - expected).abs()
    i = int(diff.argmax())
    return (
        f"worst element {i}: {actual.reshape(-1)[i].item():.9g} vs {expected.reshape(-1)[i].item():.9g} "
        f"(tensor scale {expected.abs().max().item():.3g})"
    )


def default_rtol(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """:data:`FP32_RTOL`, or :data:`FLOAT64_RTOL` when both sides are float64: two float64 runs of
    the same algorithm agree to ~1e-16, and an fp32 tolerance between them would pass a wrong
    algorithm (a learning rate scaled by 1.0001)."""
    both64 = actual.dtype == torch.float64 and expected.dtype == torch.float64
    return FLOAT64_RTOL if both64 else FP32_RTOL


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    rtol: float | None = None,
    msg: str = "",
    atol_scale: float = ATOL_SCALE,
) -> None:
    """Element-wise ``|a - b| <= rtol |b| + atol_scale * rtol * max|b|``; ``rtol`` defaults to
    :func:`default_rtol` (fp32's, or float64's when both sides are float64)."""
    rtol = default_rtol(actual, expected) if rtol is None else rtol
    e = excess(actual, expected, rtol, atol_scale)
    assert e <= 1, f"{msg}: {e:.3g}x the element-wise tolerance (rtol {rtol:g}); {describe(actual, expected)}"


def max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|: a tensor-scale measure, used for reporting and for
    end-to-end trajectory checks (not for parity, which is element-wise)."""
    actual = actual.detach().double()
    expected = expected.detach().double()
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if expected.numel() == 0:
        return 0.0
    scale = max(expected.abs().max().item(), 1e-12)
    return (actual - expected).abs().max().item() / scale


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two nested structures (dicts, lists, tuples, tensors, scalars) are not identical, bit
    for bit: tensors by ``torch.equal`` (and dtype), everything else by ``==``."""
    if isinstance(b, torch.Tensor):
        if not isinstance(a, torch.Tensor) or a.dtype != b.dtype or not torch.equal(a, b):
            return [path or "<tensor>"]
        return []
    if isinstance(b, dict):
        if not isinstance(a, dict) or set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, a)) if isinstance(a, dict) else a!r} != {sorted(map(str, b))}"]
        return [d for k in b for d in differences(a[k], b[k], f"{path}.{k}" if path else str(k))]
    if isinstance(b, (list, tuple)):
        if not isinstance(a, (list, tuple)) or len(a) != len(b):
            return [f"{path}: length differs"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def without_seconds(value: Any) -> Any:
    """A planner JSON (dict, list) without the ``seconds`` its parts took: what must repeat."""
    if isinstance(value, dict):
        return {k: without_seconds(v) for k, v in value.items() if k != "seconds"}
    return [without_seconds(v) for v in value] if isinstance(value, list) else value
