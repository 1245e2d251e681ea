"""Compressed optimizer states in training: each optimizer with its compact
states against itself in full precision, on the tiny Llama and the books of ``bench/convergence.py``
(its ``run_one``: the same model, data, schedule and held-out loss).

    .venv/bin/python bench/compact_quality.py                  # 12 rows, 2 seeds each
    .venv/bin/python bench/compact_quality.py --only shampoo --seeds 1 --steps 60
    .venv/bin/python bench/compact_quality.py --only "shampoo 4-bit" "soap 4-bit" --plot docs/compact_quality_bits.png

Each optimizer runs at its best rate of docs/convergence.md with its recipe settings, once as it is
and once with :data:`COMPACT`'s options (bitsandbytes' ``optim_bits=8`` for its moment-like states,
at the default ``min_8bit_size`` of 4096 elements: the tiny Llama's matrices, not its norms; Shampoo
and SOAP also with ``use_symmetric_packing``, which changes nothing bit for bit), the same seeds for
both. The rows named ``<optimizer> <n>-bit`` are the same optimizer with its eigenvectors (Kron:
its triangular factors) quantised too (``preconditioner_bits``), against the same full-precision
runs (``--plot`` another file when running only some rows: the default one holds all). Printed: a markdown table of the
final held-out loss of each seed, their mean, and the compact form's mean relative to the
full-precision one's; plotted (``--plot``, default ``docs/compact_quality.png``): both forms' mean
held-out curves, one panel per row.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench import convergence  # noqa: E402
from bench.record import Column, col, write_table  # noqa: E402

#: row -> (its best rate in docs/convergence.md, the options of its compact form); the row's
#: optimizer is the convergence label before its first space.
COMPACT: dict[str, tuple[float, dict[str, Any]]] = {
    "LAMB": (0.1, dict(optim_bits=8)),
    "CAME": (0.00022, dict(optim_bits=8)),
    "Shampoo": (0.0046, dict(optim_bits=8, use_symmetric_packing=True)),
    "SOAP": (0.014, dict(optim_bits=8, use_symmetric_packing=True)),
    "Shampoo 8-bit": (0.0046, dict(optim_bits=8, use_symmetric_packing=True, preconditioner_bits=8)),
    "Shampoo 4-bit": (0.0046, dict(optim_bits=8, use_symmetric_packing=True, preconditioner_bits=4)),
    "SOAP 8-bit": (0.014, dict(optim_bits=8, use_symmetric_packing=True, preconditioner_bits=8)),
    "SOAP 4-bit": (0.014, dict(optim_bits=8, use_symmetric_packing=True, preconditioner_bits=4)),
    "Kron": (0.003, dict(optim_bits=8)),
    "Kron 8-bit": (0.003, dict(optim_bits=8, use_symmetric_packing=True, preconditioner_bits=8)),
    "GaLore": (0.03, dict(optim_bits=8)),
    "Muon": (0.014, dict(optim_bits=8)),
}
ALIASES = {label.lower(): label for label in COMPACT}


#: The columns of the table ``--write NAME`` writes (``compact_quality``): final held-out losses.
COLUMNS: list[Column] = [
    col("optimizer", "optimizer"),
    col("options", "compact options"),
    col("full", "full precision, per seed", 4),
    col("full_mean", "mean", 4),
    col("compact", "compact, per seed", 4),
    col("compact_mean", "mean", 4),
    col("ratio", "compact / full", 4),
]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, help="optimizers (default: all): " + ", ".join(ALIASES))
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--workers", type=int, default=2, help="processes of one thread each")
    ap.add_argument("--plot", default=os.path.join(ROOT, "docs", "compact_quality.png"), help="'' for none")
    ap.add_argument("--write", metavar="NAME", help="also write the rows as bench/results/NAME.json (off by default)")
    args = ap.parse_args(argv)
    from recipes import corpus

    if not corpus.installed():
        raise SystemExit(corpus.missing_message())
    labels = list(COMPACT)
    if args.only:
        unknown = [o for o in args.only if o.lower() not in ALIASES]
        if unknown:
            ap.error(f"--only {' '.join(unknown)}: not among {', '.join(ALIASES)}")
        labels = [ALIASES[o.lower()] for o in args.only]
    if args.seeds < 1 or args.steps < 1 or args.workers < 1:
        ap.error("--seeds, --steps and --workers: at least 1")
    jobs = []
    for label in labels:
        lr, options = COMPACT[label]
        base = label.split(" ")[0]
        name, extra = convergence.OPTIMIZERS[base]
        # Registered before the workers fork, so that run_one finds the compact label.
        convergence.OPTIMIZERS[f"{label} (compact)"] = (name, {**extra, **options})
        for form in (base, f"{label} (compact)"):
            for seed in range(args.seeds):
                job = dict(label=form, lr=lr, seed=seed, steps=args.steps, batch_size=16, seq_len=128)
                job = dict(job, eval_every=args.eval_every, eval_sequences=64)
                if job not in jobs:  # a full-precision run shared by its optimizer's rows
                    jobs.append(job)
    with ProcessPoolExecutor(args.workers) as pool:
        results = list(pool.map(convergence.run_one, jobs))
    print(
        "| optimizer | compact options | full precision, per seed (mean) | compact, per seed (mean) | compact / full |"
    )
    print("|---|---|---|---|---:|")
    curves: dict[str, dict[str, list[tuple[int, float, float]]]] = {}
    rows = []
    for label in labels:
        means = []
        cells = []
        per_seed = []
        for form in (label.split(" ")[0], f"{label} (compact)"):
            runs = [r for r in results if r["label"] == form]
            finals = [r["curve"][-1][2] for r in runs]
            means.append(statistics.mean(finals))
            per_seed.append(finals)
            cells.append(f"{', '.join(f'{x:.4f}' for x in finals)} ({means[-1]:.4f})")
            n = min(len(r["curve"]) for r in runs)
            mean_curve = [
                (runs[0]["curve"][i][0], 0.0, statistics.mean(r["curve"][i][2] for r in runs)) for i in range(n)
            ]
            curves.setdefault(label, {})[form] = mean_curve
        options = ", ".join(f"{k}={v}" for k, v in COMPACT[label][1].items())
        print(f"| {label} | {options} | {cells[0]} | {cells[1]} | {means[1] / means[0]:.4f} |", flush=True)
        rows.append(
            dict(
                optimizer=label,
                options=options,
                full=per_seed[0],
                full_mean=means[0],
                compact=per_seed[1],
                compact_mean=means[1],
                ratio=means[1] / means[0],
            )
        )
    if args.write:
        seeds = "seed 0" if args.seeds == 1 else f"seeds 0-{args.seeds - 1}"
        notes = [f"{args.steps} steps of the tiny Llama on the books, {seeds}, final held-out loss."]
        write_table(args.write, COLUMNS, rows, notes, script=__file__, argv=argv)
    if args.plot:
        print(f"plot: {_plot(curves, args.plot, args.seeds, args.steps)}")


def _plot(curves: dict[str, dict[str, list[tuple[int, float, float]]]], path: str, seeds: int, steps: int) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(4, len(curves))
    rows = -(-len(curves) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 2.8 * rows), squeeze=False)
    for ax, (label, forms) in zip(axes.flat, curves.items()):
        for form, curve in forms.items():
            ax.plot([p[0] for p in curve[1:]], [p[2] for p in curve[1:]], label=form)
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(curves) :]:
        ax.axis("off")
    fig.suptitle(f"held-out loss, full precision vs compact states (mean of {seeds} seeds, {steps} steps)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
