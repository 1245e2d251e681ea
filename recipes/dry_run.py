"""``--dry-run``: the layout a launch would use and the optimizer's plan, from the planner
(:mod:`dist_optim.plan`), nothing allocated."""

from __future__ import annotations

import argparse
import os
from typing import Any

from recipes.building import build_model, check_layout, model_config, optimizer_class
from recipes.data import expand
from recipes.env import log


def dry_run(args: argparse.Namespace) -> dict[str, Any]:
    """The layout a launch would use, nothing allocated: plugin and grid, the parameters each rank
    holds by pipeline stage (the planner's sharding of the meta model, ColossalAI's own:
    :func:`dist_optim.plan.held_parameters`), the optimizer with the class the booster swaps it
    for, and the optimizer's plan (:func:`dry_run_plan`)."""
    from dist_optim.plan import Layout, PlanError, held_parameters
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
    total = sum(p.numel() for p in build_model(config, args.seed, lazy=True, attn="eager").parameters())
    try:
        layout = Layout(
            args.plugin, tp=args.tp, pp=args.pp, zero=args.zero, dp=dp, precision=args.precision, sp=args.sp
        )
        held = held_parameters(config, layout)
    except PlanError as exc:
        raise SystemExit(f"dry run: {exc}") from None
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
        "params_per_rank": held,
        "optimizer": class_path(cls),
        "swapped_for": swapped,
    }
    log(
        f"dry run: model {args.model} ({total / 1e6:.2f}M parameters"
        f"{', weights from ' + weights if weights else ', from scratch'}), plugin {args.plugin} "
        f"world={world} tp={info['tp']} pp={args.pp} sp={args.sp} dp={dp} zero={args.zero} {args.precision}"
    )
    for stage, n in enumerate(held):
        log(f"dry run: pipeline stage {stage}: {n / 1e6:.2f}M parameters per rank ({n * 4 / 2**30:.2f} GiB in fp32)")
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
