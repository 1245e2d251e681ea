"""Accuracy and speed of Muon's fp32 Newton-Schulz paths (dist_optim.newton_schulz) against the plain
formula, on the momenta that stress them: rank 8, singular values log-spaced over 1..1e-6, Gaussian.

    python bench/ns_accuracy.py                                   # the shapes below, accuracy only
    python bench/ns_accuracy.py --shapes 512x1376 1024x2752 --speed --repeats 7

Accuracy: max |x - ref| / max |ref| against the plain formula run in float64 on the same fp32 input,
for the plain formula in fp32 (the noise floor), the default path (the formula with blocked
symmetric products), Gram space (``gram_space=True``) and Gram space restarted from ``X`` after
each block of iterations (``gram[2,2,1]``: ``X_k = Q X_0`` and a fresh ``A`` after 2 and 4
iterations), each also as a ratio to the floor. Speed (``--speed``, Gaussian input): the median
of ``--repeats`` round-robin runs of each path as a ratio to the plain formula's, in one process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

ROOT = __file__.rsplit("/bench/", 1)[0]
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from dist_optim.muon import DEFAULT_NS_COEFFICIENTS  # noqa: E402
from dist_optim.newton_schulz import SYMMETRIC_MIN_SIZE, newton_schulz, newton_schulz_gram_space  # noqa: E402
from dist_optim.structured import symmetric_product  # noqa: E402
from dist_optim.testing import STRESS_KINDS, plain_newton_schulz, stress_momentum  # noqa: E402

COEFFS = [DEFAULT_NS_COEFFICIENTS] * 5


def plain(c: torch.Tensor) -> torch.Tensor:
    """Jordan et al.'s iteration as written, plain products in ``c``'s dtype."""
    return plain_newton_schulz(c, COEFFS)


def restarted(c: torch.Tensor, blocks: list[int]) -> torch.Tensor:
    """Gram space in blocks of iterations, restarting from ``X`` (the formula for a block of 1)."""
    x = c.T if c.size(0) > c.size(1) else c
    x = x / x.norm().clamp(min=1e-7)
    k = 0
    for length in blocks:
        part = COEFFS[k : k + length]
        if length > 1:
            x = newton_schulz_gram_space(x, part)
        else:  # one iteration of the default path, on X as it is (no normalisation)
            (a, b, cc), gram = part[0], symmetric_product(x, x.T, SYMMETRIC_MIN_SIZE)
            poly = symmetric_product(gram, gram, SYMMETRIC_MIN_SIZE).mul_(cc).add_(gram, alpha=b)
            x = torch.addmm(x, poly, x, beta=a)
        k += length
    return x.T if c.size(0) > c.size(1) else x


PATHS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "default": lambda c: newton_schulz(c, COEFFS, 1e-7),
    "gram": lambda c: newton_schulz(c, COEFFS, 1e-7, gram_space=True),
    "gram[2,2,1]": lambda c: restarted(c, [2, 2, 1]),
    "gram[3,2]": lambda c: restarted(c, [3, 2]),
}


def error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).abs().max() / ref.abs().max())


def accuracy(shapes: list[tuple[int, int]]) -> None:
    print("| shape | input | plain fp32 | " + " | ".join(PATHS) + " |")
    print("|---|---|---:|" + "---:|" * len(PATHS))
    for m, n in shapes:
        for kind in STRESS_KINDS:
            c = stress_momentum((m, n), kind)
            ref = plain(c.double())
            floor = error(plain(c), ref)
            cells = [f"{(e := error(f(c), ref)):.2e} ({e / floor:.2f}x)" for f in PATHS.values()]
            print(f"| {m} x {n} | {kind} | {floor:.2e} | " + " | ".join(cells) + " |", flush=True)


def speed(shapes: list[tuple[int, int]], repeats: int) -> None:
    print(f"\ntime / plain formula's, median of {repeats} (threads: {torch.get_num_threads()})")
    fns = {"plain": plain, **PATHS}
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
        cells = " ".join(f"{k} {med[k] / med['plain']:.3f}" for k in PATHS)
        print(f"{m} x {n}: plain {1e3 * med['plain']:.1f} ms; {cells}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--shapes", nargs="+", default=["512x1376", "1376x512", "512x1536", "1536x512", "1024x2752", "2048x5504"]
    )
    ap.add_argument("--speed", action="store_true", help="also time each path (Gaussian input)")
    ap.add_argument("--no-accuracy", action="store_true")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    shapes = [(int(s.split("x")[0]), int(s.split("x")[1])) for s in args.shapes]
    if not args.no_accuracy:
        accuracy(shapes)
    if args.speed:
        speed(shapes, args.repeats)


if __name__ == "__main__":
    main()
