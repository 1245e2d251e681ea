"""Optimizer step time and state memory, as ratios to torch AdamW (foreach) measured in the same run.

Single process (default)::

    python bench/bench_step.py                     # Llama-like set: 2 layers H=1024 I=2752 + 8192x1024 embedding
    python bench/bench_step.py --only lamb --repeats 20

Each optimizer gets its own copy of the parameters and fixed random gradients; steps are timed
round-robin (one step of each optimizer in turn, ``--repeats`` rounds after ``--warmup``) so that
load from elsewhere on the machine hits every row alike, and the median is reported. Ratios, not
seconds, are what docs/benchmarks.md quotes.

Distributed (``--dist [lamb adafactor came galore shampoo]``) launches 4 CPU processes, boosts a
small Llama with HybridParallelPlugin tp=2 x dp=2 (``--zero-stage``, ``--precision``; ZeRO-1 bf16
by default) and times the optimizer step, counts its collectives and the bytes they carry
(received), for ours (swapped in from the ordinary optimizer) and for ColossalAI's own
distributed class; a peer that fails on the layout is reported as such. Shampoo (ours, passed
directly; ColossalAI has none) runs twice: gradient pieces sent to the block owners (the
default) and full gradients gathered on every rank; so do Muon and Kron (``kron``: kron_torch's
Kron swapped for ours; momentum pieces to the owners, or every full momentum gathered). With
``--bucket-bytes N`` those three run with that step-memory budget instead, once as they are (the
next bucket's exchange in flight while one computes, :func:`dist_optim.sharding.owners.pipelined`) and once
with the same buckets in sequence: the overlap's effect on the step.

``--split shampoo|kron|muon`` measures the per-rank preconditioner work (CPU seconds) and bytes at
dp=4 against dp=1 (``--layers`` sets the depth of the parameter set); for Shampoo also at tp=2 x
dp=2 (matrices split by rows over TP), with blocks split over the TP x DP grid and, for
comparison, over each TP rank's dp pair only.

GaLore rows report the amortised step too: the first step computes every projector (the SVDs a
refresh does), so ``(first + (gap - 1) x median) / gap``.

``--write NAME`` also writes what a mode printed as ``bench/results/NAME.json``, the data of the
docs' table NAME (:func:`bench.record.write_table`; each mode its own columns: :data:`STEP_COLUMNS`,
:data:`bench.step_dist.DIST_COLUMNS` or ``OVERLAP_COLUMNS`` with ``--bucket-bytes``,
:data:`bench.step_split.SPLIT_COLUMNS`). It is off by default, so that a partial run never replaces
a table's data. ``--tiny`` (0.3M parameters) checks the bench itself and measures nothing worth a table.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

ROOT = __file__.rsplit("/bench/", 1)[0]
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.record import Column, col, present, write_table  # noqa: E402
from bench.step_dist import DIST_COLUMNS, DIST_FAMILIES, OVERLAP_COLUMNS, dist_rows, overlap_rows, run_dist  # noqa: E402


def llama_like(hidden: int = 1024, inter: int = 2752, layers: int = 2, vocab: int = 8192) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden, hidden)] * 4 + [(inter, hidden), (inter, hidden), (hidden, inter), (hidden,), (hidden,)]
    shapes.append((hidden,))
    return shapes


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer state, also inside containers and objects
    (galore_torch keeps its projector in a GaLoreProjector object), each storage counted once."""
    seen: set[int] = set()

    def count(v: Any, depth: int = 0) -> int:
        if isinstance(v, torch.Tensor):
            key = v.untyped_storage().data_ptr()
            if key in seen:
                return 0
            seen.add(key)
            return v.numel() * v.element_size()
        if depth > 3:
            return 0
        if isinstance(v, dict):
            return sum(count(x, depth + 1) for x in v.values())
        if isinstance(v, (list, tuple)):
            return sum(count(x, depth + 1) for x in v)
        if hasattr(v, "__dict__") and not isinstance(v, type):
            return sum(count(x, depth + 1) for x in vars(v).values())
        return 0

    return sum(count(state) for state in opt.state.values())


def fixed_params(shapes: list[tuple[int, ...]], device: str = "cpu") -> Callable[[], list[torch.nn.Parameter]]:
    """A maker of parameter sets of ``shapes`` (random * 0.02) with fixed gradients (random *
    1e-3), the same values from seed 0 on every call: one copy per optimizer timed, on ``device``."""
    gen = torch.Generator().manual_seed(0)
    base = [(torch.randn(s, generator=gen) * 0.02).to(device) for s in shapes]
    grads = [(torch.randn(s, generator=gen) * 1e-3).to(device) for s in shapes]

    def make() -> list[torch.nn.Parameter]:
        params = [torch.nn.Parameter(b.clone()) for b in base]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        return params

    return make


def device_sync(device: str) -> Callable[[], None]:
    """What a step's timing calls before and after it: a CUDA step returns before its kernels
    finish, so there time runs from an idle device to an idle device; elsewhere nothing."""
    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def run_bench(
    shapes: list[tuple[int, ...]], selected: list[Any], warmup: int, repeats: int, device: str = "cpu"
) -> list[dict[str, Any]]:
    make_params = fixed_params(shapes, device)
    sync = device_sync(device)
    runs: list[tuple[Any, Any, list[float]]] = []
    for row in selected:
        params = make_params()
        try:
            opt = row.factory(params)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run here is reported, not fatal
            print(f"  skipped {row.name}: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        runs.append((row, opt, []))
    firsts: dict[int, float] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(warmup + repeats):
            for k, (_row, opt, times) in enumerate(runs):
                gc.collect()
                sync()
                t0 = time.perf_counter()
                opt.step()
                sync()
                dt = time.perf_counter() - t0
                if i == 0:
                    firsts[k] = dt
                if i >= warmup:
                    times.append(dt)
    base_time = statistics.median(runs[0][2])
    base_bytes = state_bytes(runs[0][1])
    out = []
    for k, (row, opt, times) in enumerate(runs):
        median = statistics.median(times)
        amortised = None
        if row.refresh_every:
            amortised = (firsts[k] + (row.refresh_every - 1) * median) / row.refresh_every / base_time
        out.append(
            dict(
                name=row.name,
                group=row.group,
                ms=1e3 * median,
                mean_ratio=statistics.mean(times) / statistics.mean(runs[0][2]),
                ratio=median / base_time,
                amortised_ratio=amortised,
                state_ratio=state_bytes(opt) / base_bytes if base_bytes else float("nan"),
            )
        )
    return out


def print_table(results: list[dict[str, Any]], shapes: list[tuple[int, ...]], device: str = "cpu") -> None:
    n = sum(torch.Size(s).numel() for s in shapes)
    where = torch.cuda.get_device_name(device) if device.startswith("cuda") else f"{torch.get_num_threads()} threads"
    print(f"\nStep time and optimizer state vs torch AdamW (foreach), {n / 1e6:.1f}M params, {where}")
    print(
        "| optimizer | group | median step (ms) | median / AdamW | mean / AdamW | amortised / AdamW "
        "| state bytes / AdamW |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in results:
        amortised = "" if r["amortised_ratio"] is None else f"{r['amortised_ratio']:.2f}x"
        print(
            f"| {r['name']} | {r['group']} | {r['ms']:.1f} | {r['ratio']:.2f}x | {r['mean_ratio']:.2f}x "
            f"| {amortised} | {r['state_ratio']:.3f} |"
        )


#: The single-process table's columns (``step_*``, ``step_gpu``): ratios to AdamW (foreach) of the
#: same run; the amortised column only where a row refreshes (:func:`bench.record.present`).
STEP_COLUMNS: list[Column] = [
    col("optimizer", "optimizer"),
    col("median_ms", "median step (ms)", 1),
    col("step_vs_adamw", "step / AdamW", 2, suffix="x"),
    col("mean_vs_adamw", "mean step / AdamW", 2, suffix="x"),
    col("amortised_vs_adamw", "amortised / AdamW", 2, suffix="x"),
    col("state_vs_adamw", "state bytes / AdamW", 3),
]


def step_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`run_bench`'s results as rows of :data:`STEP_COLUMNS`."""
    return [
        dict(
            optimizer=r["name"],
            median_ms=r["ms"],
            step_vs_adamw=r["ratio"],
            mean_vs_adamw=r["mean_ratio"],
            amortised_vs_adamw=r["amortised_ratio"],
            state_vs_adamw=r["state_ratio"],
        )
        for r in results
    ]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="groups to run (baseline always runs)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=15)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--small", action="store_true", help="a 4x smaller parameter set (quick check)")
    size.add_argument("--tiny", action="store_true", help="0.3M parameters: a check of the bench itself, not a figure")
    ap.add_argument("--device", default="cpu", help="where the single-process rows run (cpu, cuda)")
    ap.add_argument(
        "--dist",
        nargs="*",
        choices=sorted(DIST_FAMILIES),
        help="distributed boosted-step benchmark on 4 processes for these families (none named: all)",
    )
    ap.add_argument("--zero-stage", type=int, default=1, help="ZeRO stage for --dist")
    ap.add_argument(
        "--bucket-bytes",
        type=int,
        default=None,
        help="--dist shampoo/muon/kron: this step-memory budget, each also run with its buckets in sequence",
    )
    ap.add_argument("--precision", default="bf16", help="precision for --dist (fp32, bf16, fp16)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument(
        "--split",
        choices=("shampoo", "kron", "muon"),
        help="per-rank preconditioner work at dp=4 vs dp=1 for this optimizer (4 processes)",
    )
    ap.add_argument("--pf", type=int, default=10, help="precondition_frequency for --split")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the --split parameter set")
    ap.add_argument(
        "--write",
        metavar="NAME",
        help="also write the rows as bench/results/NAME.json, the data of the docs' <!-- table: NAME --> "
        "(off by default: a partial run must not replace a table's data)",
    )
    return ap


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    write = functools.partial(write_table, script=__file__, argv=argv) if args.write else None
    if args.dist is not None:
        families = args.dist or sorted(DIST_FAMILIES)
        res = run_dist(args.steps, families, args.zero_stage, args.precision, args.bucket_bytes)
        setting = f"tp=2 x dp=2 on 4 CPU processes (gloo), ZeRO-{args.zero_stage}, {args.precision}"
        if write and args.bucket_bytes is not None:
            notes = [f"{setting}, buckets of {args.bucket_bytes} B; the two forms in the order A B B A."]
            write(args.write, OVERLAP_COLUMNS, overlap_rows(res, families), notes)
        elif write:
            notes = [f"{setting}; per step, the median of {args.steps} timed steps after 2 untimed ones."]
            write(args.write, *present(DIST_COLUMNS, dist_rows(res, families)), notes)
        return
    if args.split:
        from bench.step_split import SPLIT_COLUMNS, run_split

        rows = run_split(args.split, args.steps, args.pf, args.layers)
        if write:
            write(args.write, SPLIT_COLUMNS, rows, ["4 CPU processes (gloo); CPU seconds."])
        return
    from bench.rows import rows as all_rows

    shapes = llama_like(512, 1376, 2, 4096) if args.small else llama_like()
    shapes = llama_like(128, 344, 1, 512) if args.tiny else shapes
    selected = [r for r in all_rows() if r.group == "baseline" or not args.only or r.group in args.only]
    available = []
    for r in selected:
        if r.requires and importlib.util.find_spec(r.requires) is None:
            print(f"  skipped {r.name}: {r.requires} not installed", file=sys.stderr)
            continue
        available.append(r)
    results = run_bench(shapes, available, args.warmup, args.repeats, args.device)
    print_table(results, shapes, args.device)
    if write:
        n = sum(torch.Size(s).numel() for s in shapes) / 1e6
        notes = [
            f"Medians of {args.repeats} rounds after {args.warmup} of warm-up, {n:.1f}M parameters;"
            f" AdamW's step took {results[0]['ms']:.1f} ms."
        ]
        write(args.write, *present(STEP_COLUMNS, step_rows(results)), notes, device=args.device)


if __name__ == "__main__":
    main()
