"""Train a Llama, Mistral, Qwen2 or Mixtral model with a ColossalAI booster and any optimizer, swapped for
its TP/ZeRO-aware version.

Launch with torchrun or ColossalAI's launcher (one process per GPU, or CPU processes with gloo)::

    torchrun --nproc_per_node 4 recipes/train.py --plugin hybrid --tp 2 --zero 1 \\
        --optimizer colossalai.nn.optimizer.Lamb --steps 300
    colossalai run --nproc_per_node 8 recipes/train.py --model /models/Llama-2-7b-hf \\
        --plugin hybrid --tp 2 --zero 1 --precision bf16 --optimizer transformers.optimization.Adafactor \\
        --data my_corpus/ --seq-len 4096 --batch-size 1 --grad-accum 8 --eval-every 200
    python recipes/train.py --model 7b --tp 8 --world-size 8 --dry-run   # the layout, no allocation

``--plugin`` is ``hybrid`` (TP, pipelines, SP, ZeRO), ``zero`` (ZeRO-1/2), ``ddp``, or ``fsdp`` (PyTorch
FSDP's full shard, one unit per decoder layer).

``--model`` is a preset (tiny, small, 1b, 7b: from scratch) or a local Hugging Face directory: its
``config.json`` gives the architecture and its weights (``model.safetensors``, a sharded
``*.index.json`` checkpoint or ``pytorch_model.bin``), when present, are loaded shard by shard by
``booster.load_model`` after the booster has sharded the model; a directory with only a config
trains from scratch. Under the hybrid plugin the model is built inside ColossalAI's
``LazyInitContext``: parameters stay unallocated until the booster materialises each layer and
keeps this rank's tensor-parallel shard, so no rank ever holds the whole fp32 model.

``--tokenizer`` (default: the model directory when it holds a tokenizer) and ``--data`` (``.txt`` /
``.jsonl`` files or directories) are tokenized once into a cached memory-mapped token file (see
``recipes/tokens.py``); without a tokenizer the bytes of the text are the tokens (the zero-download
demo). The log, the CSV and TensorBoard report loss, held-out loss (``--eval-every``), tokens per
second, model FLOPs utilisation (where the device's peak is known, or ``--peak-tflops``) and each
rank's peak memory (device memory on GPUs, resident memory on CPU).

``--optimizer`` takes one of ours by short name (lamb, adafactor, came, shampoo, soap, kron, galore, muon,
normuon;
``OURS`` holds their recommended settings, docs/convergence.md) or
the import path of an ordinary optimizer class (``torch.optim.AdamW``, ``colossalai.nn.optimizer.Lamb``,
``transformers.optimization.Adafactor``, ...): dist_optim's plugins swap the latter for our
equivalent at ``booster.boost`` and log the swap. Without a GPU the script runs on CPU processes
(gloo), which is what ``make demo`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from recipes.building import (  # noqa: E402
    PRESETS,
    attn_implementation,
    build_model,
    build_optimizer,
    build_plugin,
    check_layout,
    enable_grad_checkpoint,
    lr_lambda,
    model_config,
)
from recipes.checkpoints import load_checkpoint, save_checkpoint  # noqa: E402
from recipes.data import dp_coords, load_data  # noqa: E402
from recipes.dry_run import dry_run  # noqa: E402
from recipes.env import current_device, is_main, launch, log  # noqa: E402
from recipes.metrics import (  # noqa: E402
    MetricsLog,
    clip_metrics,
    device_peak_tflops,
    flops_per_token,
    gather_peak_memory,
    global_loss,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        "--preset",
        dest="model",
        default="tiny",
        help=f"a preset ({', '.join(PRESETS)}) or a local Hugging Face model directory (config.json [+ weights])",
    )
    ap.add_argument(
        "--plugin",
        choices=["hybrid", "zero", "ddp", "fsdp"],
        default="hybrid",
        help="fsdp: PyTorch FSDP's full shard, one unit per decoder layer (parameters sharded too)",
    )
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (hybrid)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (hybrid)")
    ap.add_argument(
        "--sp", type=int, default=1, help="sequence-parallel size, 'all_to_all' mode (hybrid; ZeRO runs over dp x sp)"
    )
    ap.add_argument("--zero", type=int, default=0, choices=[0, 1, 2], help="ZeRO stage (hybrid, zero)")
    ap.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None, help="default: bf16 with ZeRO")
    ap.add_argument(
        "--cpu-offload",
        action="store_true",
        help="ZeRO keeps the fp32 masters and optimizer states in host memory (needs --zero 1 or 2)",
    )
    ap.add_argument(
        "--attn",
        choices=["sdpa", "flash", "eager"],
        default=None,
        help="attention kernel (flash: flash_attention_2); default flash on GPUs with flash-attn installed, else sdpa",
    )
    ap.add_argument("--no-lazy", action="store_true", help="build the full model on every rank (for comparison)")
    ap.add_argument(
        "--grad-checkpoint",
        type=float,
        nargs="?",
        const=1.0,
        default=0.0,
        metavar="RATIO",
        help="activation (gradient) checkpointing of the decoder layers: recomputed in the backward instead of "
        "kept; RATIO, the share of each stage's layers (hybrid plugin; default 1: all)",
    )
    ap.add_argument("--optimizer", default="colossalai.nn.optimizer.Lamb")
    ap.add_argument(
        "--optimizer-args",
        type=json.loads,
        default={},
        help="extra keyword arguments for the optimizer as JSON, e.g. '{\"relative_step\": false}'",
    )
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20, help="linear warmup steps, then cosine decay")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps (0: build and load only)")
    ap.add_argument("--batch-size", type=int, default=4, help="sequences per data-parallel rank and micro-batch")
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches accumulated per optimizer step")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--tokenizer", default=None, help="a local Hugging Face tokenizer directory (default: --model's)")
    ap.add_argument(
        "--data",
        nargs="+",
        default=None,
        help=".txt / .jsonl ('text' field) files or directories of them; default: three public-domain books "
        "(recipes/corpus.py, installed by make setup)",
    )
    ap.add_argument(
        "--eval-data",
        nargs="+",
        default=None,
        help="held-out .txt / .jsonl files or directories for --eval-every (default: the books' held-out part "
        "without --data, else the last --eval-fraction of --data)",
    )
    ap.add_argument(
        "--data-cache", default=os.path.join(ROOT, "runs", "token_cache"), help="where tokenized data is cached"
    )
    ap.add_argument("--synthetic", action="store_true", help="random tokens instead of text")
    ap.add_argument("--eval-every", type=int, default=0, help="held-out loss every N steps (0: never)")
    ap.add_argument(
        "--eval-fraction", type=float, default=0.01, help="share of --data's packed sequences held out (no --eval-data)"
    )
    ap.add_argument("--eval-sequences", type=int, default=256, help="held-out sequences per evaluation (0: all)")
    ap.add_argument("--grad-clip", type=float, default=1.0, help="max grad norm, 0 to disable")
    ap.add_argument("--ckpt-dir", default=None)
    ap.add_argument("--ckpt-every", type=int, default=0)
    ap.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --ckpt-dir")
    ap.add_argument("--log-csv", default=None, help="per-step metrics as CSV (rank 0)")
    ap.add_argument("--tensorboard", default=None, help="TensorBoard log directory for the same metrics (rank 0)")
    ap.add_argument("--log-every", type=int, default=10, help="print a metrics line every N steps")
    ap.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU when not in the table")
    ap.add_argument("--dry-run", action="store_true", help="print the layout and exit without allocating the model")
    ap.add_argument("--world-size", type=int, default=None, help="processes for --dry-run (default: $WORLD_SIZE)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    _check_plugin(ap, args)
    for name in ("grad_accum", "batch_size", "seq_len"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.pp > 1 and args.batch_size < args.pp:
        ap.error(
            f"--batch-size {args.batch_size} with --pp {args.pp}: the pipeline runs micro-batches of one sequence and "
            f"ColossalAI's 1F1B schedule needs at least as many as stages; use --batch-size {args.pp} or more"
        )
    if args.steps < 0:
        ap.error("--steps must be at least 0 (0: build and load the model, report its memory, train nothing)")
    if not 0 <= args.grad_checkpoint <= 1:
        ap.error(f"--grad-checkpoint {args.grad_checkpoint}: a share of the layers in (0, 1] (1 without a value)")
    if args.grad_checkpoint not in (0.0, 1.0) and not (args.plugin == "hybrid" and args.pp > 1):
        ap.error(
            f"--grad-checkpoint {args.grad_checkpoint}: a share of the layers needs --plugin hybrid with --pp > 1 "
            "(ColossalAI's PipelineGradientCheckpointConfig); without pipeline stages every layer is checkpointed (1)"
        )
    if not 0 <= args.eval_fraction < 1:
        ap.error("--eval-fraction must be in [0, 1)")
    if args.model not in PRESETS and not os.path.isdir(args.model):
        ap.error(f"--model {args.model!r}: neither a preset ({', '.join(PRESETS)}) nor a directory")
    return args


def _check_plugin(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The plugin's options: refused in one line where the plugin has no such thing; ZeRO's
    defaults (bf16, stage 1 for the zero plugin) filled in."""
    if args.plugin == "fsdp" and args.zero:
        ap.error(
            f"--zero {args.zero} with --plugin fsdp: FSDP shards parameters, gradients and states itself; drop --zero"
        )
    if args.plugin == "fsdp" and args.precision == "fp16":
        ap.error("--precision fp16 with --plugin fsdp: the FSDP plugin has no loss scaling; use bf16 or fp32")
    if args.precision is None:
        args.precision = "bf16" if args.zero > 0 else "fp32"
    if args.plugin != "hybrid" and (args.tp > 1 or args.pp > 1 or args.sp > 1):
        ap.error("--tp/--pp/--sp need --plugin hybrid")
    if args.sp > 1 and args.pp > 1:
        ap.error("--sp with --pp is not supported by this recipe")
    if args.pp > 1 and args.eval_every > 0:
        ap.error("--eval-every with --pp > 1 is not supported by this recipe yet")
    if args.plugin == "zero" and args.zero == 0:
        args.zero = 1
    if args.cpu_offload and (args.plugin in ("ddp", "fsdp") or args.zero == 0):
        ap.error("--cpu-offload is ZeRO's: add --zero 1 or --zero 2 (with --plugin hybrid or zero)")


def forward_loss(model: Any, x: torch.Tensor, sp: int) -> torch.Tensor:
    # Under sequence parallelism transformers 4.51 needs an explicit mask (see the README).
    mask = {"attention_mask": torch.ones_like(x)} if sp > 1 else {}
    return model(input_ids=x, labels=x, **mask).loss


def evaluate(model: Any, data: Any, args: argparse.Namespace, device: torch.device) -> float:
    """The mean held-out loss over every token of the evaluated sequences, on every rank."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for x in data.eval_batches(args.eval_sequences):
            loss = forward_loss(model, x.to(device), args.sp)
            total[0] += float(loss.float()) * x.shape[0]
            total[1] += x.shape[0]
    model.train()
    # Over every rank, as the training loss: tensor- and sequence-parallel peers hold the same value.
    total = total.to(device)
    dist.all_reduce(total)
    return float(total[0] / total[1].clamp_min(1))


def train(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Train; return the per-step log (loss, lr, seconds, throughput, memory) on every rank."""
    from colossalai.booster import Booster

    from dist_optim.plugins.fsdp import decoder_layer_classes

    device = launch(args.seed) if not dist.is_initialized() else current_device()
    attn = attn_implementation(args.attn)
    config, weights = model_config(args.model)
    check_layout(config, args)
    lazy = args.plugin == "hybrid" and not args.no_lazy
    model = build_model(config, args.seed, lazy, attn)
    enable_grad_checkpoint(model, args)
    num_params = sum(p.numel() for p in model.parameters())  # shapes only: lazy tensors hold no data
    optimizer = build_optimizer(args.optimizer, model, args.lr, args.optimizer_args)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.warmup, args.steps))
    plugin = build_plugin(args, config, decoder_layer_classes(model))
    booster = Booster(plugin=plugin)
    model, optimizer, _, _, scheduler = booster.boost(model, optimizer, lr_scheduler=scheduler)
    if weights and not args.resume:
        # Each rank reads the checkpoint file by file and keeps only its shard of every tensor.
        booster.load_model(model, weights)
        log(f"loaded pretrained weights from {weights}")
    ready = ", ".join(f"{m:.2f}" for m in gather_peak_memory())
    log(f"model ready: peak memory per rank (GiB) [{ready}] (full model in fp32: {num_params * 4 / 2**30:.2f} GiB)")
    local = sum(p.numel() for p in model.unwrap().parameters())
    log(
        f"model: {args.model} ({num_params / 1e6:.2f}M params, {local / 1e6:.2f}M on this rank, "
        f"{'lazy' if lazy else 'eager'} init, attn {attn}), "
        f"plugin: {type(plugin).__name__} tp={args.tp} pp={args.pp} sp={args.sp} zero={args.zero} {args.precision}, "
        f"optimizer: {type(optimizer.optim).__module__}.{type(optimizer.optim).__name__}, device: {device}"
    )
    dp_size, dp_rank = dp_coords(plugin)
    # Under pipeline parallelism one step's micro-batches go through the pipeline together.
    micro = args.grad_accum if args.pp == 1 else 1
    per_call = args.batch_size if args.pp == 1 else args.batch_size * args.grad_accum
    data_args = argparse.Namespace(**{**vars(args), "batch_size": per_call})
    data = load_data(data_args, config.vocab_size, dp_size, dp_rank)
    tokens_per_step = args.batch_size * args.grad_accum * dp_size * args.seq_len
    peak = device_peak_tflops(args.precision, args.peak_tflops)
    flops_token = flops_per_token(config, num_params, args.seq_len)
    start = 0
    if args.resume:
        if not args.ckpt_dir:
            raise SystemExit("--resume needs --ckpt-dir")
        start = load_checkpoint(booster, model, optimizer, scheduler, args.ckpt_dir)
    history: list[dict[str, Any]] = []
    sink = MetricsLog(args, start)
    progress = None
    if is_main() and not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=args.steps, initial=start, desc="train", dynamic_ncols=True)
    model.train()
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        if args.pp > 1:
            x = data.train_batch(step).to(device)
            out = booster.execute_pipeline(
                iter([{"input_ids": x, "labels": x}]), model, lambda o, b: o.loss, optimizer, return_loss=True
            )
            loss = out["loss"]
        else:
            losses = []
            for m in range(micro):
                x = data.train_batch(step * micro + m).to(device)
                loss = forward_loss(model, x, args.sp)
                # Gradients add up over the micro-batches (synchronised each time: ZeRO-2 has no no_sync).
                booster.backward(loss / micro, optimizer)
                losses.append(loss.detach().float())
            loss = torch.stack(losses).mean()
        if args.plugin in ("ddp", "fsdp") and args.grad_clip > 0:
            optimizer.clip_grad_by_norm(args.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        loss_value = global_loss(loss, plugin)
        seconds = time.perf_counter() - t0
        tps = tokens_per_step / seconds
        entry: dict[str, Any] = {
            "step": step + 1,
            "loss": loss_value,
            "lr": scheduler.get_last_lr()[0],
            "seconds": seconds,
            "tokens_per_s": tps,
            "mfu": None if peak is None else flops_token * tps / dist.get_world_size() / (peak * 1e12),
            "peak_mem_gib": gather_peak_memory(),
            "eval_loss": None,
        }
        entry.update(clip_metrics(optimizer))
        if args.eval_every > 0 and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
            entry["eval_loss"] = evaluate(model, data, args, device)
            log(f"step {step + 1}: eval loss {entry['eval_loss']:.4f}")
        history.append(entry)
        sink.write(entry)
        if progress is not None:
            progress.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{tps:.0f}")
            progress.update(1)
        if args.log_every > 0 and ((step + 1) % args.log_every == 0 or step + 1 == args.steps):
            mfu = "" if entry["mfu"] is None else f", MFU {entry['mfu']:.1%}"
            mems = ", ".join(f"{m:.2f}" for m in entry["peak_mem_gib"])
            log(
                f"step {step + 1}: loss {loss_value:.4f}, lr {entry['lr']:.3g}, {tps:.0f} tokens/s{mfu}, "
                f"peak memory per rank (GiB) [{mems}]"
            )
        if args.ckpt_dir and args.ckpt_every and (step + 1) % args.ckpt_every == 0:
            save_checkpoint(booster, model, optimizer, scheduler, step + 1, args.ckpt_dir)
    if progress is not None:
        progress.close()
    sink.close()
    if history:
        log(f"final loss {history[-1]['loss']:.4f} after {history[-1]['step']} steps")
    return history


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.dry_run:
        dry_run(args)
        return
    try:
        train(args)
    finally:
        if dist.is_initialized():
            dist.barrier()


if __name__ == "__main__":
    main()
