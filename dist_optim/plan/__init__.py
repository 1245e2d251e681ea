"""``python -m dist_optim.plan``: will a Llama run fit, and what does an optimizer step cost?

The plan is the simulation of the code that runs (:mod:`dist_optim.plan.simulate`): rank 0 of the
job, then the rank the optimizer's own owner assignment loads most, each through a few optimizer
steps on meta tensors over ``fake`` process groups of the job's world size. Every figure says
whether it was simulated or derived (:data:`NOT_SIMULATED` lists what the planner does not run).

This module imports ColossalAI (its ShardFormer splits the model): it is a tool beside the core,
like ``dist_optim.plugins``, and the optimizers never import it.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from fractions import Fraction
from typing import Any, cast

from .activations import ALLOCATOR_MARGIN, Activations, Workload, stage_activations_each
from .gemini import gemini_rank_plan
from .models import MODELS, PlanError, check_model_layout, load_config
from .simulate import (
    COLUMNS,
    OPTIMIZERS,
    Layout,
    RankResult,
    held_parameters,
    ideal_share,
    simulate_rank,
    single_device_state,
    stage_twin_key,
)

__all__ = [
    "Layout",
    "PlanError",
    "Plan",
    "RankPlan",
    "make_plan",
    "format_plan",
    "fsdp_gathered",
    "format_sweep",
    "parse_bytes",
    "MODELS",
    "check_model_layout",
    "OPTIMIZERS",
    "COLUMNS",
    "held_parameters",
    "NOT_SIMULATED",
    "SWEEP_LAYOUTS",
    "Workload",
    "stage_activations",
    "rank_total",
    "load_config",
    "Activations",
    "ALLOCATOR_MARGIN",
]

GB = 1e9

#: What the planner does not run, printed with every plan.
NOT_SIMULATED = (
    "ColossalAI's own collectives: those of the forward and backward (TP layers, the loss) simulated with the "
    "activations; the gradient reduction, ZeRO's parameter all-gather and the pipeline's sends derived "
    "(Plan.step_traffic)",
    "activations: one micro-batch's forward and backward of the sharded meta model (dist_optim.plan.activations); "
    "memory a kernel frees before returning (workspaces) and the allocator's fragmentation are not counted: "
    "the verdict keeps a margin for them",
    "ZeRO padding and chunking: LowLevelZero's rule (-numel mod ZeRO size), derived, checked by ParamLayout; "
    "FSDP's flat ranges: its layout rule (plugins/fsdp.py), derived, checked against FSDP in the tests; "
    "Gemini's chunks: ColossalAI's chunk search on the meta model, packed by its rule (plan/gemini.py), checked too",
    "working params, fp32 masters and gradients beside the optimizer: derived from ColossalAI's wrappers "
    "(ZeRO-0/1 keep working-precision gradients whole, ZeRO-2 only the fp32 chunk; torch DDP's buckets as "
    "large as the local parameters where the plugin wraps the model in DDP; FSDP's fp32 shards, their gradients, "
    "and the units it gathers in the forward and backward: plan.fsdp_gathered; Gemini's chunk shards, the fp32 "
    "gradients handed to the optimizer, chunks gathered in compute and their collectives: plan.gemini)",
    "values that depend on tensor contents (.item() of a meta tensor): answered 0 / True; iterations run to "
    "their limit, NaN checks find none",
    "mixture of experts: routing balanced (every expert tokens x top_k / experts; a real router's busiest expert "
    "holds and receives more); expert parallelism (--ep) without --pp or --sp; sequence parallelism: the recipe's "
    "all_to_all mode only; pipeline stages: the 1F1B and interleaved schedules (not zbv); the interleaved one "
    "checked against runs with overlap_p2p=False (gloo hangs with ColossalAI's default True)",
)

#: The layouts of ``--sweep`` for a world of N ranks: (plugin, tp, zero, precision).
SWEEP_LAYOUTS: tuple[tuple[str, int, int, str], ...] = (
    ("hybrid", 8, 0, "bf16"),
    ("hybrid", 8, 1, "bf16"),
    ("hybrid", 2, 1, "bf16"),
    ("zero", 1, 2, "bf16"),
)


@dataclass
class RankPlan:
    """Bytes per rank (simulated unless said) and one step's traffic."""

    rank: int
    working_params: int  # derived: the TP slices in working precision
    fp32_masters: int  # derived: separate fp32 masters (0 when the working params are the masters)
    gradients: int  # derived: fp32 master gradients + working-precision gradients ColossalAI keeps
    optimizer_state: int  # simulated: every tensor in optimizer.state
    kept_buffers: int  # simulated: allocated by step() and kept beyond optimizer.state
    peak_transient: int  # simulated: the largest bytes alive inside one step() that it freed
    transient_step: int  # which simulated step reached it (1-based)
    steps: list[dict[str, Any]]  # per simulated step: collectives and bytes sent (also by kind), transient
    owner_load: float  # the optimizer's cost model: this rank's owned work
    ddp_buckets: int = 0  # derived: torch DDP's gradient buckets (Layout.uses_torch_ddp)
    #: Working-precision bytes of the parameters, each times ``(g-1)/g`` for the ``g`` ranks that
    #: reduce its gradient (its ZeRO group: the MoE data-parallel group for experts).
    reduced_share: float = 0.0
    #: ZeRO's CPU offload: masters, their gradients, the state and the step in host memory.
    offloaded: bool = False
    #: simulated: the device buffers of the largest collective staged from the host (offload)
    staged_peak: int = 0
    #: derived, FSDP: parameters gathered whole in working precision during forward and backward
    #: (:func:`fsdp_gathered`)
    fsdp_gathered: int = 0
    #: derived, Gemini (:func:`~dist_optim.plan.gemini.gemini_memory`): chunks gathered at once, bytes they
    #: send per training step without and with activation checkpointing
    gemini_gathered: int = 0
    gemini_sent: tuple[float, float] = (0.0, 0.0)

    @property
    def host_static(self) -> int:
        """Bytes kept in host memory across steps under CPU offload: the fp32 masters, their fp32
        gradients (ZeRO's copies of the reduced shards), the optimizer's state and kept buffers."""
        if not self.offloaded:
            return 0
        return 2 * self.fp32_masters + self.optimizer_state + self.kept_buffers

    @property
    def host_total(self) -> int:
        """Host memory at the step's peak (0 without offload)."""
        return self.host_static + self.peak_transient if self.offloaded else 0

    @property
    def device_transient(self) -> int:
        """The step's transient on the device: its own, or under offload only the staged buffers."""
        return self.staged_peak if self.offloaded else self.peak_transient

    @property
    def total(self) -> int:
        """Device bytes at the step's peak, before activations."""
        static = (
            self.working_params
            + self.fp32_masters
            + self.gradients
            + self.ddp_buckets
            + self.optimizer_state
            + self.kept_buffers
        )
        return static - self.host_static + self.device_transient


@dataclass
class Plan:
    model: str
    layout: Layout
    optimizer: str
    optimizer_args: dict[str, Any]
    busiest: RankPlan
    ranks: list[RankPlan]  # every simulated rank
    ideal_state: int  # single-device state / ranks sharing it
    single_device_state: int
    ideal_how: str
    owner_balance: float  # busiest / mean owned work (1.0 without owners)
    transient_option: str
    refresh_note: str
    seconds: float
    gpu_memory: int | None = None
    not_simulated: tuple[str, ...] = NOT_SIMULATED
    meta_items: int = 0
    workload: Workload | None = None
    #: By pipeline stage (0 without stages): the micro-batch on the stage's first rank (the ranks of
    #: a stage are alike: TP splits evenly, data-parallel ranks run the same shapes).
    stage_activations: dict[int, Activations] | None = None
    margin: float = ALLOCATOR_MARGIN
    hidden_size: int = 0

    @property
    def activations(self) -> Activations | None:
        """The activations of the busiest rank's stage."""
        if not self.stage_activations:
            return None
        return self.stage_activations[self.layout.stage_of(self.busiest.rank)]

    @property
    def total(self) -> int:
        """The busiest rank's peak: what stays across steps (parameters, masters, gradients, state,
        kept buffers) plus the larger of the step's transient and the activation peak of its
        schedule (the two never coexist: activations are freed by the end of the backward)."""
        return rank_total(self.busiest, self.activations)

    @property
    def usable(self) -> int | None:
        """The GPU memory the plan may fill: ``gpu_memory`` less the allocator margin."""
        return None if self.gpu_memory is None else int(self.gpu_memory * (1 - self.margin))

    @property
    def steady(self) -> dict[str, Any]:
        later = self.busiest.steps[1:] or self.busiest.steps
        return min(later, key=lambda s: (s["bytes_sent"], s["collectives"]))

    @property
    def refresh(self) -> dict[str, Any]:
        return max(self.busiest.steps, key=lambda s: (s["bytes_sent"], s["collectives"]))

    @property
    def step_traffic(self) -> dict[str, float]:
        """Bytes the busiest rank sends in one training step (steady optimizer step), by source:
        ``optimizer`` and ``model`` (the forward and backward's own collectives, per micro-batch
        times the micro-batches of a step) simulated; ``gradients`` (the plugin's gradient
        reduction over the data-parallel group of g ranks, in working-precision bytes W: DDP's
        all-reduce ``2 (g-1)/g W``; ColossalAI's ZeRO-1 all-reduces the gradients and all-gathers
        the updated parameters, ``3 (g-1)/g W``; ZeRO-2 reduce-scatters them instead,
        ``2 (g-1)/g W``; FSDP gathers every unit's parameters for the forward and again for the
        backward and reduce-scatters the gradients, ``3 (g-1)/g W``; Gemini each chunk as often as
        it is gathered, padding included (:func:`~dist_optim.plan.gemini.replay_chunks`); checked against real runs but
        for the one-scalar overflow flag ZeRO also all-reduces (FSDP's not yet); under expert
        parallelism each expert's over its MoE data-parallel group) and
        ``pipeline`` (each micro-batch's hidden states to the next stage and their gradient back,
        once per model chunk under the interleaved schedule) derived."""
        layout, b = self.layout, self.busiest
        ring = 3 if layout.plugin == "fsdp" else {0: 2, 1: 3, 2: 2}[layout.zero]
        checkpointed = self.workload is not None and self.workload.grad_checkpoint
        grads = b.gemini_sent[checkpointed] if layout.plugin == "gemini" else ring * b.reduced_share
        out = {"optimizer": float(self.steady["bytes_sent"]), "gradients": grads}
        a, w = self.activations, self.workload
        if a is not None and w is not None:
            micro = w.batch_size if layout.pp > 1 else 1
            out["model"] = a.bytes_sent * micro
            if layout.pp > 1:
                hidden = w.seq_len * int(self.hidden_size) * layout.working_dtype.itemsize
                # each chunk sends its output on and its input's gradient back, but the model's
                # first and last (1F1B: one chunk per stage)
                sends = 2 * layout.num_model_chunks - (a.stage == layout.pp - 1) - (a.stage == 0)
                out["pipeline"] = float(micro * sends * hidden)
        out["total"] = sum(out.values())
        return out

    @property
    def host_traffic(self) -> dict[str, float]:
        """Bytes copied between host and device in one training step under CPU offload (empty
        without): ``staging`` (the optimizer's collectives, their buffers in and out; simulated)
        and ``zero`` (ColossalAI's copy of each reduced gradient shard to the host and of the
        updated master back, both fp32: derived, 8 bytes per master element)."""
        if not self.layout.cpu_offload:
            return {}
        out = {"staging": float(self.steady["staged"]), "zero": float(2 * self.busiest.fp32_masters)}
        out["total"] = sum(out.values())
        return out

    @property
    def state_vs_ideal(self) -> float:
        return self.busiest.optimizer_state / self.ideal_state if self.ideal_state else math.inf

    def mean(self, key: str) -> float:
        return sum(getattr(r, key) for r in self.ranks) / len(self.ranks)

    def to_json(self) -> dict[str, Any]:
        out = {
            "model": self.model,
            "layout": asdict(self.layout),
            "world": self.layout.world,
            "optimizer": self.optimizer,
            # configuration objects (Shampoo's grafting_config) by their repr: JSON has no such values
            "optimizer_args": {
                k: v if isinstance(v, (bool, int, float, str, list, dict, type(None))) else repr(v)
                for k, v in self.optimizer_args.items()
            },
            "busiest": asdict(self.busiest),
            "simulated_ranks": [r.rank for r in self.ranks],
            "mean": {k: self.mean(k) for k in ("optimizer_state", "peak_transient", "fp32_masters", "gradients")},
            "ideal_state": self.ideal_state,
            "single_device_state": self.single_device_state,
            "ideal_how": self.ideal_how,
            "state_vs_ideal": self.state_vs_ideal,
            "owner_balance": self.owner_balance,
            "steady": self.steady,
            "refresh": self.refresh,
            "transient_option": self.transient_option,
            "refresh_note": self.refresh_note,
            "seconds": self.seconds,
            "not_simulated": list(self.not_simulated),
        }
        if self.workload is not None and self.stage_activations:
            out["workload"] = asdict(self.workload)
            out["activations"] = asdict(cast(Activations, self.activations))
            out["stage_activations"] = {s: asdict(a) for s, a in self.stage_activations.items()}
        out["total"] = self.total
        out["step_traffic"] = self.step_traffic
        if self.layout.cpu_offload:
            out["host_total"] = self.busiest.host_total
            out["host_traffic"] = self.host_traffic
        if self.usable is not None:
            out["gpu_memory"] = self.gpu_memory
            out["allocator_margin"] = self.margin
            out["fits"] = self.total <= self.usable
            out["headroom"] = self.usable - self.total
        return out


#: What bounds each optimizer's transient memory, for the plan's reader (the catalogue's).
TRANSIENT_OPTIONS = {name: entry.transient for name, entry in OPTIMIZERS.items()}
#: What a plugin gathers whole during forward and backward, beside the activations (a row of the plan).
GATHERED = {"fsdp": "FSDP units", "gemini": "Gemini chunks"}


def rank_total(rank: RankPlan, activations: Activations | None) -> int:
    """``rank``'s peak with its stage's ``activations``: its static bytes plus the larger of its
    step's transient and the activation peak of its schedule."""
    act = (activations.schedule_peak if activations is not None else 0) + rank.fsdp_gathered + rank.gemini_gathered
    return rank.total - rank.device_transient + max(rank.device_transient, act)


def _rank_plan(result: RankResult, layout: Layout) -> RankPlan:
    working = sum(p.working.numel() for p in result.pieces) * layout.working_dtype.itemsize
    master_bytes = sum(p.master.numel() * 4 for p in result.pieces)
    separate = layout.zero > 0 or layout.precision != "fp32"
    working_grads = working if (layout.zero < 2 and layout.precision != "fp32") or not separate else 0
    grads = (master_bytes if separate else 0) + working_grads
    gathered = 0
    if layout.plugin == "fsdp":
        # FSDP's fp32 shards are the parameters and the masters; their gradients stay sharded in
        # fp32; a unit's parameters exist whole only while it computes (fsdp_gathered).
        working, separate, grads = master_bytes, False, master_bytes
        gathered = fsdp_gathered(result.pieces) * layout.working_dtype.itemsize
    steps: list[dict[str, Any]] = [
        {
            "step": i + 1,
            "collectives": s.traffic.collectives,
            "by_kind": dict(s.traffic.counts),
            "bytes_sent": float(s.traffic.bytes_sent),
            "bytes_by_kind": {kind: float(sent) for kind, sent in s.traffic.sent.items()},
            "transient": s.transient,
            "staged": s.traffic.staged,
        }
        for i, s in enumerate(result.steps)
    ]
    peak = max(steps, key=lambda s: s["transient"])
    load = result.owner_loads[result.rank] if result.rank < len(result.owner_loads) else 0.0
    whole = layout.world if layout.plugin in ("zero", "ddp") else layout.data_ranks
    groups = [p.layout.zero.size if p.layout.zero is not None else whole for p in result.pieces]
    reduced = sum((Fraction(p.working.numel() * (g - 1), g) for p, g in zip(result.pieces, groups)), Fraction(0))
    plan = RankPlan(
        result.rank, working, master_bytes if separate else 0, grads, result.state_bytes, result.kept_bytes,
        peak["transient"], peak["step"], steps, load, working if layout.uses_torch_ddp else 0,
        float(reduced * layout.working_dtype.itemsize), layout.cpu_offload,
        max(s.traffic.staged_peak for s in result.steps), gathered,
    )  # fmt: skip
    return gemini_rank_plan(plan, result.pieces, layout.working_dtype) if layout.plugin == "gemini" else plan


def fsdp_gathered(pieces: Sequence[Any]) -> int:
    """Elements FSDP holds whole at once in the forward and backward, with a unit per decoder
    layer: the root unit's (embeddings, final norm, head: kept gathered from the forward to the
    backward), two layers' (the one computing and the next, prefetched) and the gradient of the
    largest unit before its reduce-scatter. Derived, not simulated."""
    units: dict[str | None, int] = {}
    for p in pieces:
        units[p.unit] = units.get(p.unit, 0) + p.working.numel()
    root = units.pop("", 0)
    layer = max(units.values(), default=0)
    return root + 2 * layer + max(root, layer)


def make_plan(
    model: Any,
    layout: Layout,
    optimizer: str,
    optimizer_args: dict[str, Any] | None = None,
    steps: int = 3,
    all_ranks_up_to: int = 8,
    gpu_memory: int | None = None,
    log: Callable[[str], None] | None = None,
    device: str = "cuda",
    workload: Workload | None = None,
    margin: float = ALLOCATOR_MARGIN,
    activations: dict[int, Activations] | None = None,
) -> Plan:
    """Simulate ``optimizer`` on ``model`` (a :data:`MODELS` name, a config.json path or a config)
    under ``layout``: rank 0, the busiest owner, and every rank when the world has at most
    ``all_ranks_up_to`` ranks; as on ``device`` (``"cuda"``, or ``"cpu"`` to compare with a CPU run:
    :func:`~dist_optim.plan.simulate.as_device`). With a ``workload``, also one micro-batch's
    forward and backward on the first rank of each pipeline stage
    (:func:`~dist_optim.plan.activations.activations_of_rank`), unless ``activations`` gives them by
    stage (a sweep simulates them once per layout). With pipeline stages, the first rank of every
    stage is simulated too, and the busiest rank is the one whose peak, activations included, is
    the highest."""
    t0 = time.perf_counter()
    if optimizer not in OPTIMIZERS:
        raise PlanError(f"--optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
    if steps < 2:
        raise PlanError(f"--steps {steps}: at least 2 (the first step also creates the state)")
    config = load_config(model)
    check_model_layout(
        config, layout.tp, layout.pp, sp=layout.sp, sp_mode="all_to_all", ep=layout.ep, chunks=layout.num_model_chunks
    )
    if not 0 <= margin < 1:
        raise PlanError(f"--memory-margin {margin}: a share of the GPU's memory in [0, 1), e.g. 0.1")
    args = dict(optimizer_args or {})
    say = log or (lambda _: None)
    if workload is not None and activations is None:
        activations = stage_activations(config, layout, workload, device, say)
    say(f"simulating rank 0 of {layout.describe()} with {optimizer}")
    first = simulate_rank(config, layout, optimizer, args, 0, steps, device)
    results = {0: first}
    loads = first.owner_loads
    busiest = max(range(len(loads)), key=lambda r: (loads[r], -r)) if loads else 0
    if layout.pp > 1:  # owner loads index rank 0's stage's ranks (its TP x DP grid)
        busiest = layout.stage_ranks(0)[busiest] if busiest < layout.stage_size else 0
    firsts = [layout.stage_ranks(s)[0] for s in range(layout.pp)]
    wanted = list(range(layout.world)) if layout.world <= all_ranks_up_to else [busiest, *firsts]
    twins: dict[Any, RankResult] = {}
    for r in wanted:
        if r in results:
            continue
        key = stage_twin_key(config, layout, r) if r != 0 else None
        if key is not None and key in twins:  # a rank of an earlier stage that holds alike
            say(f"rank {r}: as rank {twins[key].rank} (its stage holds alike)")
            results[r] = replace(twins[key], rank=r, seconds=0.0)
            continue
        say(f"simulating rank {r}")
        results[r] = simulate_rank(config, layout, optimizer, args, r, steps, device)
        if key is not None:
            twins[key] = results[r]
    ranks = [_rank_plan(results[r], layout) for r in sorted(results)]
    if activations:
        top = max(ranks, key=lambda r: (rank_total(r, activations[layout.stage_of(r.rank)]), -r.rank))
    else:
        top = max(ranks, key=lambda r: (r.optimizer_state + r.kept_buffers + r.peak_transient, -r.rank))
    single, how = single_device_state(config, optimizer, args, device)
    mean_load = sum(loads) / len(loads) if loads else 0.0
    refresh = {k: v for k, v in OPTIMIZERS[optimizer].refresh.items() if k not in args}
    note = (
        f"refreshes set to every 2nd step for the simulation ({', '.join(f'{k}={v}' for k, v in refresh.items())}); "
        "a refresh step costs the same whatever the period"
        if refresh
        else "every simulated step as configured"
    )
    return Plan(
        model if isinstance(model, str) else "config", layout, optimizer, args, top, ranks,
        single // ideal_share(layout), single, how, max(loads) / mean_load if mean_load else 1.0,
        TRANSIENT_OPTIONS[optimizer], note, time.perf_counter() - t0, gpu_memory,
        meta_items=sum(r.meta_items for r in results.values())
        + sum(a.meta_items for a in (activations or {}).values()),
        workload=workload, stage_activations=activations, margin=margin, hidden_size=int(config.hidden_size),
    )  # fmt: skip


def stage_activations(
    config: Any, layout: Layout, workload: Workload, device: str = "cuda", log: Callable[[str], None] | None = None
) -> dict[int, Activations]:
    """The activations of ``workload`` on the first rank of each pipeline stage of ``layout``
    (:func:`~dist_optim.plan.activations.stage_activations_each`)."""
    return stage_activations_each(config, layout, [workload], device, log)[0]


def _gb(x: float) -> str:
    return f"{x / GB:.2f} GB"


def format_plan(plan: Plan) -> str:
    """The human-readable plan."""
    b = plan.busiest
    lines = [
        f"{plan.model}, {plan.layout.describe()}, optimizer {plan.optimizer}"
        + (f" {plan.optimizer_args}" if plan.optimizer_args else ""),
        f"simulated ranks: {', '.join(map(str, (r.rank for r in plan.ranks)))}; busiest: rank {b.rank} "
        f"({plan.seconds:.1f} s)",
        "",
        f"{'per rank':<34}{'busiest':>12}{'mean of simulated':>20}",
    ]
    for label, key in (
        ("working params (derived)", "working_params"),
        ("fp32 masters (derived)", "fp32_masters"),
        ("gradients (derived)", "gradients"),
        ("DDP gradient buckets (derived)", "ddp_buckets"),
        ("optimizer state", "optimizer_state"),
        ("buffers kept by step()", "kept_buffers"),
        ("peak transient in step()", "peak_transient"),
    ) + tuple((f"{GATHERED[p]} gathered (derived)", f"{p}_gathered") for p in GATHERED if p == plan.layout.plugin):
        lines.append(f"{label:<34}{_gb(getattr(b, key)):>12}{_gb(plan.mean(key)):>20}")
    if b.offloaded:
        # masters, their fp32 gradients, state, kept buffers and the step's transient are on the host
        lines.append(f"{'of which in host memory (offload)':<34}{_gb(b.host_total):>12}")
        lines.append(f"{'device transient (staged buffers)':<34}{_gb(b.staged_peak):>12}")
    lines.append(f"{'total before activations':<34}{_gb(b.total):>12}")
    if plan.activations is not None and plan.workload is not None and plan.stage_activations:
        a, pp = plan.activations, plan.layout.pp
        lines += [
            f"{'activations kept per micro-batch':<34}{_gb(a.kept):>12}",
            f"{'activation peak (fwd + bwd)':<34}{_gb(a.schedule_peak):>12}",
            f"{'peak of the step (total)':<34}{_gb(plan.total):>12}",
        ]
        where = f"stage {a.stage} of {pp}" if pp > 1 else "rank 0"
        lines.append(
            f"activations of {where}: {plan.workload.describe(pp)}; autograd saved {_gb(a.saved)} per micro-batch"
        )
        by_stage = ", ".join(f"{s}: {_gb(x.schedule_peak)}" for s, x in sorted(plan.stage_activations.items()))
        if pp > 1 and a.chunks:
            lines.append(
                f"interleaved, {len(a.chunks)} chunks per stage (schedule replayed): stage {a.stage} holds up to "
                f"{a.in_flight} chunk micro-batches at once (kept per chunk: "
                + ", ".join(_gb(c.kept) for c in a.chunks)
                + f"); activation peak by stage: {by_stage}"
            )
        elif pp > 1:
            lines.append(
                f"1F1B: stage {a.stage} holds {a.in_flight} micro-batch(es) at once; activation peak by stage: "
                + by_stage
            )
    lines += [
        "",
        f"ideal state per rank: {_gb(plan.ideal_state)} (single-device {_gb(plan.single_device_state)}, "
        f"{plan.ideal_how}, / {ideal_share(plan.layout)} ranks); busiest/ideal = {plan.state_vs_ideal:.3f}",
        f"peak transient at step {b.transient_step}; bounded by: {plan.transient_option}",
        f"owner work balance (the optimizer's cost model): busiest/mean = {plan.owner_balance:.3f}",
    ]
    for s in b.steps:
        kinds = ", ".join(f"{k} x{v}" for k, v in sorted(s["by_kind"].items())) or "none"
        lines.append(f"step {s['step']}: {s['collectives']} collectives ({kinds}), {_gb(s['bytes_sent'])} sent")
    lines.append(
        f"steady step: {plan.steady['collectives']} collectives, {_gb(plan.steady['bytes_sent'])} sent; "
        f"refresh step: {plan.refresh['collectives']} collectives, {_gb(plan.refresh['bytes_sent'])} sent "
        f"({plan.refresh_note})"
    )
    t = plan.step_traffic
    lines.append(
        "sent per training step: "
        + ", ".join(f"{k} {_gb(v)}" for k, v in t.items() if k != "total")
        + f"; total {_gb(t['total'])} (optimizer and model simulated; gradients and pipeline derived)"
    )
    if plan.layout.cpu_offload:
        h = plan.host_traffic
        lines.append(
            f"CPU offload: host memory {_gb(b.host_total)} at the step's peak; host<->device per step "
            f"{_gb(h['total'])} (staging {_gb(h['staging'])} simulated, ZeRO's gradients and masters "
            f"{_gb(h['zero'])} derived)"
        )
    if plan.gpu_memory is not None and plan.usable is not None:
        room = plan.usable - plan.total
        verdict = "fits" if room >= 0 else "does NOT fit"
        what = "with activations" if plan.activations is not None else "before activations"
        lines.append(
            f"--gpu-memory {_gb(plan.gpu_memory)}: {verdict} {what} "
            f"({_gb(abs(room))} {'left' if room >= 0 else 'short'} of {_gb(plan.usable)}, "
            f"after a {plan.margin:.0%} allocator margin)"
        )
    lines.append("not simulated:")
    lines += [f"  - {n}" for n in plan.not_simulated]
    if plan.meta_items:
        lines.append(f"  - {plan.meta_items} .item() values answered without data in this plan")
    return "\n".join(lines)


def format_sweep(plans: Sequence[Plan]) -> str:
    """One row per plan: state per rank vs ideal, transient, bytes sent, the ideal + 5% goal."""
    head = (
        "| optimizer | layout | state GB/rank | ideal GB | state/ideal | transient GB | "
        "GB sent/step (steady) | GB sent (refresh) | owner balance | within ideal+5% |"
    )
    rows = [head, "|" + "---|" * 10]
    for p in plans:
        ok = "yes" if p.state_vs_ideal <= 1.05 else "no"
        rows.append(
            f"| {p.optimizer} | {p.layout.describe()} | {p.busiest.optimizer_state / GB:.2f} | "
            f"{p.ideal_state / GB:.2f} | "
            f"{p.state_vs_ideal:.2f} | {p.busiest.peak_transient / GB:.2f} | {p.steady['bytes_sent'] / GB:.3f} | "
            f"{p.refresh['bytes_sent'] / GB:.3f} | {p.owner_balance:.2f} | {ok} |"
        )
    return "\n".join(rows)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20}
_UNITS.update({"gib": 2**30, "tib": 2**40})


def parse_bytes(text: str) -> int:
    """``80GiB``, ``80GB``, ``8e10`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise PlanError(f"--gpu-memory {text!r}: a size such as 80GiB, 141GB or 8e10 (bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
