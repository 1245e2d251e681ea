"""The planner's activation bytes against the closed form of Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models", eq. 1-2 and section 4): per transformer layer,
``s b h (34 + 5 a s / h)`` bytes without parallelism and ``s b h (10 + 24/t + 5 a s / (h t))`` with
tensor parallelism of size t (16-bit activations, 1-byte dropout masks, a GPT layer: LayerNorm, a 4h
GeLU MLP, dropout). Flash attention keeps no ``s x s`` matrix, so with it the ``5 a s / h`` term is 0.

The planner's figure per layer is measured, not modelled: the bytes the forward leaves alive for the
backward (``Activations.kept``) of the same model with two layers minus with one (the embedding,
final norm, head and loss are the rest). For each layer the saved bytes are also broken down by the
autograd node that produced them, which is where the difference from the GPT formula comes from.

    python -m bench.activations_closed_form [--models llama-7b llama-70b] [--seq-len 4096]
"""

from __future__ import annotations

import argparse
import sys

from dist_optim.plan import Layout, load_config
from dist_optim.plan.activations import Workload, activations_of_rank

GB = 1e9


def korthikanti(s: int, b: int, h: int, a: int, t: int, flash: bool) -> float:
    """Bytes per layer (their eq. 2; t=1 gives eq. 1), the ``s x s`` term dropped under flash attention."""
    scores = 0.0 if flash else 5 * a * s / (h * t)
    return s * b * h * (10 + 24 / t + scores)


def per_layer(model: str, tp: int, work: Workload) -> tuple[float, float, dict[str, int]]:
    """(kept bytes per layer, kept bytes outside the layers, saved bytes of one layer by producer)."""
    config = load_config(model)
    layout = Layout("hybrid", tp=tp, dp=1, precision="bf16")
    kept = {}
    by: dict[int, dict[str, int]] = {}
    for layers in (1, 2):
        c = type(config).from_dict({**config.to_dict(), "num_hidden_layers": layers})
        by[layers] = {}
        kept[layers] = activations_of_rank(c, layout, work, 0, "cuda", breakdown=by[layers]).kept
    layer = {k: by[2].get(k, 0) - by[1].get(k, 0) for k in by[2]}
    return kept[2] - kept[1], 2 * kept[1] - kept[2], {k: v for k, v in layer.items() if v}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["llama-7b", "llama-70b"])
    ap.add_argument("--tp", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=1)
    a = ap.parse_args(argv)
    print(
        "| model | tp | attention | planner GB/layer | Korthikanti GB/layer | planner / Korthikanti "
        "| planner x sbh | rest of the model GB |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    breakdowns = []
    for model in a.models:
        config = load_config(model)
        s, b, h, heads = a.seq_len, a.batch_size, config.hidden_size, config.num_attention_heads
        for tp in a.tp:
            for attn in ("sdpa", "eager"):
                print(f"simulating {model} tp={tp} {attn}", file=sys.stderr, flush=True)
                layer, rest, by = per_layer(model, tp, Workload(s, b, False, attn))
                closed = korthikanti(s, b, h, heads, tp, flash=attn != "eager")
                print(
                    f"| {model} | {tp} | {attn} | {layer / GB:.3f} | {closed / GB:.3f} | {layer / closed:.2f} "
                    f"| {layer / (s * b * h):.1f} | {rest / GB:.3f} |"
                )
                if attn == "sdpa":
                    breakdowns.append((model, tp, s * b * h, by))
    for model, tp, sbh, by in breakdowns:
        parts = ", ".join(f"{k} {v / sbh:.2f}" for k, v in sorted(by.items(), key=lambda kv: -kv[1]))
        print(f"\n{model} tp={tp}, sdpa: one layer's saved bytes by producing node, in units of s*b*h: {parts}")


if __name__ == "__main__":
    main()
