"""The warm-started refresh in training: Shampoo (``root_inverse``) and SOAP (``eigenbasis``) with
``"warm"`` against their default refresh, on the tiny Llama and the books of
``bench/convergence.py`` (its ``run_one``: the same model, data, schedule and held-out loss).

    .venv/bin/python bench/warm_refresh.py                 # Shampoo and SOAP, 2 seeds, ~6 minutes
    .venv/bin/python bench/warm_refresh.py --tolerances 0.01 0.05 --seeds 1

Each optimizer runs at its best rate of docs/convergence.md, with its recipe settings
(``recipes/train.py`` ``OURS``: refreshes every 10 steps), once with its default refresh and
once per ``--tolerances`` value with ``"warm"``, the same seeds for all. Printed per variant: the
final held-out loss of each seed, the seconds of its training steps (forward, backward and step:
only the refreshes differ between the variants), and what its warm refreshes did
(:class:`WarmTally`): factors that kept their eigenvectors, took QR steps, or were recomputed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench import convergence  # noqa: E402
from bench.record import Column, col, write_table  # noqa: E402
from dist_optim.kernels import matrix_functions  # noqa: E402

#: label -> (convergence label of the base optimizer, its best rate in docs/convergence.md, the
#: option that selects the refresh).
BASES = {"Shampoo": ("Shampoo", 0.0046, "root_inverse"), "SOAP": ("SOAP", 0.014, "eigenbasis")}


class WarmTally:
    """What the warm refreshes did while it is entered, counted at the two functions of
    :mod:`dist_optim.kernels.matrix_functions` they call (the bench's own count): a factor kept its
    eigenvectors where :func:`~dist_optim.kernels.matrix_functions.warm_criteria` decided so (the
    refresh then needs no more of it); every other factor goes to
    :func:`~dist_optim.kernels.matrix_functions.warm_eigh`, which took QR steps or recomputed it."""

    def __init__(self) -> None:
        self.kept = self.refined = self.recomputed = 0
        self._criteria = matrix_functions.warm_criteria
        self._eigh = matrix_functions.warm_eigh

    def __enter__(self) -> WarmTally:
        def criteria(*args: Any, **kwargs: Any) -> list[matrix_functions.WarmCriterion]:
            found = self._criteria(*args, **kwargs)
            self.kept += sum(c.keep for c in found)
            return found

        def eigh(*args: Any, **kwargs: Any) -> matrix_functions.WarmEigh:
            res = self._eigh(*args, **kwargs)
            if res.recomputed:
                self.recomputed += 1
            elif res.iterations:
                self.refined += 1
            return res  # a kept result was counted with its criterion

        matrix_functions.warm_criteria = criteria  # type: ignore[assignment]
        matrix_functions.warm_eigh = eigh  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        matrix_functions.warm_criteria = self._criteria  # type: ignore[assignment]
        matrix_functions.warm_eigh = self._eigh  # type: ignore[assignment]

    def __str__(self) -> str:
        return f"{self.kept} kept, {self.refined} refined by QR steps, {self.recomputed} recomputed"


#: The columns of the table ``--write NAME`` writes (``warm_refresh_training``).
COLUMNS: list[Column] = [
    col("optimizer", "optimizer"),
    col("refresh", "refresh"),
    col("loss", "held-out loss per seed", 4),
    col("kept", "factor refreshes kept", 0),
    col("refined", "refined by QR steps", 0),
    col("recomputed", "recomputed", 0),
    col("seconds", "seconds per run", 1),
]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=list(BASES), choices=list(BASES))
    ap.add_argument("--tolerances", type=float, nargs="*", default=[0.01])
    ap.add_argument("--iterations", type=int, default=0, help="refresh_iterations of the warm runs")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--write", metavar="NAME", help="also write the rows as bench/results/NAME.json (off by default)")
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    print("| optimizer | refresh | held-out loss per seed | seconds per seed | warm refreshes |")
    print("|---|---|---|---|---|")
    for base in args.only:
        label, lr, option = BASES[base]
        name, extra = convergence.OPTIMIZERS[label]
        variants: list[tuple[str, dict[str, Any]]] = [("default", dict(extra))]
        for tol in args.tolerances:
            warm = dict(extra, refresh_tolerance=tol, refresh_iterations=args.iterations)
            warm[option] = "warm"
            variants.append((f"warm, tolerance {tol}", warm))
        for refresh, options in variants:
            key = f"{label} ({refresh})"
            convergence.OPTIMIZERS[key] = (name, options)
            losses, seconds = [], []
            with WarmTally() as tally:
                for seed in range(args.seeds):
                    job = dict(
                        label=key,
                        lr=lr,
                        seed=seed,
                        steps=args.steps,
                        batch_size=16,
                        seq_len=128,
                        eval_every=args.steps,
                        eval_sequences=64,
                    )
                    curve = convergence.run_one(job)["curve"]
                    losses.append(curve[-1][2])
                    seconds.append(curve[-1][1])
            counts = str(tally) if refresh != "default" else ""
            row: dict[str, Any] = dict(optimizer=base, refresh=refresh, loss=losses, seconds=seconds)
            if refresh != "default":
                row.update(kept=tally.kept, refined=tally.refined, recomputed=tally.recomputed)
            rows.append(row)
            print(
                f"| {base} | {refresh} | {', '.join(f'{x:.4f}' for x in losses)} "
                f"| {', '.join(f'{s:.1f}' for s in seconds)} (mean {statistics.mean(seconds):.1f}) | {counts} |",
                flush=True,
            )
    if args.write:
        seeds = "seed 0" if args.seeds == 1 else f"seeds 0-{args.seeds - 1}"
        notes = [f"{args.steps} steps of the tiny Llama on the books, {seeds}, one process after another."]
        write_table(args.write, COLUMNS, rows, notes, script=__file__, argv=argv)


if __name__ == "__main__":
    main()
