"""Activation memory of one training micro-batch, from the model that runs: the sharded model's own
forward and backward on meta tensors.

The model is the planner's meta model split by ColossalAI's ShardFormer exactly as for the optimizer
(:func:`dist_optim.plan.simulate.sharded_meta_model`), in the working precision, with the gradient
checkpointing the recipe turns on (Hugging Face's ``gradient_checkpointing_enable``, non-reentrant)
and the attention kernel the recipe would run. One forward and one backward of ``batch_size``
sequences of ``seq_len`` tokens are run under :class:`~dist_optim.plan.traffic.LiveBytes`, which
follows every storage an op allocates until its last tensor dies, and under
``torch.autograd.graph.saved_tensors_hooks``, which sees what autograd keeps for the backward.

Three figures come out (:class:`Activations`):

* ``saved``: the bytes of the distinct storages autograd saved in the forward, parameters excluded.
  With checkpointing this is what the checkpointed layers' inputs and the rest of the model keep
  (the checkpoint's own frames hold the layer inputs; they are counted in ``kept``, not here).
* ``kept``: the bytes the forward allocated that are still alive when the backward starts: the
  saved tensors, checkpointed layers' inputs and the loss. This is what a micro-batch in flight holds.
* ``peak``: the most bytes alive at once over the forward and the backward, counting what both
  allocate; each parameter's gradient is dropped as soon as autograd has accumulated it, because
  the plan counts gradients separately (``RankPlan.gradients``), whole.

Attention, as the recipe's ``--attn`` chooses it: ``sdpa`` is PyTorch's
``scaled_dot_product_attention``, which on a meta tensor would take the math path (the ``s x s``
probabilities saved); inside the simulation it runs the fused kernel the device would pick instead
(CUDA: flash attention for fp16/bf16, memory-efficient attention for fp32; CPU: the CPU flash
kernel), through that kernel's own meta function, key/value heads repeated first as transformers
does. ``flash`` is flash-attn's ``flash_attention_2`` (CUDA only): the same kernel on the key/value
heads as they are (flash-attn takes grouped heads). ``eager`` is transformers' own attention.

Not modelled: memory inside a kernel that it frees before returning (cuBLAS / flash workspaces),
the caching allocator's fragmentation (the verdict's margin, :data:`ALLOCATOR_MARGIN`).
Sequence parallelism runs as the recipe sets it up (the all_to_all mode, an all-ones attention mask
passed as the recipe passes it): ColossalAI's own attention forward and all-to-alls run on the meta
model like the rest.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .models import PlanError
from .torch_internals import c10d_group_size, meta_autocast, meta_collectives

__all__ = [
    "ATTENTION",
    "ALLOCATOR_MARGIN",
    "Workload",
    "Activations",
    "simulate_activations",
    "attention_as",
    "BalancedRouting",
    "interleaved_stage",
    "check_microbatches",
    "activations_of_rank",
    "rank_activations",
    "restaged",
    "stage_activations_each",
]

#: ``--attn`` values, as the recipe's.
ATTENTION = ("sdpa", "flash", "eager")

#: Share of the GPU's memory the verdict keeps free for what the plan does not count: the caching
#: allocator's fragmentation and rounding, the CUDA context, NCCL's buffers and kernel workspaces.
ALLOCATOR_MARGIN = 0.1


@dataclass(frozen=True)
class Workload:
    """One micro-batch as the recipe's flags give it: ``--seq-len``, ``--batch-size`` (sequences per
    data-parallel rank and micro-batch), ``--grad-checkpoint`` (every decoder layer) and ``--attn``."""

    seq_len: int = 4096
    batch_size: int = 1
    grad_checkpoint: bool = False
    attn: str = "sdpa"

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size"):
            if getattr(self, name) < 1:
                raise PlanError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be at least 1")
        if self.attn not in ATTENTION:
            raise PlanError(f"--attn {self.attn!r}: choose one of {', '.join(ATTENTION)}")

    def describe(self, pp: int = 1) -> str:
        ckpt = ", checkpointed layers" if self.grad_checkpoint else ""
        if pp > 1:  # the recipe's pipeline micro-batches are one sequence each
            return f"{self.batch_size} micro-batches of 1 x {self.seq_len} tokens, attention {self.attn}{ckpt}"
        return f"{self.batch_size} x {self.seq_len} tokens per micro-batch, attention {self.attn}{ckpt}"


@dataclass
class Activations:
    """Bytes of one micro-batch's forward and backward on one rank (see the module's docstring);
    under pipeline stages, of one stage, with the micro-batches its 1F1B schedule holds at once."""

    saved: int
    kept: int
    peak: int
    seconds: float
    meta_items: int = 0
    stage: int = 0
    in_flight: int = 1  # micro-batches whose activations the stage holds at once (1F1B: stages - stage)
    #: ColossalAI's 1F1B loop keeps the input gradient a later stage last sent back alive until the
    #: next backward replaces it: one received-activation-sized tensor under every later micro-batch.
    held_grad: int = 0
    #: The model's own collectives in one micro-batch's forward and backward (ColossalAI's TP
    #: layers and loss: {kind: calls}, and the bytes this rank sends, bus-bandwidth convention).
    collectives: dict[str, int] = field(default_factory=dict)
    bytes_sent: float = 0.0
    #: The peak of the forward alone (what the interleaved replay charges a forward with).
    forward_peak: int = 0
    #: Under the interleaved schedule, each of the stage's model chunks' own figures (saved, kept and
    #: the collectives above are then their sums: one micro-batch through every chunk of the stage,
    #: ``peak`` their largest), and the stage's peak from the replay of the schedule
    #: (:mod:`dist_optim.plan.schedules`); ``in_flight`` counts chunk micro-batches.
    chunks: list[Activations] = field(default_factory=list)
    replayed_peak: int | None = None

    @property
    def schedule_peak(self) -> int:
        """The rank's activation peak in its schedule: the interleaved schedule's replayed peak, or
        1F1B's: the earlier micro-batches' kept bytes (and the held input gradient) under the peak
        of the one whose backward runs (its steady state: a forward, then the oldest micro-batch's
        backward)."""
        if self.replayed_peak is not None:
            return self.replayed_peak
        return (self.in_flight - 1) * self.kept + self.held_grad + self.peak


def _fused_sdpa(device: str, grouped: bool) -> Any:
    """``scaled_dot_product_attention`` that runs, on meta tensors, the fused kernel ``device``
    would pick (``grouped``: key/value heads left as they are, as flash-attn takes them)."""
    real = torch.nn.functional.scaled_dot_product_attention
    aten = torch.ops.aten

    def sdpa(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
             scale: float | None = None, **kwargs: Any) -> Any:  # fmt: skip
        if not q.is_meta or attn_mask is not None:
            return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kwargs)
        if device == "cpu":
            return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, scale=scale)[0]
        if q.dtype in (torch.float16, torch.bfloat16) or grouped:
            return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]
        return aten._scaled_dot_product_efficient_attention(q, k, v, None, True, dropout_p, is_causal, scale=scale)[0]

    return sdpa


@contextlib.contextmanager
def attention_as(attn: str, device: str) -> Iterator[str]:
    """Inside the block, attention on meta tensors runs as ``attn`` runs on ``device``; yields the
    ``attn_implementation`` the model must be built with."""
    from transformers.integrations import sdpa_attention

    if attn == "eager":
        yield "eager"
        return
    if attn == "flash" and device != "cuda":
        raise PlanError(f"--attn flash is flash-attn's CUDA kernel; with --device {device} plan --attn sdpa or eager")
    functional = torch.nn.functional
    real = functional.scaled_dot_product_attention
    functional.scaled_dot_product_attention = _fused_sdpa(device, grouped=attn == "flash")  # type: ignore[assignment]
    real_repeat = sdpa_attention.repeat_kv
    if attn == "flash":
        sdpa_attention.repeat_kv = lambda hidden_states, n_rep: hidden_states  # flash-attn reads grouped heads
    try:
        yield "sdpa"
    finally:
        functional.scaled_dot_product_attention = real  # type: ignore[assignment]
        sdpa_attention.repeat_kv = real_repeat


def simulate_activations(
    model: torch.nn.Module,
    workload: Workload,
    device: str = "cuda",
    breakdown: dict[str, int] | None = None,
    stages: Any = None,
    mask: bool = False,
) -> Activations:
    """One forward (with the loss, labels = inputs, as the recipe trains) and one backward of
    ``model`` (a meta model, already sharded and in its working precision) on ``workload``.
    ``breakdown``, when given, receives the saved bytes by the autograd node that produced each
    saved tensor ("input" for tensors no node produced), each storage once.

    ``stages``: ColossalAI's PipelineStageManager of a pipeline stage's model. The stage runs one
    micro-batch of one sequence (the recipe's ``microbatch_size=1``) as the 1F1B schedule calls it:
    a later stage takes the hidden states it receives, every stage but the last sends its output
    and runs its backward from the gradient it receives (both allocated inside the measurement,
    as the schedule's receive buffers are); ``batch_size`` micro-batches go through per step.
    Under the interleaved schedule the micro-batch runs through the chunk ``stages.model_chunk_id``
    (set by the caller), with that chunk's layer range passed as the schedule passes it.
    ``mask``: pass an all-ones attention mask, as the recipe does under sequence parallelism."""
    from .traffic import LiveBytes, c10d_bytes

    t0 = time.perf_counter()
    if workload.grad_checkpoint:
        # As the recipe, except the RNG state: torch cannot fork a meta generator (the states a real
        # run keeps are a few KB per layer, on the CPU and the device).
        kwargs = {"use_reentrant": False, "preserve_rng_state": False}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    elif getattr(model, "is_gradient_checkpointing", False):  # simulated before with it: switch it off
        model.gradient_checkpointing_disable()
    model.train()
    hooks = [p.register_post_accumulate_grad_hook(_drop_grad) for p in model.parameters() if p.requires_grad]
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in params and storage._cdata not in saved:
            saved[storage._cdata] = storage.nbytes()
            if breakdown is not None:
                producer = type(t.grad_fn).__name__ if t.grad_fn is not None else "input"
                breakdown[producer] = breakdown.get(producer, 0) + storage.nbytes()
        return t

    calls: collections.Counter[str] = collections.Counter()
    sent = Fraction(0)

    def record(name: str, args: tuple[Any, ...], group_size: int) -> None:
        nonlocal sent
        kind, nbytes = c10d_bytes(name, args, group_size)
        calls[kind] += 1
        sent += nbytes

    rows = workload.batch_size if stages is None else 1
    ids = torch.zeros((rows, workload.seq_len), dtype=torch.long, device="meta")
    masks = {"attention_mask": torch.ones_like(ids)} if mask else {}  # inputs, made before the step
    first = stages is None or stages.is_first_stage()
    last = stages is None or stages.is_last_stage()
    dtype = next(model.parameters()).dtype
    width = int(getattr(getattr(model, "config", None), "hidden_size", 0))
    try:
        with meta_autocast(), meta_collectives(record), attention_as(workload.attn, device), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            experts = int(getattr(getattr(model, "config", None), "num_local_experts", 0) or 0)
            shadows: dict[int, torch.Tensor] = {}
            routing = BalancedRouting(experts, shadows) if experts else contextlib.nullcontext()
            with LiveBytes(answer_meta_items=True, shadows=shadows) as live, routing:
                inputs: dict[str, Any] = {"input_ids": ids, "labels": ids, **masks}
                if not first:
                    received = torch.empty((rows, workload.seq_len, width), dtype=dtype, device="meta")
                    inputs["hidden_states"] = received.requires_grad_()
                if stages is not None and stages.is_interleave:  # as InterleavedSchedule.forward_step
                    inputs["stage_index"] = stages.stage_indices[stages.model_chunk_id]
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = model(**inputs)
                # What outlives the forward: the loss (the model's other outputs, the logits, are
                # dropped, as the recipe's loop and the pipeline schedule drop them) or the hidden
                # states a stage sends (the schedule holds them for the backward).
                held = _loss(out) if last else out["hidden_states"]
                del out
                # Reference cycles of the forward (ColossalAI's autograd functions make some) hold
                # small tensors until Python's collector runs, at no fixed time: collect them now, so
                # that the figures do not depend on when it last ran.
                gc.collect()
                kept, forward_peak = live.live, live.peak
                if last:
                    held.backward()
                else:
                    torch.autograd.backward(held, torch.empty_like(held))
                del held, inputs
    finally:
        for h in hooks:
            h.remove()
    stage, in_flight, held_grad = 0, 1, 0
    if stages is not None:
        stage = int(stages.stage)
        in_flight = min(int(stages.num_stages) - stage, workload.batch_size)
        if not first and workload.batch_size > 1:
            held_grad = rows * workload.seq_len * width * dtype.itemsize
    return Activations(
        sum(saved.values()), kept, live.peak, time.perf_counter() - t0, live.meta_items, stage, in_flight, held_grad,
        dict(calls), float(sent), forward_peak,
    )  # fmt: skip


def interleaved_stage(chunks: list[Activations], stages: int, workload: Workload, hidden: int) -> Activations:
    """A stage's activations under the interleaved schedule from its ``chunks``' (in chunk order):
    sums for one micro-batch through them all, and the peak of the replayed schedule over
    ``workload.batch_size`` micro-batches with ``hidden`` bytes per sent hidden-states tensor."""
    from .schedules import ChunkBytes, replay_interleaved

    stage = chunks[0].stage
    figures = [ChunkBytes(c.kept, c.forward_peak, c.peak) for c in chunks]
    replay = replay_interleaved(stages, stage, figures, workload.batch_size, hidden)
    calls: collections.Counter[str] = collections.Counter()
    for c in chunks:
        calls.update(c.collectives)
    return Activations(
        sum(c.saved for c in chunks), sum(c.kept for c in chunks), max(c.peak for c in chunks),
        sum(c.seconds for c in chunks), sum(c.meta_items for c in chunks), stage, replay.in_flight, 0, dict(calls),
        sum(c.bytes_sent for c in chunks), max(c.forward_peak for c in chunks), chunks, replay.peak,
    )  # fmt: skip


class BalancedRouting(TorchDispatchMode):
    """Mixture-of-experts routing on meta tensors, every expert receiving an equal share of the
    routed tokens (``tokens x top_k / experts``), the balance the router's auxiliary loss aims at; a
    real step with unbalanced routing holds more on its busiest expert. Token counts depend on the
    router's values, which a meta tensor has none of:

    * transformers' Mixtral block finds each expert's tokens with ``torch.where(expert_mask[e])``:
      its ``nonzero`` returns ``numel / experts`` of the mask's entries;
    * ColossalAI's expert-parallel block (MoeHybridParallelPlugin) counts them with ``bincount``
      and exchanges the counts (an ``all_to_all_single``, then ``tolist()`` for the token
      all-to-all's split sizes): ``bincount`` returns equal counts, made with ``torch.full`` so that
      :class:`~dist_optim.plan.traffic.LiveBytes` keeps their values in a CPU shadow (``shadows``,
      the dict it was given); an all-to-all of a shadowed tensor receives what it sends (every rank
      sends the same counts), and an all-reduce of one (the experts' activity flags, summed over
      the MoE data-parallel group) is the value times the group's size."""

    def __init__(self, experts: int, shadows: dict[int, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.experts = experts
        self.shadows = {} if shadows is None else shadows

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.nonzero.default and args[0].is_meta:
            mask = args[0]
            return torch.empty((mask.numel() // self.experts, mask.dim()), dtype=torch.long, device="meta")
        if func is torch.ops.aten.bincount.default and args[0].is_meta:
            bins = max(int(kwargs.get("minlength", args[2] if len(args) > 2 else 0)), self.experts)
            return torch.full((bins,), args[0].numel() // self.experts, dtype=torch.long, device="meta")
        out = func(*args, **kwargs)
        # In place on the shadows: a new CPU tensor made here would pass through LiveBytes (below this
        # mode) and be counted as activations for as long as its meta tensor lives.
        shadows = self.shadows
        if func is torch.ops.c10d.alltoall_base_.default and id(args[0]) in shadows and id(args[1]) in shadows:
            shadows[id(args[0])].copy_(shadows[id(args[1])])
        elif func is torch.ops.c10d.allreduce_.default:
            for t in args[0]:
                if id(t) in shadows:
                    shadows[id(t)].mul_(c10d_group_size(args))
        return out


def _drop_grad(param: torch.Tensor) -> None:
    param.grad = None


def _loss(out: Any) -> torch.Tensor:
    loss = out.loss if hasattr(out, "loss") else out["loss"]
    return loss


def activations_of_rank(
    config: Any,
    layout: Any,
    workload: Workload,
    rank: int = 0,
    device: str = "cuda",
    breakdown: dict[str, int] | None = None,
) -> Activations:
    """:func:`simulate_activations` on rank ``rank`` of ``layout`` (a
    :class:`~dist_optim.plan.world.Layout`): its ShardFormer-split meta model in the working
    precision, over ``fake`` process groups of the job's world size."""
    return rank_activations(config, layout, [workload], rank, device, breakdown)[0]


def rank_activations(
    config: Any,
    layout: Any,
    workloads: Sequence[Workload],
    rank: int = 0,
    device: str = "cuda",
    breakdown: dict[str, int] | None = None,
) -> list[Activations]:
    """:func:`activations_of_rank` of each of ``workloads`` (one attention kernel) on one sharded
    model: ShardFormer's split of a whole meta model is most of a simulation's cost, and
    checkpointing is a switch on the split model (ColossalAI's pipeline forward reads its
    checkpointing config only while the switch is on). ``breakdown`` receives their sum."""
    from .simulate import as_device, remember_sharding, sharded_meta_model
    from .world import SimWorld

    attn = {w.attn for w in workloads}
    if len(attn) != 1:
        raise ValueError(f"workloads of attention kernels {sorted(attn)}: pass those of one kernel")
    for workload in workloads:
        check_microbatches(layout, workload)
    ratio = 1.0 if any(w.grad_checkpoint for w in workloads) else None
    out = []
    with SimWorld(layout, rank) as world, as_device(device), attention_as(attn.pop(), device) as impl:
        model = sharded_meta_model(config, layout, world, attn_implementation=impl, checkpoint_ratio=ratio)
        remember_sharding(config, layout, world, model)
        model.to(layout.working_dtype)
        stages = world.stage_manager
        for workload in workloads:
            if layout.pp_style != "interleaved":
                out.append(simulate_activations(model, workload, device, breakdown, stages, mask=layout.sp > 1))
                continue
            chunks = []
            for chunk in range(layout.num_model_chunks):
                with stages.switch_model_chunk_id(chunk):
                    chunks.append(simulate_activations(model, workload, device, breakdown, stages))
            out.append(interleaved_stage(chunks, layout.pp, workload, _hidden_bytes(config, layout, workload)))
    return out


def _hidden_bytes(config: Any, layout: Any, workload: Workload) -> int:
    """Bytes of the hidden states a stage sends per micro-batch (one sequence)."""
    return workload.seq_len * int(config.hidden_size) * layout.working_dtype.itemsize


def restaged(acts: Activations, stage: int, stages: int, workload: Workload, hidden: int) -> Activations:
    """``acts`` of a stage that holds what stage ``stage`` (of ``stages``) holds, as that stage runs
    them: the same bytes and collectives per micro-batch, its own micro-batches in flight (1F1B) or
    its own replay of the interleaved schedule (``hidden`` bytes per sent hidden-states tensor)."""
    if acts.chunks:
        chunks = [restaged(c, stage, stages, workload, hidden) for c in acts.chunks]
        return interleaved_stage(chunks, stages, workload, hidden)
    return dataclasses.replace(acts, stage=stage, in_flight=min(stages - stage, workload.batch_size), seconds=0.0)


def stage_activations_each(
    config: Any,
    layout: Any,
    workloads: Sequence[Workload],
    device: str = "cuda",
    log: Callable[[str], None] | None = None,
) -> list[dict[int, Activations]]:
    """By workload, the activations of each of ``workloads`` (one attention kernel) on the first
    rank of each pipeline stage of ``layout``, one sharded model per stage
    (:func:`rank_activations`). A middle stage that holds what an earlier middle stage holds
    (:func:`~dist_optim.plan.simulate.stage_twin_key`: an even split's) takes that stage's
    figures at its own place in the schedule (:func:`restaged`), as a plan's twin ranks do: a
    sweep's pp=8 layouts simulate 3 stages, not 8 (``python -m dist_optim.plan ... --sweep``)."""
    from .simulate import stage_twin_key

    say = log or (lambda _: None)
    out: list[dict[int, Activations]] = [{} for _ in workloads]
    twins: dict[Any, int] = {}
    for stage in range(layout.pp):
        rank = layout.stage_ranks(stage)[0]
        middle = 0 < stage < layout.pp - 1
        key = stage_twin_key(config, layout, rank) if middle and twins else None
        if key is not None and key in twins:
            say(f"stage {stage}: the activations of stage {twins[key]} (it holds alike)")
            for acts, work in zip(out, workloads):
                acts[stage] = restaged(acts[twins[key]], stage, layout.pp, work, _hidden_bytes(config, layout, work))
            continue
        for work in workloads:
            say(f"simulating the forward and backward of {work.describe()} on rank {rank}")
        for acts, simulated in zip(out, rank_activations(config, layout, workloads, rank, device)):
            acts[stage] = simulated
        if middle:
            twins[key if key is not None else stage_twin_key(config, layout, rank)] = stage
    return out


def check_microbatches(layout: Any, workload: Workload) -> None:
    """Refuse in one line the micro-batch counts ColossalAI's schedules assert on: 1F1B needs at
    least one per stage, the interleaved schedule a multiple of the stages (its ``load_batch``)."""
    batch, pp = workload.batch_size, layout.pp
    if pp > 1 and layout.pp_style == "interleaved" and batch % pp:
        raise PlanError(
            f"--batch-size {batch} with --pp {pp} --pp-style interleaved: ColossalAI's interleaved schedule needs "
            f"a multiple of the stages in micro-batches (one sequence each); use --batch-size {(batch // pp + 1) * pp}"
        )
    if pp > 1 and batch < pp:
        raise PlanError(
            f"--batch-size {batch} with --pp {pp}: ColossalAI's 1F1B schedule needs at least "
            f"as many micro-batches (one sequence each, the recipe's) as stages; use --batch-size {pp} or more"
        )
