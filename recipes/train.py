"""Train a Llama, Mistral, Qwen2 or Mixtral model with a ColossalAI booster and any optimizer, swapped for
its TP/ZeRO-aware version (``recipes/train_llama.py``, its old name, runs it too).

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

from dist_optim import AdamGraftingConfig  # noqa: E402

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
    # Adam grafting as Meta's README configures it: without grafting at epsilon 1e-12 Shampoo's first
    # roots of near-singular factors blow the update up (NaN within the first few dozen steps).
    "shampoo": (
        "dist_optim.DistributedShampoo",
        dict(
            precondition_frequency=10,
            start_preconditioning_step=10,
            grafting_config=AdamGraftingConfig(beta2=0.999, epsilon=1e-8),
        ),
    ),
    # SOAP as Vyas et al. run it: eigenvectors at the first refresh, then one power step.
    "soap": (
        "dist_optim.DistributedShampoo",
        dict(
            eigenvalue_correction=True,
            eigenbasis="qr-eigh-start",
            betas=(0.95, 0.95),
            epsilon=1e-8,
            precondition_frequency=10,
            start_preconditioning_step=10,
        ),
    ),
    # The initial scale from each parameter's first gradient (Li's rule): at kron_torch's fixed 1 the
    # first updates of small gradients are tiny, and a tiny Llama's loss stays high for ~100 steps.
    "kron": ("dist_optim.DistributedKron", dict(precond_init_scale=None)),
    "galore": ("dist_optim.DistributedGaLore", dict()),
    # Muon's update RMS matched to AdamW's (Liu et al. 2025), so one --lr serves the Muon matrices
    # and the auxiliary AdamW group (embeddings, head, norms).
    "muon": ("dist_optim.DistributedMuon", dict(adjust_lr_fn="match_rms_adamw")),
    "normuon": ("dist_optim.DistributedNorMuon", dict(adjust_lr_fn="match_rms_adamw")),
}


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


# ---- environment -----------------------------------------------------------------------------
def launch(seed: int) -> torch.device:
    """Initialise the process group from torchrun's environment: NCCL on GPUs, gloo on CPU."""
    import colossalai

    if not torch.cuda.is_available():
        # ColossalAI's CPU accelerator lacks calls its plugins make; dist_optim.plugins.cpu fills them.
        from dist_optim.plugins.cpu import install

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
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def default_attn() -> str:
    """flash_attention_2 where it can run (a GPU and the flash-attn package), else PyTorch's SDPA."""
    import importlib.util

    return "flash" if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") else "sdpa"


def attn_implementation(attn: str | None) -> str:
    attn = attn or default_attn()
    if attn == "flash":
        import importlib.util

        if not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None:
            raise SystemExit("--attn flash needs a GPU and the flash-attn package; use --attn sdpa")
        return "flash_attention_2"
    return attn


def model_config(model: str) -> tuple[Any, str | None]:
    """The Hugging Face config of ``model`` (a preset or a directory) and the directory to load
    pretrained weights from (None: train from scratch)."""
    from dist_optim.plan.models import PlanError, llama_config, read_config

    if model in PRESETS:
        config = llama_config(*PRESETS[model])
        weights = None
    else:
        try:
            config = read_config(model)
        except PlanError as exc:
            raise SystemExit(str(exc)) from None
        weights = model if any(os.path.exists(os.path.join(model, f)) for f in WEIGHT_FILES) else None
    config.use_cache = False
    return config, weights


def check_layout(config: Any, args: argparse.Namespace) -> None:
    """The layout against the model before ColossalAI sees it (:func:`dist_optim.plan.models.check_model_layout`:
    heads divisible by --tp, after --sp's all_to_all split; --pp at most the layers), one line."""
    from dist_optim.plan.models import PlanError, check_model_layout

    tp = args.tp if args.plugin == "hybrid" else 1
    try:
        check_model_layout(config, tp, args.pp, args.sp, "all_to_all" if args.sp > 1 else None)
    except PlanError as exc:
        raise SystemExit(str(exc)) from None


def build_model(config: Any, seed: int, lazy: bool, attn: str) -> torch.nn.Module:
    """The model, its parameters unallocated when ``lazy`` (ColossalAI's LazyInitContext records
    the initialisation and replays it per shard when the booster materialises the model)."""
    from contextlib import nullcontext

    from colossalai.lazy import LazyInitContext
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with LazyInitContext() if lazy else nullcontext():
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn)


def optimizer_class(name: str) -> tuple[type, dict[str, Any]]:
    if name in OURS:
        path, kwargs = OURS[name]
        return _import(path), dict(kwargs)
    return _import(name), {}


def build_optimizer(
    name: str, model: torch.nn.Module, lr: float, extra: dict[str, Any] | None = None
) -> torch.optim.Optimizer:
    extra = dict(extra or {})
    cls, kwargs = optimizer_class(name)
    if name == "galore":
        from dist_optim import galore_param_groups

        return cls(galore_param_groups(model, rank=8, update_proj_gap=50), lr=lr, **extra)
    if name in ("muon", "normuon"):
        from dist_optim import muon_param_groups

        # per_head: q, k and v orthogonalized by head (muon_param_groups' option, not the class's).
        groups = muon_param_groups(model, adamw_lr=lr, per_head=bool(extra.pop("per_head", False)))
        return cls(groups, lr=lr, **{**kwargs, **extra})
    return cls(model.parameters(), lr=lr, **{**kwargs, **extra})


def _import(path: str) -> Any:
    if "." not in path:
        raise SystemExit(f"--optimizer {path!r}: neither one of ours {sorted(OURS)} nor an import path")
    module, attr = path.rsplit(".", 1)
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"--optimizer {path!r}: cannot import it ({exc}); ours are {sorted(OURS)}") from exc


def build_plugin(args: argparse.Namespace, config: Any = None, units: set[type] | None = None) -> Any:
    """The booster's plugin for ``args``; ``config`` (the model's) sets the hybrid plugin's
    vocabulary padding (:func:`dist_optim.plan.models.vocab_multiple`: none for a tied Qwen2);
    ``units``, the model's decoder-layer class, FSDP's unit (a layer's parameters are gathered
    for its forward and backward only, as FSDP's own Llama recipes wrap)."""
    from dist_optim import plugins
    from dist_optim.plan.models import VOCAB_MULTIPLE, vocab_multiple

    cpu = not torch.cuda.is_available()
    if args.plugin == "hybrid":
        return plugins.HybridParallelPlugin(
            tp_size=args.tp,
            pp_size=args.pp,
            zero_stage=args.zero,
            precision=args.precision,
            max_norm=args.grad_clip,
            microbatch_size=1 if args.pp > 1 else None,
            gradient_checkpoint_config=checkpoint_config(args),
            make_vocab_size_divisible_by=vocab_multiple(config) if config is not None else VOCAB_MULTIPLE,
            initial_scale=2**16,
            overlap_communication=not cpu,
            cpu_offload=args.cpu_offload,
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
            cpu_offload=args.cpu_offload,
        )
    if args.plugin == "fsdp":
        from torch.distributed.fsdp import MixedPrecision
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        # bf16 compute and communication; the fp32 shards stay what the optimizer updates.
        bf16 = torch.bfloat16
        mixed = MixedPrecision(bf16, bf16, bf16) if args.precision == "bf16" else None
        return plugins.TorchFSDPPlugin(
            auto_wrap_policy=ModuleWrapPolicy(units) if units else None, mixed_precision=mixed
        )
    return plugins.TorchDDPPlugin()


def lr_lambda(warmup: int, total: int) -> Any:
    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return fn


# ---- throughput and memory --------------------------------------------------------------------
# Dense bf16/fp16 tensor-core peaks (TFLOPS, no sparsity) from NVIDIA's data sheets, matched in
# order against torch.cuda.get_device_name(): specific names before the families that contain them.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("H200", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
)


def device_peak_tflops(precision: str, override: float | None) -> float | None:
    """The device's peak for ``precision``, None where unknown (fp32, CPUs, devices not in the table)."""
    if override is not None:
        return override
    if precision == "fp32" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)


def flops_per_token(config: Any, num_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 per non-embedding-lookup parameter (forward + backward matmuls)
    plus the attention scores, 12 * layers * hidden * seq_len (Chowdhery et al. 2022, PaLM,
    appendix B), the usual MFU convention: recomputation is not counted. A Mixtral's token passes
    through ``num_experts_per_tok`` of its ``num_local_experts`` experts (3 matrices each): the
    others' parameters do no work for it and are not counted. A tied embedding (Qwen2's option) is
    one parameter that is also the output head's matmul: counted."""
    embed = 0 if getattr(config, "tie_word_embeddings", False) else config.vocab_size * config.hidden_size
    experts = int(getattr(config, "num_local_experts", 0) or 0)
    idle = experts - int(getattr(config, "num_experts_per_tok", 0) or 0) if experts else 0
    inactive = config.num_hidden_layers * idle * 3 * config.hidden_size * config.intermediate_size
    return 6.0 * (num_params - embed - inactive) + 12.0 * config.num_hidden_layers * config.hidden_size * seq_len


def peak_memory_bytes() -> int:
    """This process's peak: allocated device memory on GPUs, resident set size on CPU."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def gather_peak_memory() -> list[float]:
    """Every rank's peak memory in GiB (on every rank)."""
    mine = torch.tensor([peak_memory_bytes() / 2**30], dtype=torch.float64, device=_current_device())
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [float(t) for t in out]


# ---- data ------------------------------------------------------------------------------------
@dataclass
class Synthetic:
    """Random tokens: micro-step s always yields the same global batch; each dp rank its slice."""

    vocab: int
    seq_len: int
    batch: int
    dp_size: int
    dp_rank: int
    seed: int
    num_eval: int = 0

    def train_batch(self, micro_step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + micro_step)
        full = torch.randint(0, self.vocab, (self.batch * self.dp_size, self.seq_len), generator=gen)
        return full[self.dp_rank * self.batch : (self.dp_rank + 1) * self.batch]

    def eval_batches(self, max_sequences: int = 0) -> list[torch.Tensor]:
        return []


def checkpoint_config(args: argparse.Namespace) -> Any:
    """ColossalAI's config of how many of each pipeline stage's decoder layers ShardFormer's forward
    checkpoints (the hybrid plugin's ``gradient_checkpoint_config``: ``--grad-checkpoint`` of them,
    rounded down), under ``--pp > 1``; None otherwise, where the model's own switch
    (:func:`enable_grad_checkpoint`) checkpoints every layer (ColossalAI reads a config only with
    pipeline stages)."""
    if not args.grad_checkpoint or args.pp == 1:
        return None
    from colossalai.shardformer import PipelineGradientCheckpointConfig

    return PipelineGradientCheckpointConfig(gradient_checkpointing_ratio=args.grad_checkpoint)


def enable_grad_checkpoint(model: torch.nn.Module, args: argparse.Namespace) -> None:
    """Turn on the model's own gradient checkpointing (transformers' switch, which ColossalAI's
    ShardFormer forward also reads; non-reentrant, as ColossalAI's examples) before boosting: the
    decoder layers' activations are recomputed in the backward instead of kept."""
    if args.grad_checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def resolve_tokenizer(args: argparse.Namespace) -> str | None:
    """The tokenizer directory: --tokenizer, else the model directory when it holds a tokenizer,
    else None (byte tokens)."""
    if args.tokenizer:
        if not os.path.isdir(args.tokenizer):
            raise SystemExit(f"--tokenizer {args.tokenizer!r}: not a directory")
        return args.tokenizer
    if os.path.isdir(args.model) and any(os.path.exists(os.path.join(args.model, f)) for f in TOKENIZER_FILES):
        return args.model
    return None


def expand(paths: list[str], flag: str) -> list[str]:
    """:func:`recipes.tokens.expand_inputs`, a bad path refused in its one line."""
    from recipes import tokens

    try:
        return tokens.expand_inputs(paths, flag)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def data_files(args: argparse.Namespace) -> tuple[list[str], list[str] | None]:
    """(training files, held-out files or None): --data and --eval-data, by default the books of
    recipes/corpus.py and their held-out part; a missing path or corpus is refused in one line."""
    from recipes import corpus

    if args.data is None and not corpus.installed():
        raise SystemExit(corpus.missing_message())
    held = args.eval_data or ([corpus.HELDOUT] if args.data is None else None)
    train = expand(args.data or [corpus.TRAIN], "--data")
    return train, None if held is None else expand(held, "--eval-data")


def tokenize(files: list[str], args: argparse.Namespace, vocab: int) -> Any:
    """The files' tokens: bytes without a tokenizer, else the cached token file under it (built by
    one process per node while the others wait)."""
    from recipes import tokens

    tok_dir = resolve_tokenizer(args)
    if tok_dir is None:
        if vocab < 256:
            raise SystemExit("byte-level text needs a vocabulary of at least 256; give --tokenizer")
        data = tokens.byte_tokens(files)
        log(f"data: {len(files)} file(s), {len(data)} byte tokens (no tokenizer)")
        return data
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    if len(tokenizer) > vocab:
        raise SystemExit(f"--tokenizer {tok_dir}: {len(tokenizer)} tokens do not fit the model's vocabulary of {vocab}")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank == 0:
        built = tokens.build_token_file(files, tokenizer, args.data_cache)
    dist.barrier()
    if local_rank != 0:
        built = tokens.build_token_file(files, tokenizer, args.data_cache, build=False)
    dist.barrier()
    verb = "reusing token cache" if built.reused else "tokenized into"
    log(f"data: {len(files)} file(s), {built.num_tokens} tokens, {verb} {built.path}")
    return built.open()


def load_data(args: argparse.Namespace, vocab: int, dp_size: int, dp_rank: int) -> Any:
    """The run's batches: synthetic, or the tokens of the training files with the held-out ones
    (:func:`data_files`)."""
    from recipes import tokens

    if args.synthetic:
        return Synthetic(vocab, args.seq_len, args.batch_size, dp_size, dp_rank, args.seed)
    train_files, eval_files = data_files(args)
    data = tokenize(train_files, args, vocab)
    held = None if eval_files is None else tokenize(eval_files, args, vocab)
    try:
        packed = tokens.PackedData(
            data, args.seq_len, args.batch_size, dp_size, dp_rank, args.seed, args.eval_fraction, held
        )
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    if args.eval_every > 0 and packed.num_eval < dp_size:
        fix = "give more held-out text" if held is not None else "raise --eval-fraction or give more data"
        raise SystemExit(
            f"--eval-every: {packed.num_eval} held-out sequences, fewer than the {dp_size} data-parallel ranks; {fix}"
        )
    log(f"data: {packed.num_train} training and {packed.num_eval} held-out sequences of {args.seq_len} tokens")
    return packed


def dp_coords(plugin: Any) -> tuple[int, int]:
    group = getattr(plugin, "dp_group", None)
    return dist.get_world_size(group), dist.get_rank(group)


# ---- dry run ---------------------------------------------------------------------------------
def dry_run(args: argparse.Namespace) -> dict[str, Any]:
    """The layout a launch would use, from the lazily built model (nothing allocated): plugin and
    grid, working parameters per rank (tensor-parallel shards of the linear and embedding
    weights, the decoder layers split over pipeline stages as ColossalAI distributes them), and
    the optimizer with the class the booster swaps it for."""
    from dist_optim.registry import class_path, lookup

    world = args.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    grid = args.tp * args.pp * args.sp
    if world % grid:
        raise SystemExit(f"--world-size {world} is not a multiple of tp x pp x sp = {grid}")
    dp = world // grid
    config, weights = model_config(args.model)
    check_layout(config, args)
    # the paths given are checked; the default books are not needed to plan a layout
    for paths, flag in ((args.data, "--data"), (args.eval_data, "--eval-data")):
        if paths and not args.synthetic:
            expand(paths, flag)
    model = build_model(config, args.seed, lazy=True, attn="eager")
    total = sum(p.numel() for p in model.parameters())
    layers = config.num_hidden_layers
    # ColossalAI's PipelineStageManager.distribute_layers: equal shares, the remainder to the
    # middle stages.
    per_stage = [layers // args.pp] * args.pp
    middle = args.pp // 2 - (layers % args.pp) // 2
    for i in range(middle, middle + layers % args.pp):
        per_stage[i] += 1
    sharded = 1 if args.plugin != "hybrid" else args.tp

    def count(prefix: str) -> tuple[int, int]:
        """(sharded, replicated) parameter counts under ``prefix``: matrices and the q/k/v biases
        (Qwen2's, split with their column-parallel projections) split over TP; norms and a
        Mixtral's experts (HybridParallelPlugin shards only attention and the router) replicated.
        A tied embedding is one parameter (named_parameters), counted once, with the embedding."""
        split = rep = 0
        for name, p in model.named_parameters():
            if name.startswith(prefix):
                if (p.dim() >= 2 or name.endswith("_proj.bias")) and ".experts." not in name:
                    split += p.numel()
                else:
                    rep += p.numel()
        return split, rep

    layer_split, layer_rep = count("model.layers.0.")
    stage_params = []
    for stage, n_layers in enumerate(per_stage):
        n = n_layers * (layer_split // sharded + layer_rep)
        if stage == 0:
            n += sum(x // s for x, s in zip(count("model.embed_tokens."), (sharded, 1)))
        if stage == args.pp - 1:
            for prefix in ("model.norm.", "lm_head."):
                split, rep = count(prefix)
                n += split // sharded + rep
        stage_params.append(n)
    if args.plugin == "fsdp":
        stage_params = [-(-total // world)]  # every unit's flat parameter cut into equal pieces
    cls, _ = optimizer_class(args.optimizer)
    conv = lookup(cls)
    swapped = class_path(conv.target) if conv is not None else f"{class_path(cls)} (unchanged)"
    info = {
        "model": args.model,
        "pretrained": weights,
        "parameters": total,
        "plugin": args.plugin,
        "world": world,
        "tp": args.tp if args.plugin == "hybrid" else 1,
        "pp": args.pp,
        "sp": args.sp,
        "dp": dp,
        "zero": args.zero,
        "precision": args.precision,
        "params_per_rank": stage_params,
        "optimizer": class_path(cls),
        "swapped_for": swapped,
    }
    log(
        f"dry run: model {args.model} ({total / 1e6:.2f}M parameters"
        f"{', weights from ' + weights if weights else ', from scratch'}), plugin {args.plugin} "
        f"world={world} tp={info['tp']} pp={args.pp} sp={args.sp} dp={dp} zero={args.zero} {args.precision}"
    )
    for stage, n in enumerate(stage_params):
        log(
            f"dry run: pipeline stage {stage}: {n / 1e6:.2f}M working parameters per rank "
            f"({n * 4 / 2**30:.2f} GiB in fp32, before vocabulary padding)"
        )
    log(f"dry run: optimizer {class_path(cls)} -> {swapped}")
    info["plan"] = dry_run_plan(args, config, dp)
    return info


def dry_run_plan(args: argparse.Namespace, config: Any, dp: int) -> dict[str, Any] | None:
    """The optimizer's memory and communication plan for these arguments (``dist_optim.plan``:
    simulated on meta tensors, nothing allocated), printed; None where the planner does not
    cover the layout or the optimizer (said in the log)."""
    from dist_optim.plan import OPTIMIZERS, Layout, PlanError, Workload, format_plan, make_plan

    name, options = planner_name(args.optimizer), args.optimizer_args
    if name is None:
        log(
            f"dry run: no plan: {args.optimizer} is not among the planner's optimizers ({', '.join(OPTIMIZERS)}) "
            "nor converted to one of them"
        )
        return None
    if name != args.optimizer:
        log(f"dry run: planned as {name!r}, the optimizer the booster swaps {args.optimizer} for, with its defaults")
        options = {}
    try:
        layout = Layout(
            args.plugin, tp=args.tp, pp=args.pp, zero=args.zero, dp=dp, precision=args.precision, sp=args.sp
        )
        # The micro-batch these flags run; the attention the job gets on GPUs without flash-attn
        # unless --attn says otherwise (a dry run plans the GPU job wherever it runs).
        work = Workload(args.seq_len, args.batch_size, args.grad_checkpoint > 0, args.attn or "sdpa")
        # Rank 0, the busiest owner and each stage's first rank, as the planner does for worlds
        # above 8 ranks: a dry run of 7B at 8 ranks took a minute with every rank simulated.
        plan = make_plan(config, layout, name, options, workload=work, all_ranks_up_to=1)
    except PlanError as exc:
        log(f"dry run: no plan: {exc}")
        return None
    log(format_plan(plan))
    if layout.world > 1:
        log("dry run: every rank simulated: python -m dist_optim.plan with the same model, layout and --optimizer")
    return plan.to_json()


def planner_name(optimizer: str) -> str | None:
    """The planner's name for ``--optimizer``: a short name it knows, or the one of the class the
    booster swaps an ordinary optimizer for (``colossalai.nn.optimizer.Lamb`` -> ``lamb``; torch's
    AdamW, kept as it is, -> ``adamw``); None where it has none."""
    from dist_optim.plan import OPTIMIZERS
    from dist_optim.registry import lookup

    if optimizer in OPTIMIZERS:
        return optimizer
    try:
        cls, _ = optimizer_class(optimizer)
    except SystemExit:
        return None
    conv = lookup(cls)
    target = conv.target if conv is not None else cls
    return next((name for name, entry in OPTIMIZERS.items() if entry.target is target), None)


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
CSV_FIELDS = ["step", "loss", "lr", "seconds", "tokens_per_s", "mfu", "peak_mem_gib", "peak_mem_gib_per_rank"]
CSV_FIELDS += ["eval_loss"]


class MetricsLog:
    """The CSV and TensorBoard sinks (rank 0)."""

    def __init__(self, args: argparse.Namespace, start: int) -> None:
        self.file = self.writer = self.board = None
        if not is_main():
            return
        if args.log_csv:
            os.makedirs(os.path.dirname(os.path.abspath(args.log_csv)), exist_ok=True)
            fresh = not (args.resume and os.path.exists(args.log_csv))
            self.file = open(args.log_csv, "w" if fresh else "a", newline="")  # noqa: SIM115 - closed in close()
            self.writer = csv.DictWriter(self.file, CSV_FIELDS)
            if fresh:
                self.writer.writeheader()
        if args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.board = SummaryWriter(args.tensorboard, purge_step=start + 1 if args.resume else None)

    def write(self, entry: dict[str, Any]) -> None:
        if self.writer is not None:
            row = {
                "step": entry["step"],
                "loss": f"{entry['loss']:.6f}",
                "lr": f"{entry['lr']:.6g}",
                "seconds": f"{entry['seconds']:.4f}",
                "tokens_per_s": f"{entry['tokens_per_s']:.1f}",
                "mfu": "" if entry["mfu"] is None else f"{entry['mfu']:.4f}",
                "peak_mem_gib": f"{max(entry['peak_mem_gib']):.3f}",
                "peak_mem_gib_per_rank": " ".join(f"{m:.3f}" for m in entry["peak_mem_gib"]),
                "eval_loss": "" if entry.get("eval_loss") is None else f"{entry['eval_loss']:.6f}",
            }
            self.writer.writerow(row)
            self.file.flush()  # a log that can be followed while the run goes on
        if self.board is not None:
            step = entry["step"]
            for key in ("loss", "lr", "seconds", "tokens_per_s"):
                self.board.add_scalar(f"train/{key}", entry[key], step)
            if entry["mfu"] is not None:
                self.board.add_scalar("train/mfu", entry["mfu"], step)
            for rank, mem in enumerate(entry["peak_mem_gib"]):
                self.board.add_scalar(f"memory/peak_gib_rank{rank}", mem, step)
            if entry.get("eval_loss") is not None:
                self.board.add_scalar("eval/loss", entry["eval_loss"], step)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.board is not None:
            self.board.close()


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

    device = launch(args.seed) if not dist.is_initialized() else _current_device()
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
        loss_value = _global_loss(loss, plugin)
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
        entry.update(_clip_metrics(optimizer))
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


def _clip_metrics(optimizer: Any) -> dict[str, float]:
    """With QK-clip on (``--optimizer-args '{"qk_clip_tau": ...}'``), ``max_attention_logit``: the
    largest attention logit of the step over every head of the model (each rank holds its heads and
    layers), on every rank; else nothing."""
    inner = getattr(optimizer, "optim", optimizer)
    if getattr(inner, "qk_clip_tau", None) is None:
        return {}
    found = [m.values.max() for m in inner.last_max_logits.values()]
    value = torch.stack(found).max().float() if found else torch.tensor(-math.inf)
    value = value.reshape(1).to(_current_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return {"max_attention_logit": float(value)}


def _global_loss(loss: torch.Tensor | None, plugin: Any) -> float:
    """The mean loss over data-parallel ranks (on the last pipeline stage), on every rank."""
    value = torch.zeros(2, dtype=torch.float64)
    if loss is not None:
        value[0] = float(loss.detach().float())
        value[1] = 1.0
    value = value.to(_current_device())  # NCCL reduces device tensors only
    dist.all_reduce(value)
    return float(value[0] / value[1].clamp_min(1))


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
