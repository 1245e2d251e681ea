"""Accuracy and speed of Muon's Newton-Schulz paths (dist_optim.kernels.newton_schulz) against the plain
formula, on the momenta that stress them: rank 8, singular values log-spaced over 1..1e-6, Gaussian.

    python bench/ns_accuracy.py                                   # the shapes below, fp32, accuracy only
    python bench/ns_accuracy.py --dtype bf16 --shapes 256x704 512x1376 1376x512
    python bench/ns_accuracy.py --shapes 512x1376 1024x2752 --speed --repeats 7

Accuracy: the distance to the plain formula run in float64 on the same fp32 input, as max |x - ref| /
max |ref| and relative Frobenius ``||x - ref|| / ||ref||``, for the floor (the plain formula in fp32;
in bf16/fp16 ``newton_schulz`` in that dtype, which is torch.optim.Muon's formula), the default path
(fp32: the formula with blocked symmetric products), Gram space as it runs (``gram_space=True``,
restarted every ``GRAM_SPACE_RESTART_EVERY`` iterations; on a matrix less than twice as wide, the
formula with blocked symmetric products that ``gram_space=True`` takes there, in every dtype, and
the restart columns with it), and Gram space with the restarts moved
(``gram/5``: none; ``gram/2``: every 2), each also as a ratio to the floor. Speed (``--speed``,
Gaussian input): the median of ``--repeats`` round-robin runs of each path as a ratio to the plain
formula's, in one process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from unittest import mock

import torch

ROOT = __file__.rsplit("/bench/", 1)[0]
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import dist_optim.kernels.newton_schulz as ns_module  # noqa: E402
from dist_optim.kernels.newton_schulz import newton_schulz  # noqa: E402
from dist_optim.muon import DEFAULT_NS_COEFFICIENTS  # noqa: E402
from dist_optim.testing import STRESS_KINDS, plain_newton_schulz, stress_momentum  # noqa: E402

COEFFS = [DEFAULT_NS_COEFFICIENTS] * 5


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def plain(c: torch.Tensor) -> torch.Tensor:
    """Jordan et al.'s iteration as written, plain products in ``c``'s dtype."""
    return plain_newton_schulz(c, COEFFS)


def restarted(c: torch.Tensor, every: int, dtype: torch.dtype) -> torch.Tensor:
    """Gram space in ``dtype`` as :func:`newton_schulz` runs it, restarting from ``X`` after every
    ``every`` iterations instead of ``GRAM_SPACE_RESTART_EVERY``."""
    with mock.patch.object(ns_module, "GRAM_SPACE_RESTART_EVERY", every):
        return newton_schulz(c, COEFFS, 1e-7, dtype=dtype, gram_space=True)


def paths(dtype: torch.dtype) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    floor: Callable[[torch.Tensor], torch.Tensor] = (
        plain if dtype == torch.float32 else lambda c: newton_schulz(c, COEFFS, 1e-7, dtype=dtype)
    )
    return {
        "floor": floor,
        **({"default": lambda c: newton_schulz(c, COEFFS, 1e-7)} if dtype == torch.float32 else {}),
        "gram": lambda c: newton_schulz(c, COEFFS, 1e-7, dtype=dtype, gram_space=True),
        "gram/5": lambda c: restarted(c, 5, dtype),
        "gram/2": lambda c: restarted(c, 2, dtype),
    }


def errors(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    d = x.double() - ref
    return float(d.abs().max() / ref.abs().max()), float(d.norm() / ref.norm())


def accuracy(shapes: list[tuple[int, int]], dtype: torch.dtype) -> None:
    fns = paths(dtype)
    names = [k for k in fns if k != "floor"]
    print(f"max-abs / relative Frobenius distance to the float64 formula; {dtype}")
    print("| shape | input | floor | " + " | ".join(names) + " |")
    print("|---|---|---:|" + "---:|" * len(names))
    for m, n in shapes:
        for kind in STRESS_KINDS:
            c = stress_momentum((m, n), kind)
            ref = plain(c.double())
            fm, ff = errors(fns["floor"](c), ref)
            cells = []
            for k in names:
                em, ef = errors(fns[k](c), ref)
                cells.append(f"{em:.2e} / {ef:.2e} ({em / fm:.2f}x / {ef / ff:.2f}x)")
            print(f"| {m} x {n} | {kind} | {fm:.2e} / {ff:.2e} | " + " | ".join(cells) + " |", flush=True)


def speed(shapes: list[tuple[int, int]], repeats: int, dtype: torch.dtype) -> None:
    print(f"\ntime / plain formula's, median of {repeats} (threads: {torch.get_num_threads()}); {dtype}")
    named = {k: f for k, f in paths(dtype).items() if k != "floor"}
    fns = {"plain": lambda c: plain(c.to(dtype)), **named}
    for m, n in shapes:
        c = stress_momentum((m, n), "gaussian")
        times: dict[str, list[float]] = {k: [] for k in fns}
        for f in fns.values():
            f(c)  # warm-up
        for _ in range(repeats):
            for k, f in fns.items():
                t0 = time.perf_counter()
                f(c)
                times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        cells = " ".join(f"{k} {med[k] / med['plain']:.3f}" for k in named)
        print(f"{m} x {n}: plain {1e3 * med['plain']:.1f} ms; {cells}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--shapes", nargs="+", default=["512x1376", "1376x512", "512x1536", "1536x512", "1024x2752", "2048x5504"]
    )
    ap.add_argument("--speed", action="store_true", help="also time each path (Gaussian input)")
    ap.add_argument("--no-accuracy", action="store_true")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="the iteration's dtype")
    args = ap.parse_args()
    shapes = [(int(s.split("x")[0]), int(s.split("x")[1])) for s in args.shapes]
    if not args.no_accuracy:
        accuracy(shapes, DTYPES[args.dtype])
    if args.speed:
        speed(shapes, args.repeats, DTYPES[args.dtype])


if __name__ == "__main__":
    main()
