"""The comparison that ``bench/kl_shampoo_vs_meta.py`` and ``bench/kl_soap_vs_emerging.py`` share:
ours against a peer's implementation with KL statistics on and, as the control, off, on the same
parameters and gradients; then ours with KL against ours without, which must differ (else the
comparison could not tell the two apart). One loop, so that both benches measure and record alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from bench.record import Column, col

Make = Callable[[list[torch.nn.Parameter], bool], torch.optim.Optimizer]
Run = Callable[..., list[torch.Tensor]]

#: The columns of both benches' tables (``--write``): one row per run, then ours with KL against
#: ours without (its ``largest_move`` empty).
COLUMNS: list[Column] = [
    col("run", "run"),
    col("difference", "largest difference on a parameter's scale", 2, format="e"),
    col("largest_move", "largest move of a parameter", 3),
    col("noise_floor", "ours against ours, gradients times 1 + 1e-15 N(0, 1)", 2, format="e"),
]


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|``: on the tensor's scale (an element near zero after a cancellation
    carries the rounding of what cancelled)."""
    return float((a - b).abs().max() / b.abs().max())


def kl_on_and_off(
    theirs: Make,
    ours: Make,
    make_params: Callable[[], list[torch.nn.Parameter]],
    run: Run,
    steps: int,
    names: tuple[str, str, str],
    peer: str,
    noise: bool = False,
    apart_on: slice = slice(None),
) -> list[dict[str, Any]]:
    """Rows of :data:`COLUMNS`: ``names[0]`` (KL on) and ``names[1]`` (the control, KL off), each
    ours against ``theirs`` after ``steps`` steps of ``run``; with ``noise``, ours against ours on
    gradients with relative noise of 1e-15 (the comparison's floor); last, ``names[2]``: ours with
    KL against ours without on the parameters ``apart_on`` selects. Prints each as it is measured."""
    start = [p.detach().clone() for p in make_params()]
    finals: dict[bool, Sequence[torch.Tensor]] = {}
    rows: list[dict[str, Any]] = []
    for kl, name in zip((True, False), names[:2]):
        their_params, our_params = make_params(), make_params()
        their_final = run(theirs(their_params, kl), their_params, steps)
        finals[kl] = run(ours(our_params, kl), our_params, steps)
        row: dict[str, Any] = {
            "run": name,
            "difference": max(relative_difference(x, y) for x, y in zip(finals[kl], their_final)),
            "largest_move": max(float((y - s).abs().max()) for y, s in zip(their_final, start)),
        }
        print(
            f"{name}: {steps} steps, largest difference from {peer} on a parameter's scale {row['difference']:.2e} "
            f"(parameters moved up to {row['largest_move']:.3g})"
        )
        if noise:
            noisy_params = make_params()
            noisy = run(ours(noisy_params, kl), noisy_params, steps, noise=1e-15)
            row["noise_floor"] = max(relative_difference(x, y) for x, y in zip(finals[kl], noisy))
            print(f"  ours against ours with gradients times 1 + 1e-15 N(0, 1): {row['noise_floor']:.2e}")
        rows.append(row)
    apart = max(relative_difference(x, y) for x, y in zip(finals[True][apart_on], finals[False][apart_on]))
    rows.append({"run": names[2], "difference": apart})
    print(f"{names[2]}: {apart:.2e}")
    return rows
