"""The convergence sweep of ``bench/convergence.py`` for the reference packages of the optimizers
of ours that end above AdamW there: is it the algorithm at this scale, or our code?

    .venv/bin/python bench/convergence_references.py             # 4 references x 4 rates x 2 seeds, ~20 min
    .venv/bin/python bench/convergence_references.py --only came --rates 2 --seeds 1 --steps 40

Each reference runs with the options our recipe gives ours (``recipes/train.py`` ``OURS``, which
our unit tests equal to these packages step by step) over the same learning-rate range, seeds, data
and schedule as ours in docs/convergence.md: ColossalAI's ``Lamb`` (``weight_decay=0.01``,
``bias_correction=True``) for LAMB, transformers' ``Adafactor`` (``relative_step=False,
scale_parameter=False``), came_pytorch's ``CAME``, and galore_torch's ``GaLoreAdamW`` on the same
parameter groups as ours (``dist_optim.galore_param_groups(model, rank=8, update_proj_gap=50)``).
Printed: ``bench/convergence.py``'s table for the references, with ours beside them when
``--ours`` gives a ``results.json`` of the same settings (default: ``runs/convergence/results.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench import convergence  # noqa: E402

#: reference label -> (the label of ours it stands beside, import path, options).
REFERENCES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "LAMB (colossalai)": ("LAMB", "colossalai.nn.optimizer.Lamb", dict(weight_decay=0.01, bias_correction=True)),
    "Adafactor (transformers)": (
        "Adafactor",
        "transformers.optimization.Adafactor",
        dict(relative_step=False, scale_parameter=False),
    ),
    "CAME (came_pytorch)": ("CAME", "came_pytorch.CAME", {}),
    "GaLore (galore_torch)": ("GaLore", "galore_torch.GaLoreAdamW", {}),
}


def _galore_torch(model: Any, lr: float) -> Any:
    from galore_torch import GaLoreAdamW

    from dist_optim import galore_param_groups

    return GaLoreAdamW(galore_param_groups(model, rank=8, update_proj_gap=50), lr=lr)


def register() -> None:
    """The references as labels of ``bench/convergence.py`` (before its workers fork)."""
    for label, (ours, path, options) in REFERENCES.items():
        convergence.OPTIMIZERS[label] = (path, options)
        convergence.RANGES[label] = convergence.RANGES[ours]
    convergence.BUILDERS["GaLore (galore_torch)"] = _galore_torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    aliases = {label.split(" ")[0].lower(): label for label in REFERENCES}
    ap.add_argument("--only", nargs="*", default=None, help="references (default: all): " + ", ".join(aliases))
    ap.add_argument("--rates", type=int, default=4)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--ours", default=os.path.join(ROOT, "runs", "convergence", "results.json"))
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "convergence", "references.json"))
    args = ap.parse_args()
    labels = list(REFERENCES)
    if args.only:
        unknown = [o for o in args.only if o.lower() not in aliases]
        if unknown:
            ap.error(f"--only {' '.join(unknown)}: not among {', '.join(aliases)}")
        labels = [aliases[o.lower()] for o in args.only]
    register()
    common = dict(steps=args.steps, batch_size=16, seq_len=128, eval_every=25, eval_sequences=64)
    jobs = [
        {"label": label, "lr": lr, "seed": seed, **common}
        for label in labels
        for lr in convergence.rates(label, args.rates)
        for seed in range(args.seeds)
    ]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(args.workers) as pool:
        results = []
        for done, r in enumerate(pool.map(convergence.run_one, jobs), 1):
            results.append(r)
            print(
                f"[{done}/{len(jobs)}] {r['label']} lr {r['lr']:.2g} seed {r['seed']}: {r['curve'][-1][2]:.4f}",
                flush=True,
            )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "results": results}, f)
    print(f"\n{len(jobs)} runs in {time.perf_counter() - t0:.0f} s; results: {args.out}\n")
    ours: list[dict[str, Any]] = []
    if os.path.exists(args.ours):
        with open(args.ours) as f:
            earlier = json.load(f)
        same = all(earlier["args"].get(k) == v for k, v in (("steps", args.steps), ("seeds", args.seeds)))
        keep = {REFERENCES[label][0] for label in labels} | {"AdamW"}
        ours = [r for r in earlier["results"] if r["label"] in keep] if same else []
    order = ["AdamW"] + [x for label in labels for x in (REFERENCES[label][0], label)]
    summary = convergence.summarise(sorted(ours + results, key=lambda r: order.index(r["label"])))
    print(
        convergence.table(summary)
        if "AdamW" in summary
        else "\n".join(f"{k}: {v['final']:.4f}" for k, v in summary.items())
    )


if __name__ == "__main__":
    main()
