"""What QK-clip's logit measurement adds to a training step's forward and backward: a Llama-shaped
model (hidden 512, 8 heads of 64, 4 layers, eager attention) trained on one process with and
without :func:`dist_optim.watch_attention_logits`, the two alternating so that both see the same
machine state, as a ratio of medians in the same process. The optimizer step is left out (its part
of QK-clip is one small all-reduce and the scaling of the clipped heads' rows).

    python bench/qk_clip_cost.py                 # prints the table, writes bench/results/qk_clip_cost.json
    python bench/qk_clip_cost.py --seq 256 1024 --repeats 6

The JSON (``--write``, :func:`bench.record.write_table`) holds the command, the commit, the machine
and every figure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

ROOT = __file__.rsplit("/bench/", 1)[0]
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.record import col, write_table  # noqa: E402


def _model() -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        use_cache=False,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def measure(seq: int, batch: int, repeats: int) -> dict[str, float]:
    """Median seconds of a forward and backward without and with the measurement, and their ratio."""
    import dist_optim

    model = _model()
    opt = dist_optim.DistributedMuon(dist_optim.muon_param_groups(model), qk_clip_tau=100.0)
    x = torch.randint(0, 1024, (batch, seq), generator=torch.Generator().manual_seed(0))
    times: dict[bool, list[float]] = {False: [], True: []}
    monitor = None
    for i in range(2 * repeats + 2):
        watched = i % 2 == 1
        if watched and monitor is None:
            monitor = dist_optim.watch_attention_logits(model, opt)
        elif not watched and monitor is not None:
            monitor.remove()
            monitor = None
        t0 = time.perf_counter()
        model(input_ids=x, labels=x).loss.backward()
        elapsed = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        if i >= 2:  # the first pair warms up
            times[watched].append(elapsed)
    plain, watched_s = statistics.median(times[False]), statistics.median(times[True])
    return {"seq": seq, "batch": batch, "plain_s": plain, "watched_s": watched_s, "ratio": watched_s / plain}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument(
        "--write", metavar="NAME", default="qk_clip_cost", help="bench/results/NAME.json ('': write nothing)"
    )
    args = ap.parse_args(argv)
    rows = [measure(seq, args.batch, args.repeats) for seq in args.seq]
    print("| sequence | forward + backward (ms) | with the measurement (ms) | ratio |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['seq']} | {1e3 * r['plain_s']:.1f} | {1e3 * r['watched_s']:.1f} | {r['ratio']:.3f} |")
    if args.write:
        columns = [
            col("seq", "sequence", 0),
            col("batch", "batch", 0),
            col("plain_s", "forward + backward (s)", 4),
            col("watched_s", "with the measurement (s)", 4),
            col("ratio", "ratio", 3, suffix="x"),
        ]
        write_table(args.write, columns, rows, script=__file__, argv=argv)


if __name__ == "__main__":
    main()
