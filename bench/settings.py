"""The evidence behind the recommended settings: each optimizer at its best rate of
docs/convergence.md, as the recipe configures it, against the same with one setting changed.

    .venv/bin/python bench/settings.py                       # every row, 2 seeds: about 30 min on 2 cores
    .venv/bin/python bench/settings.py --only "kron" --seeds 1 --steps 60   # rows whose label starts so

The runs are :func:`bench.convergence.run_one`'s (the tiny Llama on the books, 16 x 128 tokens a
step, warmup then cosine decay to a tenth, clipping at norm 1, held-out loss every 25 steps), with
one addition: ``warmup`` (a fraction of the steps; the recipe's and the sweep's is 0.1). The rows
(:data:`ROWS`): precondition frequency 5, 10 (the recipe's) and 20 for Shampoo and SOAP, the first
roots at that step; Shampoo without grafting at the constructor's epsilon of 1e-12 (the diverging
configuration the docs name); Kron's preconditioner updated every step (the default schedule's
first 500 steps, so every step of a 300-step run), with probability 0.1, and with the default
schedule's shape squeezed into the run (flat for 50 steps, then decaying ten times as fast: about
0.2 at step 200 and 0.1 at step 280); Muon with the update RMS matched to AdamW's (the recipe's)
and with torch's original adjustment at the same rate; and each of AdamW, Shampoo, SOAP, Kron and
Muon without warmup.

Printed: a markdown table, per row, of each seed's final held-out loss, their mean, the mean's
difference from its optimizer's recipe row, and the summed step seconds (forward, backward,
optimizer) relative to the recipe row (both rows' runs share the 2 cores as ``--workers``
processes of one thread each: read it as a rough ratio; ``bench/bench_step.py`` times steps).
``nan`` is a run that diverged (its loss went non-finite). ``--json`` writes every run's curves.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench import convergence  # noqa: E402

#: Best rates of docs/convergence.md's sweep (the table's two-digit roundings).
RATES = {"AdamW": 0.0022, "Shampoo": 0.0046, "SOAP": 0.014, "Kron": 0.003, "Muon": 0.014}


def _squeezed_schedule() -> Any:
    from dist_optim.kron import ProbabilitySchedule

    return ProbabilitySchedule(flat_start=50.0, decay=0.01)


#: label -> (optimizer of bench/convergence.py, its options over the recipe's, warmup fraction).
#: The first row of each optimizer is its recipe configuration, the reference of the others.
ROWS: dict[str, tuple[str, dict[str, Any], float]] = {
    "AdamW": ("AdamW", {}, 0.1),
    "AdamW, no warmup": ("AdamW", {}, 0.0),
    "Shampoo (pf=10)": ("Shampoo", {}, 0.1),
    "Shampoo pf=5": ("Shampoo", dict(precondition_frequency=5, start_preconditioning_step=5), 0.1),
    "Shampoo pf=20": ("Shampoo", dict(precondition_frequency=20, start_preconditioning_step=20), 0.1),
    "Shampoo, no grafting, epsilon 1e-12": ("Shampoo", dict(grafting_config=None), 0.1),
    "Shampoo, no warmup": ("Shampoo", {}, 0.0),
    "SOAP (pf=10)": ("SOAP", {}, 0.1),
    "SOAP pf=5": ("SOAP", dict(precondition_frequency=5, start_preconditioning_step=5), 0.1),
    "SOAP pf=20": ("SOAP", dict(precondition_frequency=20, start_preconditioning_step=20), 0.1),
    "SOAP, no warmup": ("SOAP", {}, 0.0),
    "Kron (every step)": ("Kron", {}, 0.1),
    "Kron p=0.1": ("Kron", dict(preconditioner_update_probability=0.1), 0.1),
    "Kron, schedule squeezed": ("Kron", dict(preconditioner_update_probability=_squeezed_schedule), 0.1),
    "Kron, no warmup": ("Kron", {}, 0.0),
    "Muon (match_rms_adamw)": ("Muon", {}, 0.1),
    "Muon, original adjustment": ("Muon", dict(adjust_lr_fn="original"), 0.1),
    "Muon, no warmup": ("Muon", {}, 0.0),
}


def _job(label: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    base, _, warmup = ROWS[label]
    return dict(
        label=label,
        lr=RATES[base],
        seed=seed,
        steps=args.steps,
        warmup=warmup,
        batch_size=16,
        seq_len=128,
        eval_every=25,
        eval_sequences=64,
    )


def _register() -> None:
    """Make every row a label run_one can build (in each worker process too)."""
    for label, (base, options, _) in ROWS.items():
        name, extra = convergence.OPTIMIZERS[base]
        # A schedule object is made in the worker (run_one builds the optimizer there).
        made = {k: (v() if callable(v) else v) for k, v in options.items()}
        convergence.OPTIMIZERS[label] = (name, {**extra, **made})


def _run(job: dict[str, Any]) -> dict[str, Any]:
    _register()
    return convergence.run_one(job)


def _reference(label: str) -> str:
    base = ROWS[label][0]
    return next(row for row, spec in ROWS.items() if spec[0] == base)


def table(results: list[dict[str, Any]], rows: list[str]) -> str:
    final: dict[str, list[float]] = {}
    seconds: dict[str, float] = {}
    for r in results:
        loss = r["curve"][-1][2]
        final.setdefault(r["label"], []).append(loss)
        seconds[r["label"]] = seconds.get(r["label"], 0.0) + r["curve"][-1][1]
    lines = [
        "| setting | final held-out loss per seed | mean | vs recipe row | step seconds vs recipe row |",
        "|---|---:|---:|---:|---:|",
    ]
    for label in rows:
        losses = final[label]
        mean = statistics.mean(losses) if all(math.isfinite(x) for x in losses) else float("nan")
        ref = _reference(label)
        ref_mean = statistics.mean(final[ref]) if ref in final else float("nan")
        delta = "" if label == ref else f"{mean - ref_mean:+.4f}"
        ratio = "" if label == ref or ref not in seconds else f"{seconds[label] / seconds[ref]:.2f}x"
        per_seed = ", ".join(f"{x:.4f}" for x in losses)
        lines.append(f"| {label} | {per_seed} | {mean:.4f} | {delta} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, help="rows whose label starts with any of these (any case)")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", default=None, help="write every run's curves to this file")
    args = ap.parse_args(argv)
    rows = [r for r in ROWS if args.only is None or any(r.lower().startswith(o.lower()) for o in args.only)]
    if not rows:
        raise SystemExit(f"--only {args.only}: no row starts with these; rows: {list(ROWS)}")
    # Each optimizer's recipe row, for the differences.
    rows = sorted({*rows, *map(_reference, rows)}, key=list(ROWS).index)
    jobs = [_job(label, seed, args) for label in rows for seed in range(args.seeds)]
    with ProcessPoolExecutor(args.workers) as pool:
        results = list(pool.map(_run, jobs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)
    print(f"{args.steps} steps, {args.seeds} seeds, rates {RATES}")
    print(table(results, rows))


if __name__ == "__main__":
    main()
