"""``python -m dist_optim.plan --sweep``: every layout of a world of N GPUs for one model, optimizer
and micro-batch (tp x pp x dp x ZeRO x activation checkpointing on HybridParallelPlugin, and FSDP's
full shard and Gemini's static placement over every rank), each planned as
:func:`dist_optim.plan.make_plan` plans it, ranked by the bytes a rank sends per training step among
the layouts that fit the GPU's memory.

A sweep runs many plans, so it shares what layouts have in common: the optimizer is simulated once
per (tp, pp, dp) without ZeRO and once with it (ZeRO-1 and ZeRO-2 hand it the same shards:
:func:`dist_optim.plan.simulate.sharing_zero_stages`), the activations once per (tp, pp) stage that
holds unlike the others, with and without checkpointing on one split model
(:func:`dist_optim.plan.activations.stage_activations_each`), and each plan simulates rank 0, the
busiest owner and the first rank of every stage (not every rank of a small world). The layouts of
one (tp, pp) share their activations, so each such group is one task; the tasks are independent and
run in ``jobs`` processes (spawned: a forked simulator would inherit the parent's thread pools).
Within a plan, the stages between the first and the last hold alike and are simulated once
(:func:`dist_optim.plan.simulate.stage_twin_key`). What a sweep costs: ``/usr/bin/time python -m
dist_optim.plan --model llama-70b --tp 8 --dp 8 --batch-size 8 --gpu-memory 80GiB --optimizer
shampoo --sweep``.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from . import GB, Plan, PlanError, make_plan, rank_total
from .activations import ALLOCATOR_MARGIN, Activations, Workload, stage_activations_each
from .models import check_model_layout, load_config
from .simulate import sharing_zero_stages
from .world import Layout

__all__ = ["candidate_layouts", "sweep", "task_cost", "rank_plans", "with_activations", "format_layout_sweep"]

#: Sizes tried for tensor and pipeline parallelism (within one 8-GPU node for TP, as usual).
TP_SIZES = (1, 2, 4, 8)
PP_SIZES = (1, 2, 4, 8)


def candidate_layouts(config: Any, world: int, precision: str, batch_size: int) -> list[Layout]:
    """The HybridParallelPlugin layouts of ``world`` ranks the model and ColossalAI accept: TP
    dividing the heads, no more stages than layers nor than the micro-batches of a step, ZeRO 0-2
    (0-1 with stages) where there is data parallelism to shard over; then TorchFSDPPlugin over all
    ``world`` ranks (fp32 or bf16: its plugin has no loss scaling for fp16) and GeminiPlugin's static
    placement with its default chunk search (bf16 or fp16; not a mixture of experts, which it
    refuses)."""
    out = []
    for tp in TP_SIZES:
        for pp in PP_SIZES:
            if world % (tp * pp) or pp > batch_size and pp > 1:
                continue
            try:
                check_model_layout(config, tp, pp)
            except PlanError:
                continue
            dp = world // (tp * pp)
            zeros = (0,) if dp == 1 or precision == "fp32" else ((0, 1) if pp > 1 else (0, 1, 2))
            out += [Layout("hybrid", tp=tp, pp=pp, dp=dp, zero=z, precision=precision) for z in zeros]
    if world > 1 and precision != "fp16":
        out.append(Layout("fsdp", dp=world, precision=precision))
    if world > 1 and precision != "fp32" and not getattr(config, "num_local_experts", None):
        out.append(Layout("gemini", dp=world, precision=precision))
    return out


def task_cost(layouts: Sequence[Layout]) -> float:
    """A rough relative cost of a task of ``layouts`` (one tp x pp). Per layout, rank 0 and the
    busiest owner are simulated, with stages also the first, last and one middle stage's first ranks
    (twins; ZeRO-2 is answered by ZeRO-1), each over its stage's share of the model; the first,
    last and one middle stage's activations are simulated on a whole meta model split anew (a fixed
    cost per stage, a quarter of a whole-model optimizer step; Gemini's chunk gathers add one). Only
    the order matters: the longest tasks first shorten a sweep in a few processes."""
    first = layouts[0]
    ranks = sum(2 + min(layout.pp, 3) * (layout.pp > 1) for layout in layouts if layout.zero < 2)
    split = min(first.pp, 3) * first.num_model_chunks + (1 if first.plugin == "gemini" else 0)
    return ranks / first.pp + split / 4


def with_activations(plan: Plan, workload: Workload, acts: dict[int, Activations]) -> Plan:
    """``plan`` (simulated without activations) with ``acts`` by stage: its busiest rank re-chosen
    by peak, activations included."""
    top = max(plan.ranks, key=lambda r: (rank_total(r, acts[plan.layout.stage_of(r.rank)]), -r.rank))
    return dataclasses.replace(plan, busiest=top, workload=workload, stage_activations=acts)


def _plan_group(
    config: Any,
    name: str,
    layouts: list[Layout],
    optimizer: str,
    args: dict[str, Any],
    workload: Workload,
    options: dict[str, Any],
    log: Callable[[str], None] | None = None,
) -> list[Plan]:
    """The plans of ``layouts`` (one tp x pp: their activations are shared), with and without
    checkpointing."""
    say = log or (lambda _: None)
    plans = []
    works = [dataclasses.replace(workload, grad_checkpoint=ckpt) for ckpt in (False, True)]
    acts: list[dict[int, Activations]] = []
    with sharing_zero_stages():  # a ZeRO-2 layout's ranks are its ZeRO-1 layout's to the optimizer
        for layout in layouts:
            say(f"planning {layout.describe()}")
            base = make_plan(config, layout, optimizer, args, all_ranks_up_to=1, **options)
            base = dataclasses.replace(base, model=name)
            acts = acts or stage_activations_each(config, layout, works, options["device"], say)
            plans += [with_activations(base, work, stage) for work, stage in zip(works, acts)]
    return plans


def sweep(
    model: Any,
    world: int,
    optimizer: str,
    args: dict[str, Any],
    workload: Workload,
    gpu_memory: int,
    precision: str = "bf16",
    steps: int = 3,
    device: str = "cuda",
    margin: float = ALLOCATOR_MARGIN,
    log: Callable[[str], None] | None = None,
    jobs: int | None = None,
) -> list[Plan]:
    """Every candidate layout with and without checkpointing, planned; sorted with the layouts that
    fit first, by bytes sent per training step, then by peak memory. ``jobs``: processes to plan in
    (default: the CPUs this process may use); 1 plans in this process."""
    config = load_config(model)
    name = model if isinstance(model, str) else "config"
    groups: dict[tuple[str, int, int], list[Layout]] = {}
    for layout in candidate_layouts(config, world, precision, workload.batch_size):
        groups.setdefault((layout.plugin, layout.tp, layout.pp), []).append(layout)
    options = dict(steps=steps, gpu_memory=gpu_memory, device=device, margin=margin)
    # The longest tasks first, so that no process is left with a long one when the others are done.
    ordered = sorted(groups.values(), key=task_cost, reverse=True)
    tasks = [(config, name, layouts, optimizer, args, workload, options) for layouts in ordered]
    if jobs is None:
        jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if jobs < 1:
        raise PlanError(f"--jobs {jobs}: plan in at least one process")
    jobs = min(jobs, len(tasks))
    if jobs == 1:
        return rank_plans([p for task in tasks for p in _plan_group(*task, log=log)])
    say = log or (lambda _: None)
    say(f"planning {sum(len(t[2]) for t in tasks)} layouts in {jobs} processes")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        done = list(pool.map(_plan_group, *zip(*tasks)))
    return rank_plans([p for plans in done for p in plans])


def rank_plans(plans: Sequence[Plan]) -> list[Plan]:
    """The layouts that fit first (peak within the GPU's memory less the margin), each part by
    bytes sent per training step, then by peak."""
    return sorted(plans, key=lambda p: (p.total > (p.usable or 0), p.step_traffic["total"], p.total))


def format_layout_sweep(plans: Sequence[Plan]) -> str:
    """One row per layout: fits, peak memory, GB left, bytes sent per step by source."""
    head = (
        "| rank | layout | checkpointing | fits | peak GB/rank | GB left | activations GB | optimizer state GB | "
        "GB sent/step | model | gradients | pipeline | optimizer |"
    )
    rows = [head, "|" + "---|" * 13]
    for i, p in enumerate(plans, 1):
        t, a, w = p.step_traffic, p.activations, p.workload
        left = (p.usable or 0) - p.total
        rows.append(
            f"| {i} | {p.layout.describe()} | {'yes' if w is not None and w.grad_checkpoint else 'no'} | "
            f"{'yes' if left >= 0 else 'no'} | {p.total / GB:.2f} | {left / GB:.2f} | "
            f"{(a.schedule_peak if a else 0) / GB:.2f} | {p.busiest.optimizer_state / GB:.2f} | "
            f"{t['total'] / GB:.2f} | {t.get('model', 0) / GB:.2f} | {t['gradients'] / GB:.2f} | "
            f"{t.get('pipeline', 0) / GB:.2f} | {t['optimizer'] / GB:.2f} |"
        )
    return "\n".join(rows)
