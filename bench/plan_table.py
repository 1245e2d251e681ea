"""The Llama-scale table of docs/planner.md (its first rows in the README): ``dist_optim.plan`` for
Llama-2-7B on 8 GPUs (tp=8; tp=2 x
ZeRO-1 x dp=4) and Llama-2-70B on 64 and 512 GPUs (tp=8 x ZeRO-1 x dp=8 / dp=64), bf16, every
optimizer with its defaults, on the simulated CUDA path.

    python bench/plan_table.py                                  # every row
    python bench/plan_table.py --configs 2 3 --skip shampoo     # the 70B rows without Shampoo

One row per plan, as ``python -m dist_optim.plan --compare-optimizers`` prints them (state GB per rank of the
busiest rank vs the ideal, the peak transient, GB sent per step, steady and at a refresh), with
the model, the GB left on a GPU of ``--gpu-gib`` (default 80 GiB = 85.9 GB) before activations, the
activation peak of one micro-batch (default 1 x 4096 tokens, every layer checkpointed, as a 70B run
at 4096 tokens needs), the step's peak with it, the GB left after the verdict's 10% allocator
margin and whether it fits (what ``python -m dist_optim.plan ... --gpu-memory 80GiB
--grad-checkpoint`` prints), and the seconds the plan took on this machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", type=int, nargs="*", help="indices into the four configurations (default: all)")
    ap.add_argument("--skip", nargs="*", default=[], help="optimizers to leave out")
    ap.add_argument("--gpu-gib", type=float, default=80, help="GPU memory in GiB for the 'GB left' columns")
    ap.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence of the micro-batch")
    ap.add_argument("--batch-size", type=int, default=1, help="sequences per micro-batch")
    ap.add_argument("--no-grad-checkpoint", action="store_true", help="keep every layer's activations")
    a = ap.parse_args()
    from dist_optim.plan import GB, Layout, Workload, format_sweep, load_config, make_plan, stage_activations
    from dist_optim.plan.simulate import OPTIMIZERS

    configs = [
        ("llama-7b", Layout("hybrid", tp=8, zero=0, dp=1, precision="bf16")),
        ("llama-7b", Layout("hybrid", tp=2, zero=1, dp=4, precision="bf16")),
        ("llama-70b", Layout("hybrid", tp=8, zero=1, dp=8, precision="bf16")),
        ("llama-70b", Layout("hybrid", tp=8, zero=1, dp=64, precision="bf16")),
    ]
    gpu = int(a.gpu_gib * 2**30)
    work = Workload(a.seq_len, a.batch_size, not a.no_grad_checkpoint, "sdpa")
    head = format_sweep([]).splitlines()[0].replace("| optimizer |", "| model | optimizer |")
    print(f"micro-batch: {work.describe()}; GPU {gpu / GB:.1f} GB, verdict after a 10% allocator margin")
    print(
        head + f" GB left of {gpu / GB:.1f} before activations | activation peak GB | peak GB | "
        "GB left with activations | fits | seconds |"
    )
    print("|" + "---|" * 17)
    chosen = [configs[i] for i in a.configs] if a.configs else configs
    for model, layout in chosen:
        acts = stage_activations(load_config(model), layout, work)
        for name in (n for n in OPTIMIZERS if n not in a.skip):
            t0 = time.perf_counter()
            plan = make_plan(model, layout, name, {}, gpu_memory=gpu, workload=work, activations=acts)
            row = format_sweep([plan]).splitlines()[-1]
            before = (gpu - plan.busiest.total) / GB
            act = plan.activations.schedule_peak if plan.activations else 0
            left = ((plan.usable or 0) - plan.total) / GB
            print(
                f"| {model} {row} {before:.2f} | {act / GB:.2f} | {plan.total / GB:.2f} | {left:.2f} | "
                f"{'yes' if left >= 0 else 'no'} | {time.perf_counter() - t0:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
