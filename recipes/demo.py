"""The README's first command (``make demo``): train a tiny Llama on 4 processes, then compare optimizers.

1. ``recipes/train.py`` on 4 processes with HybridParallelPlugin tp=2 x ZeRO-1 (bf16), an ordinary
   ``colossalai.nn.optimizer.Lamb`` that the booster swaps for ``dist_optim.DistributedLamb``,
   a few hundred steps on byte tokens of three public-domain books (``recipes/corpus.py``, installed
   by ``make setup``), the held-out loss every 100 steps; prints the swap, a progress bar and the
   final loss.
2. ``compare_optimizers.py``: the same model and layout with each of our optimizers; writes
   ``runs/demo/loss_curves.png``.

CPU processes with gloo when there is no GPU (this machine); NCCL on GPUs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(script: str, args: list[str], nproc: int) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), script, *args]
    print("$ " + " ".join(cmd), flush=True)
    env = dict(os.environ, PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--compare-steps", type=int, default=120)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--out", default=os.path.join("runs", "demo"))
    args = ap.parse_args()
    out = os.path.join(ROOT, args.out)
    os.makedirs(out, exist_ok=True)
    torchrun(
        "recipes/train.py",
        [
            "--plugin", "hybrid", "--tp", "2", "--zero", "1", "--precision", "bf16",
            "--optimizer", "colossalai.nn.optimizer.Lamb", "--lr", "1e-2", "--steps", str(args.steps),
            "--eval-every", "100", "--log-csv", os.path.join(out, "train.csv"),
        ],
        args.nproc,
    )  # fmt: skip
    torchrun(
        "recipes/compare_optimizers.py",
        ["--tp", "2", "--zero", "1", "--steps", str(args.compare_steps), "--out", os.path.join(out, "loss_curves.png")],
        args.nproc,
    )
    log, png = os.path.join(args.out, "train.csv"), os.path.join(args.out, "loss_curves.png")
    print(f"\ndone: training log {log}, loss curves {png}")


if __name__ == "__main__":
    main()
