"""What a run is built of: the model (a preset or a Hugging Face directory), the optimizer (one of
ours by short name, with its recommended settings, or any importable class), the booster's plugin,
the learning-rate schedule and activation checkpointing."""

from __future__ import annotations

import argparse
import importlib
import math
import os
from typing import Any

import torch

from dist_optim.registry import catalogue

# name: (hidden, intermediate, layers, heads, kv_heads, vocab)
PRESETS: dict[str, tuple[int, int, int, int, int, int]] = {
    "tiny": (64, 128, 2, 4, 4, 256),
    "small": (256, 688, 4, 8, 8, 256),
    "1b": (2048, 5504, 22, 32, 4, 32000),
    "7b": (4096, 11008, 32, 32, 32, 32000),
}

#: Our optimizers by short name: the class and the options the recipe builds it with (the
#: catalogue's, dist_optim.registry.catalogue; docs/convergence.md says why each is set so).
OURS = {name: (entry.target, dict(entry.recommended)) for name, entry in catalogue().items()}


WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


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
    """The class of ``--optimizer`` (one of :data:`OURS` or an import path) and its recipe options."""
    if name in OURS:
        cls, kwargs = OURS[name]
        return cls, dict(kwargs)
    return _import(name), {}


def build_optimizer(
    name: str, model: torch.nn.Module, lr: float, extra: dict[str, Any] | None = None
) -> torch.optim.Optimizer:
    """``--optimizer`` over ``model``'s parameters, ``extra`` (``--optimizer-args``) over its recipe
    options; one of ours that needs param groups gets them from its catalogue builder, with the
    options the builder names (GaLore's ``rank``, Muon's ``per_head``)."""
    cls, kwargs = optimizer_class(name)
    entry = catalogue().get(name)
    if entry is None or entry.param_groups is None:
        return cls(model.parameters(), lr=lr, **{**kwargs, **(extra or {})})
    builder_args, options = entry.split({**kwargs, **(extra or {})})
    return cls(entry.param_groups(model, **builder_args), lr=lr, **options)


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
