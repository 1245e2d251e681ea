"""Our SOAP, Muon and PSGD Kron against heavyball's compiled ones, in one process.

heavyball (PyPI) compiles its steps with ``torch.compile`` and needs torch >= 2.9, above the
torch 2.5.1 that ColossalAI 0.5.0 pins, so this runs in a scratch virtual environment with our
package on the path (it imports without ColossalAI)::

    python3.11 -m venv /tmp/hb && /tmp/hb/bin/pip install "torch>=2.9" heavyball numpy
    PYTHONPATH=. /tmp/hb/bin/python bench/vs_heavyball.py [--repeats 30] [--only soap muon kron]
        [--clock wall|cpu] [--threads N] [--muon-fp32 | --no-muon-fp32] [--device cuda]

The set: ``bench_step.llama_like(512, 1376, 2, vocab)``, 7.4M parameters with the default
``--vocab 2048`` (every dim at most 2048: heavyball leaves a dim above ``max_precond_dim``
unpreconditioned where ours cuts it into blocks, which would not be the same math). Every optimizer
steps its own copy with fixed gradients; steps are timed round-robin (one step of each optimizer in
turn), after ``--warmup`` rounds that include heavyball's compilation and each optimizer's first
preconditioner. Printed per pair: the median step of each (a step between refreshes) and the mean
over the timed rounds (with the refreshes), and ours / theirs; with ``--repeats`` of at least 5,
also the spread of the per-round ratios (ours / theirs of the steps taken in the same round).

``--clock cpu`` times the process's CPU seconds (``time.process_time``) instead of wall seconds:
on a machine shared with other jobs (a load above its cores) a step's wall time is mostly waiting
for a core, while its CPU time is the work done; with ``--threads 1`` no idle thread spins into
the count. ``--no-muon-fp32`` leaves out our fp32 Muon (the slowest of the three). ``--device cuda``
puts the parameters on the GPU and times each step from an idle device to an idle device
(``torch.cuda.synchronize`` before and after); the wall clock is then the one that means anything.
On an H100 heavyball's compilation (its default ``max-autotune-no-cudagraphs`` mode) was still
benchmarking matrix-product kernels after 120 s for the Muon pair alone, and on an H200 it took
150-200 s or more: allow minutes.

``--muon-host`` times no heavyball (it runs on the pinned torch too): our Muon (bf16 iteration on a
GPU, fp32 on a CPU: ``HOST_DTYPE``) on the set's 15 matrices at 1/16 of their sides (32 x 32 to
128 x 32: the products negligible, the step's host time and launches all that is left), with the
Newton-Schulz iteration per matrix and in batches of one shape
(``dist_optim.kernels.newton_schulz.newton_schulz_many``: the GPU's path, forced here on a CPU), timed
round-robin, and the aten operators a step dispatches (each one kernel launch on a GPU or less),
counted at torch. On a GPU, where the bench set's Muon step is its host time (its products take
well under a millisecond), the ratio is what batching takes off the step.

* SOAP: Vyas et al.'s recipe on both sides (eigenvectors at the first refresh, then one QR power
  step from the current basis: ours ``eigenbasis="qr-eigh-start"``), betas (0.9, 0.95), the factors'
  beta 0.95, epsilon 1e-8, decoupled weight decay 0.01, ``precondition_frequency`` 10 (heavyball's
  schedule off), 1-D parameters preconditioned, no dim merging, fp32 states.
* Muon: the 2-D parameters, momentum 0.95 with Nesterov, 5 Newton-Schulz steps; ours in bf16
  (``ns_dtype=torch.bfloat16``: the matrices of one shape in batches, on a CPU too since
  ``newton_schulz.CPU_BATCHED_DTYPES``), the same with each matrix on its own, in bf16 with the
  wide matrices (the MLP's and the embeddings, 2.7 and 4 wide) in Gram space and the square ones'
  symmetric products blocked on a CPU (``ns_gram_space=True``), and with its default fp32
  iteration; heavyball's in its own dtype.
* Kron: the preconditioner updated every step on both sides (probability 1), triangular factors
  up to 2048, no dim merging; the rest each package's default (they differ in details, e.g.
  heavyball's cached and delayed preconditioner: its figure is for orientation, not a parity).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.bench_step import device_sync, fixed_params, llama_like  # noqa: E402
from bench.record import Column, col, present, write_table  # noqa: E402

Factory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def soap_pair() -> list[tuple[str, Factory]]:
    import heavyball

    import dist_optim

    common = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    return [
        (
            "ours SOAP",
            lambda ps: dist_optim.DistributedShampoo(
                ps,
                epsilon=1e-8,
                eigenvalue_correction=True,
                eigenbasis="qr-eigh-start",
                precondition_frequency=10,
                max_preconditioner_dim=2048,
                **common,
            ),
        ),
        (
            "heavyball SOAP",
            lambda ps: heavyball.SOAP(
                ps,
                shampoo_beta=0.95,
                eps=1e-8,
                precondition_frequency=10,
                max_precond_dim=2048,
                merge_dims=False,
                precondition_1d=True,
                use_precond_schedule=False,
                **common,
            ),
        ),
    ]


def muon_pair() -> list[tuple[str, Factory]]:
    import heavyball

    import dist_optim

    return [
        ("ours Muon bf16", lambda ps: dist_optim.DistributedMuon(ps, lr=0.02, ns_dtype=torch.bfloat16)),
        (
            "ours Muon bf16 per matrix",
            lambda ps: _per_matrix(dist_optim.DistributedMuon(ps, lr=0.02, ns_dtype=torch.bfloat16)),
        ),
        (
            "ours Muon bf16 Gram space",
            lambda ps: dist_optim.DistributedMuon(ps, lr=0.02, ns_dtype=torch.bfloat16, ns_gram_space=True),
        ),
        ("ours Muon fp32 (default)", lambda ps: dist_optim.DistributedMuon(ps, lr=0.02)),
        ("heavyball Muon", lambda ps: heavyball.Muon(ps, lr=0.02, betas=(0.95, 0.95), nesterov=True)),
    ]


def _per_matrix(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``opt`` whose steps iterate each matrix on its own (as the CPU did in bfloat16 before
    ``newton_schulz.CPU_BATCHED_DTYPES``): what batching takes off the step, in the same run."""
    step = opt.step

    def per_matrix_step(*args: Any, **kwargs: Any) -> Any:
        with _batches(False):
            return step(*args, **kwargs)

    opt.step = per_matrix_step  # type: ignore[method-assign]
    return opt


def kron_pair() -> list[tuple[str, Factory]]:
    import heavyball

    import dist_optim

    return [
        (
            "ours Kron",
            lambda ps: dist_optim.DistributedKron(
                ps, lr=3e-4, preconditioner_update_probability=1.0, max_size_triangular=2048, merge_dims=False
            ),
        ),
        (
            "heavyball PSGDKron",
            lambda ps: heavyball.PSGDKron(
                ps, lr=3e-4, preconditioner_update_probability=1.0, max_size_triangular=2048, merge_dims=False
            ),
        ),
    ]


PAIRS = {"soap": soap_pair, "muon": muon_pair, "kron": kron_pair}


def run(
    name: str,
    shapes: list[tuple[int, ...]],
    warmup: int,
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
    skip: tuple[str, ...] = (),
    device: str = "cpu",
) -> list[tuple[str, list[float]]]:
    """(label, the timed steps' seconds) of each optimizer of the pair but ``skip``'s labels,
    timed round-robin with ``clock``, the parameters on ``device``."""
    if name == "muon":
        shapes = [s for s in shapes if len(s) == 2]
    make = fixed_params(shapes, device)
    sync = device_sync(device)
    grads = [p.grad.clone() for p in make()]  # type: ignore[union-attr]
    runs: list[tuple[str, torch.optim.Optimizer, list[torch.nn.Parameter], list[float]]] = []
    for label, factory in PAIRS[name]():
        if label in skip:
            continue
        params = make()
        runs.append((label, factory(params), params, []))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ours unbound: single-process use warns once
        for i in range(warmup + repeats):
            for _label, opt, params, times in runs:
                for p, g in zip(params, grads):  # heavyball's step consumes .grad
                    p.grad = g.clone()
                gc.collect()
                sync()
                t0 = clock()
                opt.step()
                sync()
                if i >= warmup:
                    times.append(clock() - t0)
    return [(label, t) for label, _opt, _params, t in runs]


class _Ops(TorchDispatchMode):
    """The aten operators dispatched, counted at torch."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _batches(on: bool) -> Iterator[None]:
    """Muon's iteration in batches (``on``) or per matrix, whatever the device (the bench's switch)."""
    from dist_optim.kernels import newton_schulz

    old = newton_schulz.iterates_batched
    newton_schulz.iterates_batched = lambda t, dtype=None, gram_space=False: on  # type: ignore[assignment]
    try:
        yield
    finally:
        newton_schulz.iterates_batched = old  # type: ignore[assignment]


#: ``--muon-host``'s iteration dtype: bf16 on a GPU (the comparison's); fp32 on a CPU, whose bf16
#: products without bf16 instructions cost tens of microseconds even at these sides.
HOST_DTYPE = {"cpu": torch.float32, "cuda": torch.bfloat16}


def muon_host(warmup: int, repeats: int, clock: Callable[[], float], device: str) -> list[dict[str, Any]]:
    """``--muon-host``: our Muon step (``HOST_DTYPE``) on the set's matrices at 1/16 of their sides, per matrix
    and in batches, median of round-robin steps and the aten operators of one step."""
    import dist_optim

    shapes = [s for s in llama_like(32, 86, 2, 128) if len(s) == 2]
    make = fixed_params(shapes, device)
    sync = device_sync(device)
    grads = [p.grad.clone() for p in make()]  # type: ignore[union-attr]
    dtype = HOST_DTYPE[device.split(":")[0]]
    runs = []
    for label, on in (("per matrix", False), ("in batches", True)):
        params = make()
        runs.append((label, on, dist_optim.DistributedMuon(params, lr=0.02, ns_dtype=dtype), params, [], _Ops()))
    kinds = sorted(set(shapes))
    print(f"our {dtype} Muon, {len(shapes)} matrices of {kinds} on {device}, {torch.get_num_threads()} threads")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(warmup + repeats + 1):
            for _label, on, opt, params, times, ops in runs:
                for p, g in zip(params, grads):
                    p.grad = g.clone()
                gc.collect()
                sync()
                with _batches(on):
                    if i == warmup + repeats:
                        with ops:
                            opt.step()
                        continue
                    t0 = clock()
                    opt.step()
                    sync()
                if i >= warmup:
                    times.append(clock() - t0)
    base = statistics.median(runs[0][4])
    rows = []
    for label, _on, _opt, _params, times, ops in runs:
        median = statistics.median(times)
        print(f"  {label:11s} {1e3 * median:7.2f} ms a step ({median / base:.2f}x), {ops.count} aten operators")
        rows.append(dict(iteration=label, ops=ops.count, median_ms=1e3 * median, ratio=median / base))
    return rows


#: The columns of ``--write NAME`` (``vs_heavyball_muon_gpu``, ...): per optimizer of a pair, its
#: steps and ours / heavyball's of the same run (the per-round quartiles with 5 rounds or more).
COLUMNS: list[Column] = [
    col("step", "step"),
    col("median_ms", "median (ms)", 1),
    col("mean_ms", "mean (ms)", 1),
    col("median_ratio", "/ heavyball (median)", 2, suffix="x"),
    col("mean_ratio", "/ heavyball (mean)", 2, suffix="x"),
    col("quartiles", "per-round ratio, quartiles", 2, suffix="x"),
]
#: ``--muon-host --write NAME`` (``vs_heavyball_muon_host``).
HOST_COLUMNS: list[Column] = [
    col("iteration", "iteration"),
    col("ops", "aten operators per step", 0),
    col("median_ms", "median step (ms)", 2),
    col("ratio", "/ per matrix", 2, suffix="x"),
]


def pair_rows(name: str, timed: list[tuple[str, list[float]]]) -> list[dict[str, Any]]:
    """Rows of :data:`COLUMNS` for one pair's :func:`run` (heavyball's the last), printed as well."""
    theirs = timed[-1][1]
    print(f"\n{name}: median ms (between refreshes), mean ms (with refreshes), ours / heavyball")
    rows = []
    for label, t in timed:
        row: dict[str, Any] = dict(step=label, median_ms=1e3 * statistics.median(t), mean_ms=1e3 * statistics.mean(t))
        ratio = ""
        if t is not theirs:
            row.update(
                median_ratio=statistics.median(t) / statistics.median(theirs),
                mean_ratio=statistics.mean(t) / statistics.mean(theirs),
            )
            ratio = f"   {row['median_ratio']:.2f}x median, {row['mean_ratio']:.2f}x mean"
            if len(t) >= 5:
                q = statistics.quantiles([a / b for a, b in zip(t, theirs)], n=4)
                row["quartiles"] = {"min": q[0], "max": q[2]}
                ratio += f" (per round: quartiles {q[0]:.2f}-{q[2]:.2f}x)"
        print(f"  {label:26s} {row['median_ms']:8.1f} {row['mean_ms']:8.1f}{ratio}")
        rows.append(row)
    return rows


def heavyball_version() -> str:
    """heavyball's version, from the module (a stand-in has no distribution metadata)."""
    import heavyball

    found = getattr(heavyball, "__version__", None)
    if found is None:
        from importlib.metadata import version

        found = version("heavyball")
    return str(found)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", choices=sorted(PAIRS), default=["soap", "muon", "kron"])
    ap.add_argument("--warmup", type=int, default=12, help="untimed rounds (compilation, first refresh)")
    ap.add_argument("--repeats", type=int, default=30, help="timed rounds (pf=10: 3 refreshes in 30)")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="wall seconds or process CPU seconds")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--muon-fp32", action=argparse.BooleanOptionalAction, default=True, help="time our fp32 Muon")
    ap.add_argument("--device", default="cpu", help="where the parameters live (cuda: GPU timings, synchronised)")
    ap.add_argument(
        "--muon-host",
        action="store_true",
        help="no heavyball: our Muon's host time and operators per step, per matrix and in batches",
    )
    ap.add_argument("--write", metavar="NAME", help="also write the rows as bench/results/NAME.json (off by default)")
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    write = functools.partial(write_table, script=__file__, argv=argv, device=args.device)
    setting = f"{args.repeats} timed rounds after {args.warmup}, {args.clock} clock"
    if args.muon_host:
        host_rows = muon_host(args.warmup, args.repeats, clock, args.device)
        if args.write:
            write(args.write, HOST_COLUMNS, host_rows, [f"Medians of {setting}."])
        return
    skip = () if args.muon_fp32 else ("ours Muon fp32 (default)",)
    shapes = llama_like(512, 1376, 2, args.vocab)
    n = sum(torch.Size(s).numel() for s in shapes)
    print(f"torch {torch.__version__}, heavyball {heavyball_version()}, {n / 1e6:.1f}M parameters")
    if args.device.startswith("cuda"):
        print(f"device {torch.cuda.get_device_name(args.device)}")
    print(f"threads {torch.get_num_threads()}, warmup {args.warmup}, timed rounds {args.repeats}, {args.clock} clock")
    rows = []
    for name in args.only:
        rows += pair_rows(name, run(name, shapes, args.warmup, args.repeats, clock, skip, args.device))
    if args.write:
        notes = [f"{n / 1e6:.1f}M parameters, {setting}."]
        write(args.write, *present(COLUMNS, rows), notes, extra={"heavyball": heavyball_version()})


if __name__ == "__main__":
    main()
