"""Peak resident memory per rank of recipes/train.py, with and without lazy initialisation.

    python bench/recipe_memory.py                   # the 1b preset, tp=2 x ZeRO-1 on 4 CPU processes
    python bench/recipe_memory.py --layers 6        # the 1b shape cut to 6 decoder layers
    python bench/recipe_memory.py --only-lazy --ready-only   # 1b, lazy, built and loaded, no step

Launches the recipe twice with torchrun (``--no-lazy`` the second time) for one optimizer step and
prints, per rank, the peak resident memory once the booster has built (and sharded) the model and
after the step, against the full model's fp32 size. Eager initialisation builds the whole fp32 model
on every rank before the booster shards it, so it needs about 4 x the fp32 size of host memory:
~18 GiB for the 1b preset, more than a shared 24 GiB machine has free; ``--layers`` keeps the 1b
widths (hidden 2048, 32000 vocabulary) with fewer layers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def run(model: str, lazy: bool, nproc: int, steps: int) -> dict[str, list[float] | float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    cmd += ["recipes/train.py", "--model", model, "--tp", "2", "--zero", "1", "--steps", str(steps)]
    cmd += ["--synthetic", "--batch-size", "1", "--seq-len", "64", "--no-progress", "--log-every", "1"]
    cmd += ["--optimizer", "colossalai.nn.optimizer.Lamb"] + ([] if lazy else ["--no-lazy"])
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    text = out.stdout + out.stderr
    if out.returncode != 0:
        raise SystemExit(text[-3000:])

    def ranks(pattern: str) -> list[float]:
        found = re.search(pattern + r" \(GiB\) \[([^\]]*)\]", text)
        if found is None:
            raise SystemExit(f"no {pattern!r} line in the recipe's output:\n{text[-3000:]}")
        return [float(v) for v in found.group(1).split(",")]

    full = float(re.search(r"full model in fp32: ([\d.]+) GiB", text).group(1))
    result: dict[str, list[float] | float] = {"fp32_gib": full, "ready": ranks("model ready: peak memory per rank")}
    if steps:
        result["step"] = ranks("step 1: .*peak memory per rank")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's 22)")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--only-lazy", action="store_true", help="skip the eager run (when it cannot fit)")
    ap.add_argument("--ready-only", action="store_true", help="build and load the model, take no optimizer step")
    args = ap.parse_args()
    from recipes.building import model_config

    model = "1b"
    with tempfile.TemporaryDirectory() as tmp:
        if args.layers is not None:
            config, _ = model_config("1b")
            config.num_hidden_layers = args.layers
            config.save_pretrained(tmp)
            model = tmp
        label = "1b" if args.layers is None else f"1b widths, {args.layers} layers"
        for lazy in (True, False) if not args.only_lazy else (True,):
            r = run(model, lazy, args.nproc, 0 if args.ready_only else 1)
            print(json.dumps({"model": label, "lazy": lazy, "tp": 2, "zero": 1, "nproc": args.nproc, **r}), flush=True)


if __name__ == "__main__":
    main()
