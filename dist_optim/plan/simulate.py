"""One rank of a ColossalAI job, simulated: the model on the meta device, split by ColossalAI's own
ShardFormer policy over ``fake``-backend process groups of the job's world size, our optimizer bound
to the layouts the plugin would give it, and its ``step()`` run on meta tensors.

What is run, not re-derived: the TP split (ShardFormer's Llama policy, vocabulary padding
included), the optimizer's construction, binding (:meth:`DistOptimizer.bind`), owner assignment,
route planning and bucketing, state initialisation and every collective of a step (counted by
:mod:`dist_optim.plan.traffic` as :mod:`dist_optim.comm` issues them). What is derived: the ZeRO
padding and chunking (LowLevelZero's rule, ``-numel mod zero size``, checked by
:class:`~dist_optim.layout.ParamLayout`), which tensors ColossalAI keeps beside the optimizer
(working params, masters, gradients), and the values of ``.item()`` calls (0 on meta tensors).
"""

from __future__ import annotations

import contextlib
import re
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from dist_optim.kernels.replay import replaying, replaying_work
from dist_optim.layout import ParamLayout, TPSplit, ZeroShard
from dist_optim.registry import CatalogueEntry, catalogue
from dist_optim.sharding.placement import recording_owner_loads

from .models import MODELS, PlanError, load_config, vocab_multiple
from .replay import Replays
from .torch_internals import DEVICES, check_torch, meta_generators, meta_strides_as
from .traffic import LiveBytes, StepTraffic, Traffic, traffic_of
from .world import Layout, SimWorld, install_cpu_shims, meta_device_mesh

if TYPE_CHECKING:
    from .gemini import GeminiChunk

__all__ = [
    "Layout",
    "MODELS",
    "OPTIMIZERS",
    "COLUMNS",
    "stage_twin_key",
    "load_config",
    "Piece",
    "SimWorld",
    "build_pieces",
    "held_parameters",
    "remember_sharding",
    "sharded_meta_model",
    "build_optimizer",
    "StepResult",
    "RankResult",
    "simulate_rank",
    "sharing_zero_stages",
    "single_device_state",
    "simulate_single_device",
    "PlanError",
    "DEVICES",
    "as_device",
]


# ---- what the optimizer is handed ------------------------------------------------------------
@dataclass
class Piece:
    """One parameter as the plugin hands it to the optimizer on this rank."""

    name: str
    working: torch.Tensor  # the TP slice forward/backward uses (meta)
    master: torch.Tensor  # what the optimizer steps: fp32, a flat ZeRO chunk under ZeRO (meta)
    layout: ParamLayout
    unit: str | None = None  # FSDP: the name of the unit module it belongs to ("" the root's)
    chunk: GeminiChunk | None = None  # Gemini: the chunk it lies in (plan/gemini.py)


def _meta_model(config: Any, attn_implementation: str = "eager") -> torch.nn.Module:
    """The causal LM of ``config``'s type (Llama, Mistral, Qwen2, Mixtral: transformers' auto
    class, as the recipe builds it) on the meta device, with a copy of the config: sharding
    rewrites the model's config in place."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import no_init_weights

    config = type(config).from_dict(config.to_dict())
    config.use_cache = False
    # Without the initialisation: a meta tensor holds no values, and torch runs normal_ on meta
    # through its Python reference, most of the model's construction.
    with torch.device("meta"), warnings.catch_warnings(), no_init_weights():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    model.tie_weights()  # skipped with the initialisation
    return cast(torch.nn.Module, model)


def sharded_meta_model(
    config: Any,
    layout: Layout,
    world: SimWorld | None,
    attn_implementation: str = "eager",
    checkpoint_ratio: float | None = None,
) -> torch.nn.Module:
    """The meta model of ``config`` as the plugin runs it on ``world``'s rank: split by ColossalAI's
    ShardFormer with the plugin's ShardConfig for ``layout`` (the whole model without TP or
    pipeline stages): its TP slices, and only its pipeline stage's layers. ``checkpoint_ratio``: the
    share of a stage's layers ColossalAI's pipeline forward checkpoints (the recipe's
    PipelineGradientCheckpointConfig)."""
    model = _meta_model(config, attn_implementation)
    if world is None or (layout.tp == 1 and layout.pp == 1 and layout.sp == 1 and layout.ep == 1):
        return model
    install_cpu_shims()
    from colossalai.shardformer import PipelineGradientCheckpointConfig, ShardConfig, ShardFormer

    ckpt = None
    if checkpoint_ratio and layout.pp > 1:
        ckpt = PipelineGradientCheckpointConfig(gradient_checkpointing_ratio=checkpoint_ratio)
    with meta_device_mesh(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # The plugin's own ShardConfig for this layout (HybridParallelPlugin: TP and stages, no
        # fused kernels on CPU; the vocabulary padding the recipe sets, models.vocab_multiple).
        sharded, _ = ShardFormer(
            ShardConfig(
                tensor_parallel_process_group=world.tp_group,
                sequence_parallel_process_group=world.sp_group,
                enable_sequence_parallelism=layout.sp > 1,
                sequence_parallelism_mode="all_to_all" if layout.sp > 1 else None,
                pipeline_stage_manager=world.stage_manager,
                enable_tensor_parallelism=layout.tp > 1,
                gradient_checkpoint_config=ckpt,
                make_vocab_size_divisible_by=vocab_multiple(config),
                # MoeHybridParallelPlugin's groups: its Mixtral policy then holds 1/ep of the experts
                ep_group=world.ep_group,
                moe_dp_group=world.moe_dp_group,
            )
        ).optimize(model)
    return cast(torch.nn.Module, sharded)


#: What ShardFormer leaves on a rank, by model, split and the rank's stage and expert-parallel
#: index (every TP and data-parallel rank of those holds the same shapes): each parameter's name,
#: shape, TP dim and whether it is an expert's. Ranks planned in one process (rank 0, the busiest
#: owner) shard the meta model once.
_SHARDED: dict[tuple[Any, ...], list[tuple[str, tuple[int, ...], int | None, bool]]] = {}


def _sharding_key(config: Any, layout: Layout, world: SimWorld) -> tuple[Any, ...]:
    dp, stage, _, _ = layout.coordinates(world.rank)
    split = (layout.tp, layout.pp, layout.sp, layout.ep, layout.num_model_chunks, layout.pp_style)
    return (config.to_json_string(), *split, stage, dp % layout.ep)


def remember_sharding(config: Any, layout: Layout, world: SimWorld, sharded: torch.nn.Module) -> None:
    """Keep what ShardFormer left on ``world``'s rank (``sharded``, split by
    :func:`sharded_meta_model` for this ``layout``) for the ranks planned after it: the
    activations' model has the parameters the optimizer's has, whatever its attention kernel."""
    from dist_optim.plugins.colossal import is_expert, tp_dim_of

    _SHARDED[_sharding_key(config, layout, world)] = [
        (n, tuple(p.shape), tp_dim_of(p) if layout.tp > 1 else None, layout.ep > 1 and is_expert(p))
        for n, p in sharded.named_parameters()
    ]


def _sharded_params(
    config: Any, layout: Layout, world: SimWorld
) -> list[tuple[str, tuple[int, ...], int | None, bool]]:
    key = _sharding_key(config, layout, world)
    if key not in _SHARDED:
        # ShardFormer replaces modules in place: shard a second meta model, keep the first whole.
        remember_sharding(config, layout, world, sharded_meta_model(config, layout, world))
    return _SHARDED[key]


def build_pieces(config: Any, layout: Layout, world: SimWorld | None) -> tuple[torch.nn.Module, list[Piece]]:
    """The meta model before sharding (for name-based param groups) and, in its parameter order,
    what the plugin hands the optimizer on ``world``'s rank. Without a world: single-device."""
    model = _meta_model(config)
    if world is not None and layout.plugin == "fsdp":
        return model, _fsdp_pieces(model, layout, world)
    if world is not None and layout.plugin == "gemini":
        from .gemini import gemini_pieces

        return model, gemini_pieces(model, config, layout, world)
    if world is None or (layout.tp == 1 and layout.pp == 1 and layout.sp == 1 and layout.ep == 1):
        return model, [_piece(n, p, None, layout, world) for n, p in model.named_parameters()]
    pieces = []
    for name, shape, tp_dim, expert in _sharded_params(config, layout, world):
        pieces.append(_piece(name, torch.empty(shape, device="meta"), tp_dim, layout, world, expert))
    return model, pieces


def held_parameters(config: Any, layout: Layout) -> list[int]:
    """The parameters one rank holds, by pipeline stage (the stage's first rank; the ranks of a
    stage hold alike), as the plugin's sharding leaves them: ShardFormer's TP slices with their
    vocabulary padding and the stage's layers (ZeRO-1/2 keep the working parameters whole), or
    under FSDP and Gemini the rank's ranges of its units' flat parameters or of its chunks."""
    held = []
    for stage in range(layout.pp):
        with SimWorld(layout, layout.stage_ranks(stage)[0]) as world:
            _, pieces = build_pieces(config, layout, world)
        held.append(sum((p.master if layout.plugin in ("fsdp", "gemini") else p.working).numel() for p in pieces))
    return held


def _fsdp_pieces(model: torch.nn.Module, layout: Layout, world: SimWorld) -> list[Piece]:
    """What the FSDP plugin hands the optimizer: each parameter's range of its unit's flat
    parameter (a unit per decoder layer, as the recipe wraps), by FSDP's own layout rule
    (:func:`dist_optim.plugins.fsdp.flat_param_bounds`, checked against FSDP in the tests)."""
    from dist_optim.plugins.fsdp import aligned_numel, decoder_layer_classes, flat_param_bounds, fsdp_units

    units = fsdp_units(model, decoder_layer_classes(model))
    bounds = flat_param_bounds(units.values(), layout.world, aligned_numel(layout.working_dtype))
    unit_of = {name: unit for unit, params in units.items() for name, _ in params}
    pieces = []
    for name, param in model.named_parameters():
        zero = ZeroShard(layout.world, world.rank, 0, dist.group.WORLD, bounds[name])
        piece = ParamLayout(tuple(param.shape), None, zero)
        working = torch.empty(param.shape, dtype=layout.working_dtype, device="meta")
        pieces.append(Piece(name, working, torch.empty(piece.chunk_numel, device="meta"), piece, unit_of[name]))
    return pieces


def _piece(
    name: str, param: torch.Tensor, tp_dim: int | None, layout: Layout, world: SimWorld | None, expert: bool = False
) -> Piece:
    """``param`` as the plugin hands it to the optimizer: ZeRO-sharded over the data-parallel group,
    an ``expert``'s over the MoE data-parallel group (MoeHybridParallelPlugin's ZeRO optimizer)."""
    working = torch.empty(param.shape, dtype=layout.working_dtype, device="meta")
    if world is None:
        return Piece(name, working, torch.empty(param.shape, device="meta"), ParamLayout(tuple(param.shape)))
    full = list(param.shape)
    tp = None
    if tp_dim is not None:
        full[tp_dim] *= layout.tp
        tp = TPSplit(tp_dim, layout.tp, layout.coordinates(world.rank)[2], world.tp_group)
    zero = None
    numel = param.numel()
    if layout.zero:
        # LowLevelZeroPlugin shards over the whole world (its wrapper's param_to_pg is WORLD)
        group = world.dp_group if layout.plugin == "hybrid" else dist.group.WORLD
        size = layout.data_ranks if layout.plugin == "hybrid" else layout.world
        if expert:
            group, size = world.moe_dp_group, layout.moe_dp
        padding = (-numel) % size  # LowLevelZero: flatten, pad to a multiple of the ZeRO group size
        zero = ZeroShard(size, world._zero_rank_of(world.rank, expert), padding, group)
        master = torch.empty((numel + padding) // size, device="meta")
    else:
        master = torch.empty(param.shape, device="meta")
    return Piece(name, working, master, ParamLayout(tuple(full), tp, zero))


#: The planner's optimizers by ``--optimizer`` name: torch's AdamW (the baseline) and every entry of
#: the catalogue (:func:`dist_optim.registry.catalogue`); a variant such as ``soap`` is its base class
#: with its entry's ``plan_options``.
OPTIMIZERS: dict[str, CatalogueEntry] = {
    "adamw": CatalogueEntry("adamw", torch.optim.AdamW, transient="foreach=False (torch's per-parameter loop)"),
    **catalogue(),
}
#: The names a comparison or a sweep plans side by side (:attr:`~dist_optim.registry.CatalogueEntry.planned`):
#: a variant's plan is its base's with a few options changed, not a column of its own.
COLUMNS: tuple[str, ...] = tuple(name for name, entry in OPTIMIZERS.items() if entry.planned)


def build_optimizer(
    name: str, model: torch.nn.Module, masters: dict[str, torch.Tensor], args: dict[str, Any] | None = None
) -> torch.optim.Optimizer:
    """Optimizer ``name`` over ``masters`` (by parameter name), with its param groups made from
    the unsharded ``model`` as a user builds them before boosting. ``args``: constructor options;
    those the param-group builder names go to it (:meth:`~dist_optim.registry.CatalogueEntry.split`),
    as does a dict under the optimizer's name (``{"muon": {"per_head": True}}``). Parameters of ``model``
    missing from ``masters`` are left out of their groups, and groups left empty are dropped (the
    ideal's representatives, :func:`single_device_state`)."""
    if name not in OPTIMIZERS:
        raise PlanError(f"--optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")
    entry = OPTIMIZERS[name]
    builder_args, kwargs = entry.split({**entry.plan_options, **entry.refresh, **(args or {})})
    cls = entry.target
    params: Any
    if entry.param_groups is not None:
        groups = entry.param_groups(model, **{**builder_args, **kwargs.pop(name, {})})
        names = {id(p): n for n, p in model.named_parameters()}
        params = []
        for g in groups:
            kept = [masters[names[id(p)]] for p in g["params"] if names[id(p)] in masters]
            if kept:
                params.append({**g, "params": kept})
    else:
        params = list(masters.values())
    try:
        return cls(params, **kwargs)
    except TypeError as exc:
        raise PlanError(f"--optimizer-args for {name}: {exc}") from exc


# ---- running it ----------------------------------------------------------------------------
@dataclass
class StepResult:
    """One simulated (or measured) ``step()``."""

    traffic: StepTraffic
    transient: int  # peak bytes alive inside step() that did not outlive it
    kept: int  # bytes allocated inside step() still alive after it (new state, kept buffers)
    meta_items: int = 0  # .item() calls on meta tensors answered with 0


@dataclass
class RankResult:
    rank: int
    pieces: list[Piece]
    state_bytes: int
    bind: StepTraffic
    steps: list[StepResult]
    owner_loads: list[float]  # the optimizers' own cost per owner rank (their assign_owners inputs)
    meta_items: int
    seconds: float
    kept_bytes: int = 0  # allocated by the steps and alive after them, beyond opt.state


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``opt.state``, each storage counted once."""
    seen: dict[int, int] = {}
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                seen[value.untyped_storage()._cdata] = value.untyped_storage().nbytes()
    return sum(seen.values())


def run_steps(opt: torch.optim.Optimizer, traffic: Traffic, steps: int, meta: bool) -> list[StepResult]:
    """``steps`` calls of ``opt.step()``, each measured by ``traffic`` and :class:`LiveBytes`."""
    out = []
    shadows: dict[int, torch.Tensor] = {}
    replays = Replays(traffic)
    with replaying(replays), replaying_work(replays.work):
        for _ in range(steps):
            traffic.step = StepTraffic()
            with traffic_of(traffic), LiveBytes(answer_meta_items=meta, shadows=shadows) as live:
                replays.live = live
                opt.step()
            replays.live = None
            out.append(StepResult(traffic.step, live.peak - live.live, live.live, live.meta_items))
    return out


#: Inside :func:`sharing_zero_stages`: the simulations made there, by what they depend on.
_SHARED: dict[tuple[Any, ...], RankResult] | None = None


@contextlib.contextmanager
def sharing_zero_stages() -> Iterator[None]:
    """Inside, a rank simulated under ZeRO-1 answers for the same rank under ZeRO-2, and the other way
    round: both stages hand the optimizer the same master shards (ZeRO-2 also shards the gradients,
    which a plan counts from its layout, not from the simulation), so a sweep simulates them once
    (``tests/unit/test_plan_twins.py`` compares plans made with and without). Scoped, not for the
    whole process: a test that breaks the planner on purpose must not be answered from before."""
    global _SHARED
    previous, _SHARED = _SHARED, {}
    try:
        yield
    finally:
        _SHARED = previous


def simulate_rank(
    config: Any,
    layout: Layout,
    optimizer: str,
    args: dict[str, Any] | None,
    rank: int,
    steps: int,
    device: str = "cuda",
) -> RankResult:
    """Rank ``rank`` of ``layout``, simulated through ``steps`` optimizer steps as on ``device``
    (:func:`as_device`); inside :func:`sharing_zero_stages`, once for ZeRO-1 and ZeRO-2."""
    shared = _SHARED
    if shared is None:
        return _simulate_rank(config, layout, optimizer, args, rank, steps, device)
    shards = replace(layout, zero=min(layout.zero, 1))
    options = repr(sorted((args or {}).items()))  # as single_device_state keys them
    key = (config.to_json_string(), shards, optimizer, options, rank, steps, device)
    if key not in shared:
        shared[key] = _simulate_rank(config, layout, optimizer, args, rank, steps, device)
        return shared[key]
    return replace(shared[key], seconds=0.0)


def _simulate_rank(
    config: Any, layout: Layout, optimizer: str, args: dict[str, Any] | None, rank: int, steps: int, device: str
) -> RankResult:
    from dist_optim.base import DistOptimizer

    t0 = time.perf_counter()
    with SimWorld(layout, rank) as world, recording_owner_loads() as loads, meta_generators(), as_device(device):
        model, pieces = build_pieces(config, layout, world)
        opt = build_optimizer(optimizer, model, {p.name: p.master for p in pieces}, args)
        for p in pieces:
            p.master.grad = torch.empty_like(p.master)
        plan_logits(opt, config, pieces, world.sp_group if layout.sp > 1 else None)
        traffic = Traffic(simulate=True, peers=world.peers)
        if isinstance(opt, DistOptimizer):
            with traffic_of(traffic), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                bind_like_plugin(opt, pieces, layout, world.tp_group, world.dp_group)
        bind = traffic.step
        results = run_steps(opt, traffic, steps, meta=True)
        total = state_bytes(opt)
    meta_items = sum(s.meta_items for s in results)
    owner_loads = [sum(col) for col in zip(*loads)] if loads and len({len(x) for x in loads}) == 1 else []
    return RankResult(
        rank, pieces, total, bind, results, owner_loads, meta_items, time.perf_counter() - t0,
        kept_bytes=max(0, sum(s.kept for s in results) - total),
    )  # fmt: skip


#: A layer's index in a parameter's name (``model.layers.12.mlp...``).
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def stage_twin_key(config: Any, layout: Layout, rank: int) -> tuple[Any, ...] | None:
    """What a simulation of ``rank`` depends on besides the layout: its place in its stage's grid
    and what its stage holds (each piece's shape, TP dimension and name, the layer index counted
    from the stage's first layer). Ranks of different stages with equal keys step the same
    optimizer code on the same shapes over groups of the same sizes, so their simulations are
    equal and a plan runs one: the stages between the first and the last hold alike (a 70B plan at
    pp=8 simulates 3 stages instead of 8; ``tests/unit/test_plan_twins.py`` compares plans with and
    without). None without pipeline stages, or where pieces are not ShardFormer's."""
    if layout.pp == 1 or layout.plugin != "hybrid":
        return None
    d, _, t, q = layout.coordinates(rank)
    with SimWorld(layout, rank) as world:
        held = _sharded_params(config, layout, world)
    first = min((int(m.group(1)) for n, *_ in held if (m := _LAYER_INDEX.search(n))), default=0)

    def relative(name: str) -> str:
        return _LAYER_INDEX.sub(lambda m: f".{int(m.group(1)) - first}.", name, count=1)

    return (d, t, q, tuple((relative(n), shape, tp_dim, expert) for n, shape, tp_dim, expert in held))


class PlannedLogits:
    """The attention logits a Muon with QK-clip acts on, as this rank would measure them: every
    head of each attention module whose query projection it holds, each head's maximum 0, below
    any bound (so the step issues the clip's all-reduces, over the data-parallel group and, under
    sequence parallelism, ``sequence_group``, and scales nothing: the scaling is element-wise work
    on a few rows)."""

    def __init__(self, config: Any, pieces: Sequence[Piece], sequence_group: Any = None) -> None:
        from dist_optim.muon.qk_clip import projection_of

        self.sequence_group = sequence_group
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.heads: dict[str, int] = {}
        self.kv_heads: dict[str, int] = {}
        for p in pieces:
            found = projection_of(p.name)
            if found is not None and p.name.endswith(".weight"):
                into = self.heads if found[1] == "q" else self.kv_heads
                into[found[0]] = p.layout.local_shape[0] // self.head_dim

    def take(self) -> dict[str, Any]:
        from dist_optim.muon.qk_clip import HeadMaxima

        return {
            name: HeadMaxima(torch.zeros(heads), self.head_dim, max(1, heads // max(1, self.kv_heads.get(name, heads))))
            for name, heads in self.heads.items()
        }

    def reset(self) -> None:
        pass


def plan_logits(opt: Any, config: Any, pieces: Sequence[Piece], sequence_group: Any = None) -> None:
    """Give a Muon built with ``qk_clip_tau`` the logits its rank would measure (:class:`PlannedLogits`;
    ``sequence_group``: the ranks all_to_all sequence parallelism splits its sequences over)."""
    if getattr(opt, "qk_clip_tau", None) is not None:
        opt.attention_logits = PlannedLogits(config, pieces, sequence_group)


def bind_like_plugin(opt: Any, pieces: Sequence[Piece], layout: Layout, tp_group: Any, dp_group: Any) -> None:
    """Bind as dist_optim.plugins does for ``layout``: HybridParallelPlugin and LowLevelZeroPlugin
    through ``setup_distributed``'s layouts with the data-parallel group (the world for
    LowLevelZero), TorchDDPPlugin with whole layouts, TorchFSDPPlugin and GeminiPlugin with flat
    ranges, all with the world (Gemini's ZeRO group without tensor parallelism)."""
    layouts = {p.master: p.layout for p in pieces}
    if layout.plugin == "hybrid":
        opt.bind(layouts, dp_group=dp_group, tp_group=tp_group if layout.tp > 1 else None)
    else:
        opt.bind(layouts, dp_group=dist.group.WORLD)


#: :func:`single_device_state`'s answers in this process, by model, optimizer, options and device:
#: the ideal does not depend on the layout, and a sweep plans one optimizer under many layouts.
_IDEALS: dict[tuple[str, str, str, str], tuple[int, str]] = {}


def single_device_state(
    config: Any, optimizer: str, args: dict[str, Any] | None, device: str = "cuda"
) -> tuple[int, str]:
    """:func:`simulate_single_device`, once per model, optimizer, options and device in a process."""
    key = (config.to_json_string(), optimizer, repr(sorted((args or {}).items())), device)
    if key not in _IDEALS:
        _IDEALS[key] = simulate_single_device(config, optimizer, args, device)
    return _IDEALS[key]


def simulate_single_device(
    config: Any, optimizer: str, args: dict[str, Any] | None, device: str = "cuda"
) -> tuple[int, str]:
    """The unbound (single-device) optimizer's state bytes for the whole model, after the same
    steps as the simulation, and how it was obtained.

    An unbound optimizer's state of a parameter follows from the parameter's shape, dtype and
    param group alone, never from values (on meta tensors there are none) or from the other
    parameters. So the optimizer is built over the whole model to learn each parameter's group,
    then one parameter of each distinct (shape, dtype, param group) is stepped by the optimizer's
    own code, and its state counts once per parameter of its kind. A 70B Llama's 723 parameters
    have 6 shapes (more kinds where param groups split a shape, as Muon's split does): stepping
    the kinds instead of the model is what makes Shampoo's ideal (thousands of 1024-blocks) quick.
    Storage shared by the states of several parameters (none of the optimizers here keeps any) is
    counted once, not multiplied."""
    model, pieces = build_pieces(config, Layout(precision="fp32"), None)
    masters = {p.name: p.master for p in pieces}
    whole = build_optimizer(optimizer, model, masters, args)
    group_of = {id(t): i for i, g in enumerate(whole.param_groups) for t in g["params"]}
    kinds: dict[tuple[tuple[int, ...], torch.dtype, int], list[str]] = {}
    for name, t in masters.items():
        kinds.setdefault((tuple(t.shape), t.dtype, group_of[id(t)]), []).append(name)
    representatives = {names[0]: masters[names[0]] for names in kinds.values()}
    opt = build_optimizer(optimizer, model, representatives, args)
    for t in representatives.values():
        t.grad = torch.empty_like(t)
    plan_logits(opt, config, pieces)
    with warnings.catch_warnings(), meta_generators(), as_device(device):
        warnings.simplefilter("ignore")
        run_steps(opt, Traffic(), 2, meta=True)
    count = {id(masters[names[0]]): len(names) for names in kinds.values()}
    holders: dict[int, set[int]] = {}  # storage -> the parameters whose state holds it
    sizes: dict[int, int] = {}
    for param, state in opt.state.items():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                holders.setdefault(storage._cdata, set()).add(id(param))
                sizes[storage._cdata] = storage.nbytes()
    total = 0
    for key, nbytes in sizes.items():
        owners = holders[key]
        total += nbytes * (count[next(iter(owners))] if len(owners) == 1 else 1)
    how = (
        f"simulated on one parameter of each of its {len(kinds)} kinds (shape, dtype, param group), "
        "counted for every parameter of its kind"
    )
    return total, how


def ideal_share(layout: Layout) -> int:
    """Ranks that share one copy of the model's optimizer state: every rank (TP x DP x pipeline
    stages; with stages the ideal is the mean over them, the first and last stages hold more)."""
    return layout.world


@contextlib.contextmanager
def as_device(device: str) -> Iterator[None]:
    """Simulate as on ``device`` (one of :data:`DEVICES`) inside the block
    (:func:`dist_optim.plan.torch_internals.meta_strides_as`), after checking this torch and the name."""
    if device not in DEVICES:
        raise PlanError(f"--device {device!r}: choose one of {', '.join(DEVICES)}")
    try:
        check_torch()
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    with meta_strides_as(device):
        yield
