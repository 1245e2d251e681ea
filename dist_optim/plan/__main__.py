"""Command line of the planner: ``python -m dist_optim.plan --help``."""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import (
    ALLOCATOR_MARGIN,
    COLUMNS,
    MODELS,
    OPTIMIZERS,
    SWEEP_LAYOUTS,
    Layout,
    PlanError,
    check_model_layout,
    format_plan,
    format_sweep,
    load_config,
    make_plan,
    parse_bytes,
    stage_activations,
)
from .activations import ATTENTION, Workload
from .sweep import format_layout_sweep, sweep
from .world import ChunkSearch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m dist_optim.plan",
        description="Simulate one optimizer step of a ColossalAI Llama job: memory per rank, collectives, bytes sent.",
    )
    ap.add_argument(
        "--model", default="llama-7b", help=f"{', '.join(MODELS)}, or a Llama model directory or its config.json"
    )
    ap.add_argument(
        "--plugin",
        default="hybrid",
        help="hybrid, zero (LowLevelZeroPlugin), ddp, fsdp (TorchFSDPPlugin, a unit per decoder layer) or gemini "
        '(GeminiPlugin, placement_policy="static" without offload)',
    )
    ap.add_argument(
        "--min-chunk-size-m", type=float, default=None, help="with --plugin gemini: GeminiPlugin's (default 32)"
    )
    ap.add_argument(
        "--search-range-m", type=float, default=None, help="with --plugin gemini: GeminiPlugin's (default 32)"
    )
    ap.add_argument(
        "--hidden-dim", type=int, default=None, help="with --plugin gemini: GeminiPlugin's chunk search step (1024)"
    )
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument(
        "--pp-style", default="1f1b", help="pipeline schedule, HybridParallelPlugin's pp_style: 1f1b or interleaved"
    )
    ap.add_argument(
        "--num-model-chunks", type=int, default=1, help="layer chunks per stage with --pp-style interleaved (K >= 2)"
    )
    ap.add_argument("--zero", type=int, default=0)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--sp", type=int, default=1, help="sequence-parallel size, all_to_all mode (the recipe's --sp)")
    ap.add_argument("--precision", default="bf16", help="fp32, bf16 or fp16")
    ap.add_argument(
        "--cpu-offload",
        action="store_true",
        help="ZeRO's cpu_offload: masters, gradients' fp32 copies and the optimizer in host memory (needs --zero)",
    )
    ap.add_argument("--optimizer", default="adamw", help=", ".join(OPTIMIZERS))
    ap.add_argument(
        "--optimizer-args",
        default="{}",
        help="constructor options as JSON, e.g. '{\"lr\": 0.01}'; a configuration object as "
        '\'{"grafting_config": {"AdamGraftingConfig": {"beta2": 0.999}}}\'',
    )
    ap.add_argument("--gpu-memory", default=None, help="memory per GPU, e.g. 80GiB: says whether the plan fits")
    ap.add_argument(
        "--memory-margin",
        type=float,
        default=ALLOCATOR_MARGIN,
        help=f"share of --gpu-memory kept free for the allocator's fragmentation and workspaces "
        f"(default {ALLOCATOR_MARGIN})",
    )
    ap.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (as the recipe's flag)")
    ap.add_argument(
        "--batch-size", type=int, default=1, help="sequences per data-parallel rank and micro-batch (the recipe's)"
    )
    ap.add_argument(
        "--grad-checkpoint", action="store_true", help="activation checkpointing of every decoder layer (the recipe's)"
    )
    ap.add_argument("--attn", default="sdpa", help=f"attention kernel as the recipe's --attn: {', '.join(ATTENTION)}")
    ap.add_argument(
        "--no-activations", action="store_true", help="skip the forward/backward simulation (state and step only)"
    )
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps to simulate (at least 2)")
    ap.add_argument("--device", default="cuda", help="the device type simulated: cuda (default) or cpu")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="every tp x pp x dp x ZeRO x checkpointing layout of the --tp x --pp x --dp GPUs for --optimizer, "
        "ranked by bytes sent per step among those that fit --gpu-memory",
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="processes a --sweep plans its layouts in (default: every CPU this process may use)",
    )
    ap.add_argument(
        "--compare-optimizers",
        action="store_true",
        help="every optimizer x a few fixed layouts of the --tp x --dp GPUs, as a table (state, transient, traffic)",
    )
    return ap.parse_args(argv)


def _optimizer_args(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanError(f"--optimizer-args {text!r}: not JSON ({exc}); e.g. '{{\"lr\": 0.01}}'") from exc
    if not isinstance(value, dict):
        raise PlanError(f"--optimizer-args {text!r}: a JSON object of keyword arguments, e.g. '{{\"lr\": 0.01}}'")
    return {key: _config_object(key, v) for key, v in value.items()}


def _config_object(key: str, value: object) -> object:
    """A configuration object spelled in JSON as ``{"<class>": {<its arguments>}}`` for a
    ``*Config`` class of dist_optim (Shampoo's ``grafting_config``, e.g.
    ``{"AdamGraftingConfig": {"beta2": 0.999, "epsilon": 1e-8}}``); any other value as it is."""
    if not (isinstance(value, dict) and len(value) == 1):
        return value
    ((name, kwargs),) = value.items()
    if not name.endswith("Config"):
        return value
    import dist_optim

    cls = getattr(dist_optim, name, None)
    if not isinstance(cls, type) or not isinstance(kwargs, dict):
        raise PlanError(
            f"--optimizer-args {key}={value!r}: {name!r} is not a dist_optim configuration class with its "
            'arguments, e.g. {"AdamGraftingConfig": {"beta2": 0.999, "epsilon": 1e-8}}'
        )
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise PlanError(f"--optimizer-args {key}={value!r}: {exc}") from exc


def _chunk_search(a: argparse.Namespace) -> ChunkSearch:
    """GeminiPlugin's chunk search options given on the command line, its defaults for the rest."""
    given = {k: getattr(a, k) for k in ("min_chunk_size_m", "search_range_m", "hidden_dim")}
    return ChunkSearch(**{k: v for k, v in given.items() if v is not None})


def _fits_heads(config: object, tp: int) -> bool:
    """Whether ColossalAI can split ``config``'s heads over ``tp`` ranks (a sweep skips the others)."""
    try:
        check_model_layout(config, tp)
    except PlanError:
        return False
    return True


def run(argv: list[str] | None = None) -> str:
    """The planner's output for ``argv`` (raises :class:`PlanError` on bad input)."""
    a = parse_args(argv)
    args = _optimizer_args(a.optimizer_args)
    gpu = parse_bytes(a.gpu_memory) if a.gpu_memory else None
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if not a.json else None
    work = None if a.no_activations else Workload(a.seq_len, a.batch_size, a.grad_checkpoint, a.attn)
    if a.sweep:
        if gpu is None or work is None:
            raise PlanError(
                "--sweep ranks the layouts that fit: give --gpu-memory (e.g. 80GiB), without --no-activations"
            )
        plans = sweep(
            a.model, a.tp * a.pp * a.dp, a.optimizer, args, work, gpu, a.precision, a.steps, a.device,
            a.memory_margin, log, a.jobs,
        )  # fmt: skip
        if a.json:
            return json.dumps([p.to_json() for p in plans], indent=1)
        note = (
            f"{a.model}, {a.tp * a.pp * a.dp} GPUs of {gpu / 1e9:.1f} GB ({a.memory_margin:.0%} margin), "
            f"optimizer {a.optimizer}, {work.describe()} (with stages: micro-batches of one sequence); each "
            "layout simulated on rank 0, the busiest owner and each stage's first rank"
        )
        return note + "\n\n" + format_layout_sweep(plans)
    if a.compare_optimizers:
        world = a.tp * a.dp * a.pp
        config = load_config(a.model)
        plans = []
        for plugin, tp, zero, precision in SWEEP_LAYOUTS:
            if world % tp or not _fits_heads(config, tp):
                continue
            layout = Layout(plugin, tp=tp, zero=zero, dp=world // tp, precision=precision)
            acts = stage_activations(config, layout, work, a.device) if work is not None else None
            for name in COLUMNS:
                plans.append(
                    make_plan(
                        a.model,
                        layout,
                        name,
                        args if name == a.optimizer else {},
                        a.steps,
                        gpu_memory=gpu,
                        log=log,
                        device=a.device,
                        workload=work,
                        margin=a.memory_margin,
                        activations=acts,
                    )  # fmt: skip
                )
        if a.json:
            return json.dumps([p.to_json() for p in plans], indent=1)
        return format_sweep(plans)
    layout = Layout(
        a.plugin, tp=a.tp, pp=a.pp, zero=a.zero, dp=a.dp, ep=a.ep, precision=a.precision, sp=a.sp,
        pp_style=a.pp_style, num_model_chunks=a.num_model_chunks, cpu_offload=a.cpu_offload,
        chunk_search=_chunk_search(a),
    )  # fmt: skip
    plan = make_plan(
        a.model, layout, a.optimizer, args, a.steps, gpu_memory=gpu, log=log, device=a.device, workload=work,
        margin=a.memory_margin,
    )  # fmt: skip
    return json.dumps(plan.to_json(), indent=1) if a.json else format_plan(plan)


def main(argv: list[str] | None = None) -> None:
    # ColossalAI's import brings bitsandbytes, whose torch.compile decorators start torch inductor's
    # pool of compile processes where Triton is installed; a plan compiles nothing, and on a machine
    # of few cores those processes' imports take cores from the simulation.
    os.environ.setdefault("TORCH_WARM_POOL", "0")
    try:
        print(run(argv))
    except PlanError as exc:
        raise SystemExit(f"dist_optim.plan: {exc}") from None


if __name__ == "__main__":
    main()
