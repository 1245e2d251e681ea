"""What dist_optim.kernels.structured's half-precision CPU detour (``FP16_CPU_GEMM_DETOUR``) saves, in one
process on this torch: Muon's Newton-Schulz iteration (5 default steps, Gaussian input) in fp16 and
bf16, the formula and Gram space, each with the detour and without it (the median of ``--repeats``
round-robin runs, one thread), and whether the two give the same bits; then the same for Kron's
products of a factor of side ``--factor`` (``matmul_triangular``, ``upper_times_upper``,
``gram_update_`` with 64 rows).

    .venv/bin/python bench/structured_half.py                 # 300x700 and 512x1376, about a minute
    .venv/bin/python bench/structured_half.py --shapes 1376x512 --repeats 3

Without the detour, torch 2.5.1's CPU gemm takes a slow path for fp16 operands that are row-major
blocks of larger matrices and for a half-precision product written into such a block (the blocked
symmetric products of dist_optim.kernels.structured make both); torch 2.13 has no such path (the detour is
off there, and this script then times one path twice).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

import dist_optim
from dist_optim.kernels import newton_schulz, structured
from dist_optim.kernels.structured import gram_update_, matmul_triangular, upper_times_upper

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _median_ms(runs: dict[str, Callable[[], torch.Tensor]], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def _gram_update(c: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return gram_update_(c.clone(), rows, 0.9, 0.1)


def _row(label: str, size: str, path: str, product: Callable[[], torch.Tensor], repeats: int) -> None:
    def detoured(detour: bool) -> torch.Tensor:
        structured.FP16_CPU_GEMM_DETOUR = detour
        return product()

    same = torch.equal(detoured(True), detoured(False))
    ms = _median_ms({"on": lambda: detoured(True), "off": lambda: detoured(False)}, repeats)
    print(f"{label:5} {size:9} {path:17} {ms['on']:10.2f} {ms['off']:11.2f} {ms['on'] / ms['off']:7.3f}  {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["300x700"])
    parser.add_argument("--dtypes", nargs="+", default=["fp16"], choices=sorted(DTYPES))
    parser.add_argument("--factor", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    coeffs = [dist_optim.muon.DEFAULT_NS_COEFFICIENTS] * 5
    print(f"torch {torch.__version__}; detour by default: {structured.FP16_CPU_GEMM_DETOUR}")
    print(f"{'dtype':5} {'size':9} {'path':17} {'detour ms':>10} {'without ms':>11} {'ratio':>7}  same bits")
    for label in args.dtypes:
        dtype = DTYPES[label]
        gen = torch.Generator().manual_seed(0)
        for shape in args.shapes:
            rows, cols = (int(s) for s in shape.split("x"))
            c = torch.randn(rows, cols, generator=gen)
            for path, gram in (("formula", False), ("gram", True)):
                iteration = partial(newton_schulz.newton_schulz, c, coeffs, 1e-7, dtype=dtype, gram_space=gram)
                _row(label, shape, path, iteration, args.repeats)
        n = args.factor
        f, t, a = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(3))
        rows64 = torch.randn(n, 64, generator=gen).to(dtype)
        _row(label, str(n), "matmul_triangular", partial(matmul_triangular, f, t), args.repeats)
        _row(label, str(n), "upper_times_upper", partial(upper_times_upper, t, t), args.repeats)
        _row(label, str(n), "gram_update_", partial(_gram_update, a, rows64), args.repeats)


if __name__ == "__main__":
    main()
