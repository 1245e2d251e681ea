"""Train a Llama with a ColossalAI booster and any optimizer, swapped for its TP/ZeRO-aware version.

Launch with torchrun or ColossalAI's launcher (one process per GPU, or CPU processes with gloo)::

    torchrun --nproc_per_node 4 recipes/train_llama.py --plugin hybrid --tp 2 --zero 1 \\
        --optimizer colossalai.nn.optimizer.Lamb --steps 300
    colossalai run --nproc_per_node 8 recipes/train_llama.py --preset 7b --plugin hybrid --tp 4 --zero 2 \\
        --precision bf16 --optimizer transformers.optimization.Adafactor --data my_corpus.txt

``--optimizer`` takes one of ours by short name (lamb, adafactor, came, shampoo, kron, galore) or
the import path of an ordinary optimizer class (``torch.optim.AdamW``, ``colossalai.nn.optimizer.Lamb``,
``transformers.optimization.Adafactor``, ...): dist_optim's plugins swap the latter for our
equivalent at ``booster.boost`` and log the swap. Without a GPU the script runs on CPU processes
(gloo), which is what ``make demo`` does.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DEFAULT_CORPUS = os.path.join(ROOT, "recipes", "data", "corpus.txt")

# name: (hidden, intermediate, layers, heads, kv_heads, vocab)
PRESETS: dict[str, tuple[int, int, int, int, int, int]] = {
    "tiny": (64, 128, 2, 4, 4, 256),
    "small": (256, 688, 4, 8, 8, 256),
    "1b": (2048, 5504, 22, 32, 4, 32000),
    "7b": (4096, 11008, 32, 32, 32, 32000),
}

OURS = {
    "lamb": ("dist_optim.DistributedLamb", dict(weight_decay=0.01)),
    "adafactor": ("dist_optim.DistributedAdafactor", dict(relative_step=False, scale_parameter=False)),
    "came": ("dist_optim.DistributedCAME", dict()),
    "shampoo": ("dist_optim.DistributedShampoo", dict(precondition_frequency=10, start_preconditioning_step=10)),
    "kron": ("dist_optim.DistributedKron", dict()),
    "galore": ("dist_optim.DistributedGaLore", dict()),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--plugin", choices=["hybrid", "zero", "ddp"], default="hybrid")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (hybrid)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (hybrid)")
    ap.add_argument(
        "--sp", type=int, default=1, help="sequence-parallel size, 'all_to_all' mode (hybrid; ZeRO runs over dp x sp)"
    )
    ap.add_argument("--zero", type=int, default=0, choices=[0, 1, 2], help="ZeRO stage")
    ap.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None, help="default: bf16 with ZeRO")
    ap.add_argument("--optimizer", default="colossalai.nn.optimizer.Lamb")
    ap.add_argument(
        "--optimizer-args",
        type=json.loads,
        default={},
        help="extra keyword arguments for the optimizer as JSON, e.g. '{\"relative_step\": false}'",
    )
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20, help="linear warmup steps, then cosine decay")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=4, help="sequences per data-parallel rank")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--data", default=None, help="a text file (bytes are tokens); default: the bundled corpus")
    ap.add_argument("--synthetic", action="store_true", help="random tokens instead of text")
    ap.add_argument("--grad-clip", type=float, default=1.0, help="max grad norm, 0 to disable")
    ap.add_argument("--ckpt-dir", default=None)
    ap.add_argument("--ckpt-every", type=int, default=0)
    ap.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --ckpt-dir")
    ap.add_argument("--log-csv", default=None, help="write step, loss, lr, step time (rank 0)")
    ap.add_argument("--tensorboard", default=None, help="TensorBoard log directory for loss, lr and step time (rank 0)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.precision is None:
        args.precision = "bf16" if args.zero > 0 else "fp32"
    if args.plugin != "hybrid" and (args.tp > 1 or args.pp > 1 or args.sp > 1):
        ap.error("--tp/--pp/--sp need --plugin hybrid")
    if args.sp > 1 and args.pp > 1:
        ap.error("--sp with --pp is not supported by this recipe")
    if args.plugin == "zero" and args.zero == 0:
        args.zero = 1
    return args


# ---- environment -----------------------------------------------------------------------------
def launch(seed: int) -> torch.device:
    """Initialise the process group from torchrun's environment: NCCL on GPUs, gloo on CPU."""
    import colossalai

    if not torch.cuda.is_available():
        # ColossalAI's CPU accelerator lacks calls its plugins make; the test suite's shims fill them.
        from tests._colossal_cpu import install

        install()
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    colossalai.launch_from_torch(seed=seed)
    return _current_device()


def _current_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def log(msg: str) -> None:
    if is_main():
        print(msg, flush=True)


# ---- model, optimizer, plugin -----------------------------------------------------------------
def build_model(preset: str, seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads, kv_heads, vocab = PRESETS[preset]
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        use_cache=False,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def build_optimizer(
    name: str, model: torch.nn.Module, lr: float, extra: dict[str, Any] | None = None
) -> torch.optim.Optimizer:
    extra = dict(extra or {})
    if name in OURS:
        path, kwargs = OURS[name]
        if name == "galore":
            from dist_optim import galore_param_groups

            return _import(path)(galore_param_groups(model, rank=8, update_proj_gap=50), lr=lr, **extra)
        return _import(path)(model.parameters(), lr=lr, **{**kwargs, **extra})
    return _import(name)(model.parameters(), lr=lr, **extra)


def _import(path: str) -> Any:
    module, attr = path.rsplit(".", 1)
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"--optimizer {path!r}: cannot import it ({exc}); ours are {sorted(OURS)}") from exc


def build_plugin(args: argparse.Namespace) -> Any:
    from dist_optim import plugins

    cpu = not torch.cuda.is_available()
    if args.plugin == "hybrid":
        return plugins.HybridParallelPlugin(
            tp_size=args.tp,
            pp_size=args.pp,
            zero_stage=args.zero,
            precision=args.precision,
            max_norm=args.grad_clip,
            microbatch_size=1 if args.pp > 1 else None,
            initial_scale=2**16,
            overlap_communication=not cpu,
            **(
                dict(sp_size=args.sp, enable_sequence_parallelism=True, sequence_parallelism_mode="all_to_all")
                if args.sp > 1
                else {}
            ),
        )
    if args.plugin == "zero":
        return plugins.LowLevelZeroPlugin(
            stage=args.zero,
            precision=args.precision,
            max_norm=args.grad_clip,
            initial_scale=2**16,
            overlap_communication=not cpu,
        )
    return plugins.TorchDDPPlugin()


def lr_lambda(warmup: int, total: int) -> Any:
    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return fn


# ---- data ------------------------------------------------------------------------------------
@dataclass
class Batches:
    """Deterministic batches: step s always yields the same global batch, so a resumed run
    continues exactly where it stopped; each data-parallel rank takes its slice."""

    tokens: torch.Tensor | None
    vocab: int
    seq_len: int
    batch: int
    dp_size: int
    dp_rank: int
    seed: int

    def __call__(self, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + step)
        n = self.batch * self.dp_size
        if self.tokens is None:
            full = torch.randint(0, self.vocab, (n, self.seq_len), generator=gen)
        else:
            starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1, (n,), generator=gen)
            full = torch.stack([self.tokens[s : s + self.seq_len] for s in starts.tolist()])
        return full[self.dp_rank * self.batch : (self.dp_rank + 1) * self.batch]


def load_tokens(path: str | None, synthetic: bool, vocab: int) -> torch.Tensor | None:
    if synthetic:
        return None
    with open(path or DEFAULT_CORPUS, "rb") as f:
        data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
    if vocab < 256:
        raise SystemExit("byte-level text needs a vocabulary of at least 256")
    return data


def dp_coords(plugin: Any) -> tuple[int, int]:
    group = getattr(plugin, "dp_group", None)
    return dist.get_world_size(group), dist.get_rank(group)


# ---- checkpoints -----------------------------------------------------------------------------
def save_checkpoint(booster: Any, model: Any, optimizer: Any, scheduler: Any, step: int, ckpt_dir: str) -> None:
    path = os.path.join(ckpt_dir, f"step_{step:07d}")
    os.makedirs(path, exist_ok=True)
    booster.save_model(model, os.path.join(path, "model"), shard=True)
    booster.save_optimizer(optimizer, os.path.join(path, "optimizer"), shard=True)
    booster.save_lr_scheduler(scheduler, os.path.join(path, "lr_scheduler"))
    dist.barrier()
    if is_main():
        with open(os.path.join(path, "meta.json"), "w") as f:
            json.dump({"step": step}, f)
        with open(os.path.join(ckpt_dir, "latest"), "w") as f:
            f.write(os.path.basename(path))
    dist.barrier()
    log(f"saved checkpoint {path}")


def load_checkpoint(booster: Any, model: Any, optimizer: Any, scheduler: Any, ckpt_dir: str) -> int:
    latest = os.path.join(ckpt_dir, "latest")
    if not os.path.exists(latest):
        raise SystemExit(f"--resume: no checkpoint in {ckpt_dir}")
    with open(latest) as f:
        path = os.path.join(ckpt_dir, f.read().strip())
    booster.load_model(model, os.path.join(path, "model"))
    booster.load_optimizer(optimizer, os.path.join(path, "optimizer"))
    booster.load_lr_scheduler(scheduler, os.path.join(path, "lr_scheduler"))
    with open(os.path.join(path, "meta.json")) as f:
        step = int(json.load(f)["step"])
    log(f"resumed from {path} at step {step}")
    return step


# ---- training --------------------------------------------------------------------------------
def train(args: argparse.Namespace) -> list[dict[str, float]]:
    """Train; return the per-step log (loss, lr, seconds) on every rank."""
    from colossalai.booster import Booster

    device = launch(args.seed) if not dist.is_initialized() else _current_device()
    model = build_model(args.preset, args.seed)
    optimizer = build_optimizer(args.optimizer, model, args.lr, args.optimizer_args)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.warmup, args.steps))
    plugin = build_plugin(args)
    booster = Booster(plugin=plugin)
    model, optimizer, _, _, scheduler = booster.boost(model, optimizer, lr_scheduler=scheduler)
    log(
        f"model: llama-{args.preset} ({sum(p.numel() for p in model.unwrap().parameters()) / 1e6:.2f}M local params), "
        f"plugin: {type(plugin).__name__} tp={args.tp} pp={args.pp} sp={args.sp} zero={args.zero} {args.precision}, "
        f"optimizer: {type(optimizer.optim).__module__}.{type(optimizer.optim).__name__}, device: {device}"
    )
    dp_size, dp_rank = dp_coords(plugin)
    vocab = PRESETS[args.preset][5]
    batches = Batches(
        load_tokens(args.data, args.synthetic, vocab), vocab, args.seq_len, args.batch_size, dp_size, dp_rank, args.seed
    )
    start = 0
    if args.resume:
        if not args.ckpt_dir:
            raise SystemExit("--resume needs --ckpt-dir")
        start = load_checkpoint(booster, model, optimizer, scheduler, args.ckpt_dir)
    history: list[dict[str, float]] = []
    writer = None
    if args.log_csv and is_main():
        os.makedirs(os.path.dirname(os.path.abspath(args.log_csv)), exist_ok=True)
        f = open(args.log_csv, "a" if args.resume else "w", newline="")  # noqa: SIM115 - closed below
        writer = csv.writer(f)
        if not args.resume:
            writer.writerow(["step", "loss", "lr", "seconds"])
    board = None
    if args.tensorboard and is_main():
        from torch.utils.tensorboard import SummaryWriter

        board = SummaryWriter(args.tensorboard, purge_step=start + 1 if args.resume else None)
    progress = None
    if is_main() and not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=args.steps, initial=start, desc="train", dynamic_ncols=True)
    model.train()
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        x = batches(step).to(device)
        if args.pp > 1:
            out = booster.execute_pipeline(
                iter([{"input_ids": x, "labels": x}]), model, lambda o, b: o.loss, optimizer, return_loss=True
            )
            loss = out["loss"]
        else:
            # Under sequence parallelism transformers 4.51 needs an explicit mask (see the README).
            mask = {"attention_mask": torch.ones_like(x)} if args.sp > 1 else {}
            loss = model(input_ids=x, labels=x, **mask).loss
            booster.backward(loss, optimizer)
        if args.plugin == "ddp" and args.grad_clip > 0:
            optimizer.clip_grad_by_norm(args.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        loss_value = _global_loss(loss, plugin)
        seconds = time.perf_counter() - t0
        entry = {"step": step + 1, "loss": loss_value, "lr": scheduler.get_last_lr()[0], "seconds": seconds}
        history.append(entry)
        if writer is not None:
            writer.writerow([entry["step"], f"{loss_value:.6f}", f"{entry['lr']:.6g}", f"{seconds:.4f}"])
            f.flush()  # a log that can be followed while the run goes on
        if board is not None:
            for key in ("loss", "lr", "seconds"):
                board.add_scalar(f"train/{key}", entry[key], entry["step"])
        if progress is not None:
            progress.set_postfix(loss=f"{loss_value:.4f}")
            progress.update(1)
        if args.ckpt_dir and args.ckpt_every and (step + 1) % args.ckpt_every == 0:
            save_checkpoint(booster, model, optimizer, scheduler, step + 1, args.ckpt_dir)
    if progress is not None:
        progress.close()
    if writer is not None:
        f.close()
    if board is not None:
        board.close()
    if history:
        log(f"final loss {history[-1]['loss']:.4f} after {history[-1]['step']} steps")
    return history


def _global_loss(loss: torch.Tensor | None, plugin: Any) -> float:
    """The mean loss over data-parallel ranks (on the last pipeline stage), on every rank."""
    value = torch.zeros(2, dtype=torch.float64)
    if loss is not None:
        value[0] = float(loss.detach().float())
        value[1] = 1.0
    dist.all_reduce(value)
    return float(value[0] / value[1].clamp_min(1))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        train(args)
    finally:
        if dist.is_initialized():
            dist.barrier()


if __name__ == "__main__":
    main()
