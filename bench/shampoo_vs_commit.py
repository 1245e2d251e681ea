"""DistributedShampoo's step against its own implementation at an earlier commit, in one process.

Meta's ``distributed_shampoo`` is not on PyPI, so it cannot be timed here. Up to commit 33f1ab7
our Shampoo did the operations Meta's does per block (``torch.tensordot`` Gram products for the
factor statistics, ``tensordot`` for preconditioning, out-of-place moment and grafting updates);
this script times that implementation and the current one side by side, with AdamW as the common
baseline, on the Llama-like set (blocks of 1024, Adam grafting)::

    python bench/shampoo_vs_commit.py                 # against 33f1ab7
    python bench/shampoo_vs_commit.py --commit HEAD~3 --repeats 9

Two kinds of step are timed: "before start" (before ``start_preconditioning_step``: factor
statistics and grafting only; the median step of a 10-step run at ``precondition_frequency=10``
with Meta's default start) and "preconditioned" (after the first root refresh, between refreshes).
The earlier package is extracted with ``git archive`` under the name ``old_dist_optim``.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench_step import fixed_params, llama_like  # noqa: E402


def _extract(commit: str, into: Path) -> Any:
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "dist_optim"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "dist_optim").rename(into / "old_dist_optim")
    sys.path.insert(0, str(into))
    return importlib.import_module("old_dist_optim")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--commit", default="33f1ab7")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    import dist_optim

    with tempfile.TemporaryDirectory() as tmp:
        old = _extract(args.commit, Path(tmp))
        shapes = llama_like()
        params = fixed_params(shapes)

        def shampoo(mod: Any, start: int) -> torch.optim.Optimizer:
            graft = mod.AdamGraftingConfig(beta2=0.999, epsilon=1e-8)
            return mod.DistributedShampoo(
                params(),
                lr=1e-3,
                max_preconditioner_dim=1024,
                precondition_frequency=10_000,
                start_preconditioning_step=start,
                grafting_config=graft,
            )

        runs: dict[str, torch.optim.Optimizer] = {"torch AdamW (foreach)": torch.optim.AdamW(params(), foreach=True)}
        for label, mod in ((f"Shampoo at {args.commit}", old), ("Shampoo now", dist_optim)):
            runs[f"{label}, before start"] = shampoo(mod, 10_000)
            pre = shampoo(mod, 1)
            pre.step()  # the first root refresh
            runs[f"{label}, preconditioned"] = pre
        times: dict[str, list[float]] = {k: [] for k in runs}
        for i in range(args.repeats + 1):
            for name, opt in runs.items():  # round-robin, as bench_step.py
                t0 = time.perf_counter()
                opt.step()
                if i:
                    times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    adamw = med["torch AdamW (foreach)"]
    print(f"\n{sum(torch.Size(s).numel() for s in shapes) / 1e6:.1f}M params, {torch.get_num_threads()} threads")
    print("| step | median (ms) | / AdamW | now / earlier |")
    print("|---|---:|---:|---:|")
    for name, m in med.items():
        ratio = ""
        if name.startswith("Shampoo now"):
            phase = name.split(", ")[1]
            ratio = f"{m / med[f'Shampoo at {args.commit}, {phase}']:.2f}x"
        print(f"| {name} | {1e3 * m:.0f} | {m / adamw:.2f}x | {ratio} |")


if __name__ == "__main__":
    main()
