"""One Shampoo factor update, ``C <- beta C + alpha G G^T`` for a 1024 x 1024 factor and gradient
block, by every triangle kernel reachable from this environment, timed in turn::

    .venv/bin/python bench/blas_triangle.py [--n 1024] [--repeats 30] [--threads 1]

Rows: torch's full product (``addmm_``, both triangles), ours (:func:`dist_optim.kernels.structured.
gram_update_`: the lower triangle in column panels of 128, each one ``addmm_``), and the BLAS
triangle kernels torch does not expose, called through ctypes: MKL's ``ssyrk`` and ``sgemmt``
(the triangle-only gemm) from the MKL linked into libtorch, and OpenBLAS's ``ssyrk`` from the
library NumPy bundles (with as many threads as torch uses). OpenBLAS's threads keep spinning for a
while after each call and slow torch's kernels down, so it is loaded and timed after the others,
in turn with ours, which is also shown as it runs right after each OpenBLAS call. A kernel whose
symbol is missing is reported as unavailable. Before timing, each kernel's lower triangle is
checked against ``beta C + alpha (G @ G.T)`` (within 1e-4 of the largest entry: a check that the
call computes the right product, far above fp32 rounding of 1024-term sums), and a BLAS kernel's
strict upper triangle must be left untouched.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from dist_optim.kernels import structured  # noqa: E402

BETA, ALPHA = 0.999, 0.001
FULL, OURS = "torch addmm_ (full product)", "ours: gram_update_ (panels of 128)"
MKL_SYRK, MKL_GEMMT, OPENBLAS_SYRK = "MKL ssyrk (libtorch)", "MKL sgemmt (libtorch)", "OpenBLAS ssyrk (NumPy's)"
BLAS = (MKL_SYRK, MKL_GEMMT, OPENBLAS_SYRK)


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def _fortran_syrk(fn: Callable[..., object], int_t: type, hidden_lengths: bool) -> Callable[..., None]:
    """``C <- beta C + alpha rows rows^T`` on the lower triangle of a row-major ``C`` through a
    Fortran (column-major) ``ssyrk``: row-major ``rows`` (n x k) is column-major ``rows^T`` (k x n),
    so ``trans="T"``; the row-major lower triangle is the column-major upper one."""

    def run(c: torch.Tensor, rows: torch.Tensor) -> None:
        n, k = rows.shape
        tail = [int_t(1), int_t(1)] if hidden_lengths else []  # gfortran's lengths of the two chars
        fn(
            ctypes.c_char_p(b"U"),
            ctypes.c_char_p(b"T"),
            ctypes.byref(int_t(n)),
            ctypes.byref(int_t(k)),
            ctypes.byref(ctypes.c_float(ALPHA)),
            _ptr(rows),
            ctypes.byref(int_t(k)),
            ctypes.byref(ctypes.c_float(BETA)),
            _ptr(c),
            ctypes.byref(int_t(n)),
            *tail,
        )

    return run


def _mkl_gemmt(fn: Callable[..., object]) -> Callable[..., None]:
    """The same through MKL's ``sgemmt`` (``C`` triangle of ``op(A) op(B)``), A = B = ``rows``."""

    def run(c: torch.Tensor, rows: torch.Tensor) -> None:
        n, k = rows.shape
        i = ctypes.c_int
        fn(
            ctypes.c_char_p(b"U"),
            ctypes.c_char_p(b"T"),
            ctypes.c_char_p(b"N"),
            ctypes.byref(i(n)),
            ctypes.byref(i(k)),
            ctypes.byref(ctypes.c_float(ALPHA)),
            _ptr(rows),
            ctypes.byref(i(k)),
            _ptr(rows),
            ctypes.byref(i(k)),
            ctypes.byref(ctypes.c_float(BETA)),
            _ptr(c),
            ctypes.byref(i(n)),
        )

    return run


Kernel = Callable[[torch.Tensor, torch.Tensor], object]


def torch_kernels() -> tuple[dict[str, Kernel], dict[str, str]]:
    """torch's product, ours, and MKL's triangle kernels (all on torch's OpenMP threads), and the
    reason for each that cannot be called here."""
    found: dict[str, Kernel] = {
        FULL: lambda c, rows: c.addmm_(rows, rows.T, beta=BETA, alpha=ALPHA),
        OURS: lambda c, rows: structured.gram_update_(c, rows, BETA, ALPHA),
    }
    missing: dict[str, str] = {}
    libtorch = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    for name, symbol, wrap in (
        (MKL_SYRK, "mkl_blas_ssyrk", lambda f: _fortran_syrk(f, ctypes.c_int, False)),
        (MKL_GEMMT, "mkl_blas_sgemmt", _mkl_gemmt),
    ):
        try:
            found[name] = wrap(getattr(libtorch, symbol))
        except AttributeError:
            missing[name] = f"libtorch_cpu.so has no {symbol}"
    return found, missing


def openblas_syrk() -> Kernel | str:
    """OpenBLAS's ``ssyrk`` from NumPy's bundled library, on as many threads as torch uses, or
    the reason it cannot be called here."""
    import numpy

    libs = glob.glob(os.path.join(os.path.dirname(numpy.__file__), os.pardir, "numpy.libs", "libscipy_openblas*.so"))
    try:
        openblas = ctypes.CDLL(libs[0])
        openblas.scipy_openblas_set_num_threads64_(ctypes.c_int(torch.get_num_threads()))
        return _fortran_syrk(openblas.scipy_ssyrk_64_, ctypes.c_int64, True)
    except (IndexError, AttributeError, OSError) as exc:
        return f"NumPy's bundled OpenBLAS with scipy_ssyrk_64_ not found ({exc!r})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1024, help="factor size (and gradient columns)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch's (and OpenBLAS's) threads; default: torch's")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(args.n, args.n, generator=gen)
    c0 = torch.randn(args.n, args.n, generator=gen)
    c0 = c0 + c0.T
    expected = BETA * c0 + ALPHA * (rows @ rows.T)
    lower = torch.ones(args.n, args.n, dtype=torch.bool).tril()
    found, missing = torch_kernels()

    def check(name: str, fn: Kernel) -> bool:
        """Whether ``fn`` computes the lower triangle right (and, a BLAS triangle kernel, leaves
        the strict upper one alone: torch's product writes both triangles and ours the upper
        halves of its diagonal tiles)."""
        c = c0.clone()
        fn(c, rows)
        err = (c - expected)[lower].abs().max().item() / expected.abs().max().item()
        wrote_upper = name in BLAS and not torch.equal(c[~lower], c0[~lower])
        if err > 1e-4 or wrote_upper:
            missing[name] = f"wrong result (max error {err:.1e} of the largest entry, wrote upper: {wrote_upper})"
        return name not in missing

    found = {name: fn for name, fn in found.items() if check(name, fn)}

    def timed(kernels: list[tuple[str, Kernel]]) -> list[float]:
        """Median seconds of each kernel, called in turn (so that load from elsewhere hits every
        row alike); a kernel may be listed twice."""
        outs = [c0.clone() for _ in kernels]
        times: list[list[float]] = [[] for _ in kernels]
        for i in range(args.warmup + args.repeats):
            for k, (_name, fn) in enumerate(kernels):
                t0 = time.perf_counter()
                fn(outs[k], rows)
                if i >= args.warmup:
                    times[k].append(time.perf_counter() - t0)
        return [statistics.median(t) for t in times]

    # Phase 1: torch's and MKL's kernels share torch's OpenMP threads. OpenBLAS has a thread pool
    # of its own whose threads keep spinning for a while after a call, slowing torch's kernels
    # down, so it is loaded and timed only afterwards (phase 2), in turn with ours: its ratio is to
    # ours in phase 2; ours in phase 2 runs right after each OpenBLAS call, and its ratio to ours
    # in phase 1 shows that interference (and any change of load from elsewhere between phases).
    med = dict(zip(found, timed(list(found.items()))))
    ours = med[OURS]
    table = [(name, sec, f"{sec / ours:.2f}x") for name, sec in med.items()]
    syrk = openblas_syrk()
    if isinstance(syrk, str):
        missing[OPENBLAS_SYRK] = syrk
    elif check(OPENBLAS_SYRK, syrk):
        t_openblas, t_after = timed([(OPENBLAS_SYRK, syrk), (OURS, found[OURS])])
        table += [
            (f"phase 2: {OPENBLAS_SYRK}", t_openblas, f"{t_openblas / t_after:.2f}x (of ours in phase 2)"),
            (f"phase 2: {OURS}, right after OpenBLAS", t_after, f"{t_after / ours:.2f}x (of ours in phase 1)"),
        ]
    print(
        f"\nC <- {BETA} C + {ALPHA} G G^T, C {args.n}x{args.n}, G {args.n}x{args.n}, fp32, "
        f"{torch.get_num_threads()} threads, median of {args.repeats} (in turn)"
    )
    print("| kernel | median (ms) | / ours |")
    print("|---|---:|---:|")
    for name, sec, ratio in table:
        print(f"| {name} | {1e3 * sec:.2f} | {ratio} |")
    for name, why in missing.items():
        print(f"| {name} | unavailable: {why} | |")


if __name__ == "__main__":
    main()
