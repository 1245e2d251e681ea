"""Train the same tiny Llama with several optimizers under one parallel layout; plot the loss curves.

    torchrun --nproc_per_node 4 recipes/compare_optimizers.py --tp 2 --zero 1 --steps 150 \\
        --out runs/compare/loss_curves.png
    torchrun --nproc_per_node 4 recipes/compare_optimizers.py --data my_text/ --steps 300   # your text

Every optimizer sees the same initial weights and the same batches (``--data``: .txt / .jsonl files
or directories, as ``recipes/train.py`` takes them, byte tokens unless ``--tokenizer``;
default: three public-domain books, ``recipes/corpus.py``). Ordinary optimizers are
swapped for ours by the booster (the legend says which class ran).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from dist_optim.registry import catalogue  # noqa: E402
from recipes import env, train  # noqa: E402

# Learning rates: each optimizer's best of bench/convergence.py's sweep (docs/convergence.md: 4 rates
# log-spaced over a decade per optimizer, 2 seeds, 300 steps of a tiny Llama on the same books),
# except AdamW's, LAMB's, SOAP's and Kron's: their best at the demo's own horizon and layout (120 steps,
# tp=2 x ZeRO-1; docs/convergence.md "At the demo's horizon"), where shorter runs favour higher rates
# and LAMB's 300-step best (1e-1) spikes and ends last. Ours come from the catalogue's demo rows.
DEFAULT = [("AdamW (torch, unchanged)", "torch.optim.AdamW", 4.6e-3)] + [
    (entry.demo.label, entry.demo.source or name, entry.demo.lr)
    for name, entry in catalogue().items()
    if entry.demo is not None
]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plugin", choices=["hybrid", "zero", "ddp"], default="hybrid")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--zero", type=int, default=1)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--only", nargs="*", help="optimizer names to run (default: all)")
    ap.add_argument("--out", default=os.path.join("runs", "compare", "loss_curves.png"))
    ap.add_argument("--data", nargs="+", default=None, help=".txt / .jsonl files or directories (the recipe's --data)")
    ap.add_argument("--tokenizer", default=None, help="a local Hugging Face tokenizer directory (default: bytes)")
    ap.add_argument("--data-cache", default=None, help="where tokenized data is cached (the recipe's default)")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps {args.steps}: at least 1")
    data: list[str] = []
    if args.data:
        from recipes import tokens

        try:
            tokens.expand_inputs(args.data)
        except ValueError as exc:
            ap.error(str(exc))
        data = ["--data", *args.data]
    data += ["--tokenizer", args.tokenizer] if args.tokenizer else []
    data += ["--data-cache", args.data_cache] if args.data_cache else []
    curves: dict[str, list[float]] = {}
    for label, name, lr in DEFAULT:
        if args.only and name not in args.only:
            continue
        train_args = train.parse_args(
            [
                "--plugin", args.plugin, "--tp", str(args.tp), "--zero", str(args.zero),
                "--optimizer", name, "--lr", str(lr), "--steps", str(args.steps), "--no-progress",
                "--warmup", str(max(1, args.steps // 10)), *data,
            ]
        )  # fmt: skip
        env.log(f"--- {label}")
        history = train.train(train_args)
        curves[label] = [h["loss"] for h in history]
    if env.is_main():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(os.path.splitext(args.out)[0] + ".csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["optimizer", "step", "loss"])
            for label, losses in curves.items():
                w.writerows([label, i + 1, f"{v:.6f}"] for i, v in enumerate(losses))
        plot(curves, args, args.out)
        print(f"loss curves: {args.out}")
    dist.barrier()


def plot(curves: dict[str, list[float]], args: argparse.Namespace, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=f"{label}: {losses[-1]:.3f}")
    ax.set_xlabel("step")
    unit = f"tokens of {args.tokenizer}" if args.tokenizer else "byte tokens"
    named = ", ".join(os.path.basename(os.path.normpath(d)) for d in args.data or [])
    text = named or "three public-domain books"
    ax.set_ylabel(f"training loss ({unit} of {text})")
    ax.set_title(f"tiny Llama, {args.plugin} plugin tp={args.tp} zero={args.zero}, {dist.get_world_size()} processes")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
