"""Tuned convergence on real text: every optimizer over a learning-rate sweep and seeds.

    .venv/bin/python bench/convergence.py                      # the full sweep, ~30 min on 2 cores
    .venv/bin/python bench/convergence.py --only adamw soap --rates 2 --seeds 1 --steps 40   # a quick look

A tiny Llama (byte tokens, hidden 128, 2 layers, 4 heads: 0.4M parameters) trains on the books of
``recipes/corpus.py`` (installed by ``make setup``), ``--steps`` steps of ``--batch-size`` x
``--seq-len`` tokens, the learning rate warmed up linearly over the first 10% of the steps and then
cosine-decayed to a tenth (the recipe's schedule, ``recipes.building.lr_lambda``), gradients clipped to
norm 1; the held-out loss (the books' held-out part, the same ``--eval-sequences`` every time) is
measured every ``--eval-every`` steps. Each optimizer runs at ``--rates`` learning rates log-spaced
over its range in :data:`RANGES` and ``--seeds`` seeds (the seed draws the initial weights and the
order of the batches; every optimizer sees the same ones per seed). Runs share the 2 cores as
``--workers`` processes of one thread each.

The optimizers are single-device (ours unbound, which the parity tests equal to every distributed
layout), built as ``recipes/train.py`` builds them (:data:`OPTIMIZERS`: the recipe's name and
extra options).

``--reuse results.json`` keeps an earlier sweep's runs of the optimizers not run again (the same
settings), e.g. after changing one optimizer's options. Written: ``runs/convergence/results.json``
(every run's curves), and, with ``--plots DIR``
(default ``docs``), ``convergence_steps.png`` and ``convergence_seconds.png``: each optimizer at its
best rate (mean over seeds). Printed: a markdown table of each optimizer's best rate, its final
held-out loss (mean over seeds, and the seeds' spread), and the steps it needs to reach AdamW's
best final held-out loss (the mean curve's first evaluation at or below it) with their ratio to
AdamW's steps (``-`` where it never does).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

#: QK-clip's bound for this model: below the largest logits Muon reaches in 300 steps here, so
#: that the clip acts: they pass 20 by step 100 at the best rate (Kimi K2's 100 is for logits
#: that grow over trillions of tokens).
QK_CLIP_TAU = 15.0

#: label -> (the recipe's optimizer name, extra constructor options).
OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "AdamW": ("torch.optim.AdamW", dict(betas=(0.9, 0.95), weight_decay=0.1)),
    "LAMB": ("lamb", {}),
    "Adafactor": ("adafactor", {}),
    "CAME": ("came", {}),
    "Shampoo": ("shampoo", {}),
    "SOAP": ("soap", {}),
    "Kron": ("kron", {}),
    "GaLore": ("galore", {}),
    "Muon": ("muon", {}),
    "KL-Shampoo": ("shampoo", dict(kl_statistics=True)),
    "KL-SOAP": ("soap", dict(kl_statistics=True)),
    "Muon per-head": ("muon", dict(per_head=True)),
    "NorMuon": ("normuon", {}),
    "Muon QK-clip": ("muon", dict(qk_clip_tau=QK_CLIP_TAU)),
}
#: label -> (lowest, highest) learning rate of the sweep: a decade each, placed (after a first
#: sweep over 1e-3..1e-2 (LAMB 3e-3..3e-2, CAME 3e-4..3e-3, Kron 1e-4..1e-3) so that the best rate
#: is not at an end.
RANGES: dict[str, tuple[float, float]] = {
    "AdamW": (1e-3, 1e-2),
    "LAMB": (1e-2, 1e-1),
    "Adafactor": (1e-3, 1e-2),
    "CAME": (1e-4, 1e-3),
    "Shampoo": (1e-3, 1e-2),
    "SOAP": (3e-3, 3e-2),
    "Kron": (3e-4, 3e-3),
    "GaLore": (3e-3, 3e-2),
    "Muon": (3e-3, 3e-2),
    "KL-Shampoo": (1e-3, 1e-2),
    "KL-SOAP": (3e-3, 3e-2),
    "Muon per-head": (3e-3, 3e-2),
    "NorMuon": (3e-3, 3e-2),
    "Muon QK-clip": (6.5e-3, 6.5e-2),
}
ALIASES = {label.lower(): label for label in OPTIMIZERS}
#: label -> a function (model, lr) -> optimizer, for the labels that the recipe's build_optimizer
#: cannot build (bench/convergence_references.py: galore_torch's GaLoreAdamW on our GaLore groups).
BUILDERS: dict[str, Any] = {}


def rates(label: str, count: int) -> list[float]:
    low, high = RANGES[label]
    if count == 1:
        return [math.sqrt(low * high)]
    return [low * (high / low) ** (i / (count - 1)) for i in range(count)]


def run_one(job: dict[str, Any]) -> dict[str, Any]:
    """One training run (in a worker process of one thread): its curves."""
    import numpy as np
    import torch

    from dist_optim.plan.models import llama_config
    from recipes import corpus, tokens
    from recipes import train as recipe

    torch.set_num_threads(1)
    torch.manual_seed(job["seed"])
    config = llama_config(128, 344, 2, 4, 4, 256)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    name, extra = OPTIMIZERS[job["label"]]
    builder = BUILDERS.get(job["label"])
    opt = builder(model, job["lr"]) if builder else recipe.build_optimizer(name, model, job["lr"], extra)
    if getattr(opt, "qk_clip_tau", None) is not None:
        from dist_optim import watch_attention_logits

        watch_attention_logits(model, opt)  # what the plugins do at boost
    steps = job["steps"]
    # ``warmup``: a fraction of the steps (bench/settings.py); the sweep's is a tenth.
    warmup = max(1, steps // 10) if "warmup" not in job else int(steps * job["warmup"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, recipe.lr_lambda(warmup, steps))
    train = tokens.byte_tokens([corpus.TRAIN])
    held = tokens.byte_tokens([corpus.HELDOUT])
    data = tokens.PackedData(train, job["seq_len"], job["batch_size"], 1, 0, job["seed"], eval_tokens=held)
    evals = torch.cat(list(data.eval_batches(job["eval_sequences"])))

    def held_out() -> float:
        model.eval()
        with torch.no_grad():
            losses = [float(model(input_ids=x, labels=x).loss) for x in evals.split(32)]
        model.train()
        return float(np.mean(losses))

    curve: list[tuple[int, float, float]] = [(0, 0.0, held_out())]
    train_loss: list[float] = []
    seconds = 0.0
    for step in range(steps):
        x = data.train_batch(step)
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        seconds += time.perf_counter() - t0
        value = float(loss)
        train_loss.append(value if math.isfinite(value) else float("nan"))
        if (step + 1) % job["eval_every"] == 0 or step + 1 == steps:
            curve.append((step + 1, seconds, held_out() if math.isfinite(value) else float("nan")))
        if not math.isfinite(value):
            break
    return {**job, "curve": curve, "train_loss": train_loss}


def summarise(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per optimizer: the best rate by mean final held-out loss over seeds, and its mean curve."""
    out: dict[str, dict[str, Any]] = {}
    for label in dict.fromkeys(r["label"] for r in results):
        by_rate: dict[float, list[dict[str, Any]]] = {}
        for r in results:
            if r["label"] == label:
                by_rate.setdefault(r["lr"], []).append(r)
        best_lr, best = None, math.inf
        for lr, runs in by_rate.items():
            finals = [r["curve"][-1][2] for r in runs]
            mean = statistics.mean(finals) if all(math.isfinite(f) for f in finals) else math.inf
            if mean < best:
                best_lr, best = lr, mean
        if best_lr is None:
            out[label] = {"lr": None, "final": math.inf}
            continue
        runs = by_rate[best_lr]
        n = min(len(r["curve"]) for r in runs)
        mean_curve = [
            (
                runs[0]["curve"][i][0],
                statistics.mean(r["curve"][i][1] for r in runs),
                statistics.mean(r["curve"][i][2] for r in runs),
            )
            for i in range(n)
        ]
        finals = [r["curve"][-1][2] for r in runs]
        out[label] = {"lr": best_lr, "final": best, "spread": max(finals) - min(finals), "curve": mean_curve}
    return out


def steps_to(curve: list[tuple[int, float, float]], target: float) -> int | None:
    return next((step for step, _s, loss in curve if step > 0 and loss <= target), None)


def table(summary: dict[str, dict[str, Any]]) -> str:
    target = summary.get("AdamW", {}).get("final", math.inf)
    adamw_steps = steps_to(summary["AdamW"]["curve"], target) if math.isfinite(target) else None
    lines = [
        f"| optimizer | best lr | final held-out loss (seeds' spread) | steps to AdamW's {target:.4f} | vs AdamW |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, s in summary.items():
        if s["lr"] is None:
            lines.append(f"| {label} | - | diverged at every rate | - | - |")
            continue
        reached = steps_to(s["curve"], target)
        ratio = f"{reached / adamw_steps:.2f}x" if reached and adamw_steps else "-"
        lines.append(f"| {label} | {s['lr']:.2g} | {s['final']:.4f} ({s['spread']:.4f}) | {reached or '-'} | {ratio} |")
    return "\n".join(lines)


def plot(summary: dict[str, dict[str, Any]], directory: str, meta: dict[str, Any]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    axes = (("step", 0, "convergence_steps.png"), ("seconds (one thread)", 1, "convergence_seconds.png"))
    for axis, index, name in axes:
        fig, ax = plt.subplots(figsize=(8, 5))
        for label, s in summary.items():
            if s["lr"] is None:
                continue
            xs = [p[index] for p in s["curve"][1:]]
            ys = [p[2] for p in s["curve"][1:]]
            ax.plot(xs, ys, label=f"{label} (lr {s['lr']:.2g}): {s['final']:.3f}")
        ax.set_xlabel(axis)
        ax.set_ylabel("held-out loss (byte tokens, public-domain books)")
        ax.set_title(
            f"tiny Llama, best of {meta['rates']} rates per optimizer, mean of {meta['seeds']} seeds, "
            f"{meta['steps']} steps"
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(directory, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, help="optimizers (default: all): " + ", ".join(ALIASES))
    ap.add_argument("--rates", type=int, default=4, help="learning rates per optimizer, log-spaced")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-sequences", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2, help="processes of one thread each")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "convergence", "results.json"))
    ap.add_argument("--plots", default=os.path.join(ROOT, "docs"), help="where the two plots go ('' for none)")
    ap.add_argument(
        "--reuse",
        default=None,
        help="an earlier results.json of the same settings: its runs of optimizers not run now join the table",
    )
    args = ap.parse_args(argv)
    from recipes import corpus

    if not corpus.installed():
        raise SystemExit(corpus.missing_message())
    labels = list(OPTIMIZERS)
    if args.only:
        unknown = [o for o in args.only if o.lower() not in ALIASES]
        if unknown:
            ap.error(f"--only {' '.join(unknown)}: not among {', '.join(ALIASES)}")
        labels = [ALIASES[o.lower()] for o in args.only]
    for name in ("rates", "seeds", "steps", "workers", "eval_every"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)}: at least 1")
    common = {k: getattr(args, k) for k in ("steps", "batch_size", "seq_len", "eval_every", "eval_sequences")}
    jobs = [
        {"label": label, "lr": lr, "seed": seed, **common}
        for label in labels
        for lr in rates(label, args.rates)
        for seed in range(args.seeds)
    ]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(args.workers) as pool:
        results = []
        for done, r in enumerate(pool.map(run_one, jobs), 1):
            results.append(r)
            print(
                f"[{done}/{len(jobs)}] {r['label']} lr {r['lr']:.2g} seed {r['seed']}: "
                f"held-out {r['curve'][-1][2]:.4f} after {r['curve'][-1][0]} steps, {r['curve'][-1][1]:.1f} s",
                flush=True,
            )
    if args.reuse:
        with open(args.reuse) as f:
            earlier = json.load(f)
        keys = ("steps", "batch_size", "seq_len", "eval_every", "eval_sequences", "seeds")
        differ = [k for k in keys if earlier["args"].get(k) != getattr(args, k)]
        if differ:
            raise SystemExit(f"--reuse {args.reuse}: other settings ({', '.join(differ)}); run those optimizers again")
        results = [r for r in earlier["results"] if r["label"] not in labels] + results
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "results": results}, f)
    summary = summarise(sorted(results, key=lambda r: list(OPTIMIZERS).index(r["label"])))
    print(f"\n{len(jobs)} runs in {time.perf_counter() - t0:.0f} s; results: {args.out}\n")
    if "AdamW" in summary:
        print(table(summary))
    if args.plots:
        for path in plot(summary, args.plots, {"rates": args.rates, "seeds": args.seeds, "steps": args.steps}):
            print(f"plot: {path}")


if __name__ == "__main__":
    main()
