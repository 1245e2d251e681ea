"""``--plugin gemini``: what ColossalAI 0.5.0's GeminiPlugin (static placement, no offload: the one
configuration dist_optim runs, ``plugins.gemini.SUPPORTED``) hands the optimizer on a rank, and the
memory and traffic of its chunks beside the optimizer.

Gemini lays the parameters end to end in chunks and cuts each chunk into one equal shard per rank,
so the optimizer is handed, per parameter, the flat range of it that the rank's shard covers
(``plugins/gemini.py`` ``chunk_layout``). Which chunks there are is ColossalAI's own code run on
the meta model: its chunk size search (``search_chunk_configuration``, with the plugin's search
options), over the parameters in ``module.parameters()`` order as ``GeminiDDP`` registers them; the
packing follows ``ChunkManager.register_tensor`` (a parameter goes into the last chunk if it fits,
else opens a chunk of the searched size, or of its own size rounded up to the ranks when larger).
A model below the minimum chunk size is one chunk kept gathered: every parameter whole on every
rank. ``tests/distributed/test_plan.py`` checks the ranges against the ones the plugin binds,
``tests/unit/test_plan_gemini.py`` against GeminiDDP's for several chunk searches.

Derived, not simulated (the plan says so): the working chunk shards (bf16/fp16) and the fp32
master chunk shards, padding included; the gradients: Gemini reduce-scatters them into the
working chunk itself (``reuse_fp16_chunk``), and dist_optim's wrapper hands the optimizer fp32
copies of the rank's ranges for the step; the chunks gathered at once during the forward and
backward, and the chunks' collectives of a training step. Those two follow from the order in which
operators use the parameters, which Gemini's own parameter-operator hook
(``ColoParamOpHookManager``) records here in a forward and backward of the meta model
(:func:`parameter_events`), without and with activation checkpointing (whose recomputation in
the backward gathers again), replayed under static placement's rules (:func:`replay_chunks`):
a chunk's layout, not the layer structure, decides how often it is gathered (a Llama's layer uses
its input norm, stored after its MLP, first). The tests check the gathers against GeminiDDP's and
the bytes against real runs.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dist_optim.layout import ParamLayout, ZeroShard, shard_bounds

from .models import PlanError
from .torch_internals import meta_autocast
from .world import Layout, SimWorld

if TYPE_CHECKING:
    from .simulate import Piece

__all__ = [
    "GeminiChunk",
    "GeminiMemory",
    "gemini_chunks",
    "gemini_pieces",
    "gemini_memory",
    "gemini_rank_plan",
    "parameter_events",
    "replay_chunks",
]


@dataclass(frozen=True)
class GeminiChunk:
    """One of Gemini's chunks: ``size`` elements (its padding included), over ``ranks`` ranks;
    ``gathers``: its all-gathers in a training step without and with activation checkpointing, and
    ``peak``: the most elements of the model's chunks gathered beyond their shards at once in either
    (:func:`replay_chunks`)."""

    index: int
    size: int
    ranks: int
    keep_gathered: bool
    gathers: tuple[int, int] = (0, 0)
    peak: int = 0

    @property
    def held(self) -> int:
        """Elements of it one rank holds between uses: its shard, or all of it when kept gathered."""
        return self.size if self.keep_gathered else self.size // self.ranks


#: Gemini's chunks by model, world size and chunk search: each parameter's chunk and its
#: ``[offset, end)`` there. Every rank of a plan has the same chunks; the search runs once.
_CHUNKS: dict[tuple[Any, ...], dict[str, tuple[GeminiChunk, int, int]]] = {}


def gemini_chunks(model: torch.nn.Module, config: Any, layout: Layout) -> dict[str, tuple[GeminiChunk, int, int]]:
    """Every parameter of the meta ``model`` (by name) in Gemini's chunks for ``layout``: its
    chunk and its ``[offset, end)`` there. Needs the simulated world (the search asks for the ZeRO
    group's size, the world's)."""
    if getattr(config, "num_local_experts", None):
        raise PlanError(
            "--plugin gemini with a mixture-of-experts model: Gemini reduces a chunk once every parameter in it has "
            "its gradient, which an expert without tokens never gets; plan --plugin hybrid --ep for experts"
        )
    key = (config.to_json_string(), layout.world, layout.chunk_search)
    if key not in _CHUNKS:
        where = _pack(model, layout)
        plain, plain_peak = replay_chunks(where, parameter_events(config))
        ckpt, ckpt_peak = replay_chunks(where, parameter_events(config, checkpointed=True))
        peak = max(plain_peak, ckpt_peak)
        chunks = {c.index: replace(c, gathers=(plain[c.index], ckpt[c.index]), peak=peak) for c, _, _ in where.values()}
        _CHUNKS[key] = {name: (chunks[c.index], offset, end) for name, (c, offset, end) in where.items()}
    return _CHUNKS[key]


def _pack(model: torch.nn.Module, layout: Layout) -> dict[str, tuple[GeminiChunk, int, int]]:
    from colossalai.zero.gemini.chunk import search_chunk_configuration

    search = layout.chunk_search
    # GeminiDDP's init_chunk_manager: the search steps by hidden_dim, 1024 without one
    configs, _, _ = search_chunk_configuration(
        model,
        search_range_m=search.search_range_m,
        search_interval=search.hidden_dim or 1024,
        min_chunk_size_m=search.min_chunk_size_m,
        process_group=dist.group.WORLD,
    )
    ranks = layout.world
    ((_, chosen),) = configs.items()  # one ZeRO degree: every parameter is sharded over the world
    chunk_size, kept = int(chosen["chunk_size"]), bool(chosen["keep_gathered"])
    out: dict[str, tuple[GeminiChunk, int, int]] = {}
    chunk: GeminiChunk | None = None
    used = 0
    names = {id(p): n for n, p in model.named_parameters()}
    for param in model.parameters():
        n = param.numel()
        if chunk is None or used + n > chunk.size:
            size = chunk_size if n <= chunk_size else n + (-n % ranks)
            chunk = GeminiChunk(0 if chunk is None else chunk.index + 1, size, ranks, kept)
            used = 0
        out[names[id(param)]] = (chunk, used, used + n)
        used += n
    return out


def gemini_pieces(model: torch.nn.Module, config: Any, layout: Layout, world: SimWorld) -> list[Piece]:
    """What GeminiPlugin hands the optimizer on ``world``'s rank, in parameter order: each
    parameter's range of this rank's shard of its chunk (possibly empty), as ``chunk_layout`` reads
    it, or the whole parameter in a chunk kept gathered."""
    from .simulate import Piece

    chunks = gemini_chunks(model, config, layout)
    pieces = []
    for name, param in model.named_parameters():
        chunk, offset, end = chunks[name]
        shape = tuple(param.shape)
        if chunk.keep_gathered:
            piece = ParamLayout(shape)
        else:
            bounds = shard_bounds(offset, end - offset, chunk.held, chunk.ranks)
            piece = ParamLayout(shape, None, ZeroShard(chunk.ranks, world.rank, 0, dist.group.WORLD, bounds))
        working = torch.empty(shape, dtype=layout.working_dtype, device="meta")
        master = torch.empty(piece.chunk_numel if piece.zero is not None else shape, device="meta")
        pieces.append(Piece(name, working, master, piece, chunk=chunk))
    return pieces


#: One call of Gemini's parameter-operator hook: the phase GeminiDDP is in ("forward" or
#: "backward"), whether it is before ("pre") or after ("post") the operator, and its parameters.
Event = tuple[str, str, tuple[str, ...]]

#: The hook's calls in a training step, by model and activation checkpointing
#: (:func:`parameter_events`): the same for every rank and layout.
_EVENTS: dict[tuple[str, bool], list[Event]] = {}


def parameter_events(config: Any, checkpointed: bool = False) -> list[Event]:
    """The calls of GeminiDDP's parameter-operator hook in a forward and a backward of
    ``config``'s model (with every decoder layer ``checkpointed`` as the recipe does it, or not):
    ColossalAI's own ``ColoParamOpHookManager`` on the meta model, its parameters made
    ``ColoParameter`` as GeminiDDP makes them, on a few tokens (the order does not depend on their
    number)."""
    from colossalai.tensor.colo_parameter import ColoParameter
    from colossalai.tensor.param_op_hook import ColoParamOpHook, ColoParamOpHookManager

    from .simulate import _meta_model

    key = (config.to_json_string(), checkpointed)
    if key in _EVENTS:
        return _EVENTS[key]
    model = _meta_model(config)
    if checkpointed:  # as the recipe, but the RNG state: torch cannot fork a meta generator
        model.gradient_checkpointing_enable({"use_reentrant": False, "preserve_rng_state": False})
    model.train()
    names = {id(p): n for n, p in model.named_parameters()}
    for param in model.parameters():
        param.__class__ = ColoParameter
    events: list[Event] = []

    class Recorder(ColoParamOpHook):
        phase = "forward"

        def pre_forward(self, params: list[torch.Tensor]) -> None:
            events.append((self.phase, "pre", tuple(names[id(p)] for p in params)))

        def post_forward(self, params: list[torch.Tensor]) -> None:
            events.append((self.phase, "post", tuple(names[id(p)] for p in params)))

        pre_backward = pre_forward
        post_backward = post_forward

    recorder = Recorder()
    ids = torch.zeros((1, 4), dtype=torch.long, device="meta")
    with meta_autocast(), ColoParamOpHookManager.use_hooks(recorder), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = model(input_ids=ids, labels=ids).loss
        recorder.phase = "backward"  # GeminiDDP.backward's switch_to_backward
        loss.backward()
    _EVENTS[key] = events
    return events


def replay_chunks(
    where: dict[str, tuple[GeminiChunk, int, int]], events: Sequence[Event]
) -> tuple[collections.Counter[int], int]:
    """How many times each sharded chunk (by index) is all-gathered in a training step of
    ``events`` (:func:`parameter_events`), and the most elements gathered beyond the shards at once,
    by the tensor states of ColossalAI 0.5.0's Gemini under static placement without prefetch
    (``GeminiZeROHook``, ``StaticPlacementPolicy.evict_tensors``, ``GeminiDDP.grad_handle``):

    * before an operator its parameters start computing, every gathered chunk it does not use whose
      parameters are all held (none computing, none with its gradient) is released, and its
      chunks not gathered are gathered;
    * after it, its parameters are held again (in the backward: held after the backward), and in
      the backward a parameter has its gradient after its last operator; a chunk all of whose
      parameters have theirs is reduce-scattered, no longer gathered, its parameters held.

    A chunk kept gathered is never gathered nor released. The forward's last chunks stay gathered
    into the backward; under activation checkpointing a layer's operators run again in the
    backward, while the operator whose gradient started the recomputation still computes."""
    chunk_of = {name: chunk for name, (chunk, _, _) in where.items()}
    sharded = {c.index: c for c in chunk_of.values() if not c.keep_gathered}
    members: dict[int, list[str]] = {}
    for name, chunk in chunk_of.items():
        members.setdefault(chunk.index, []).append(name)
    last = {
        name: i for i, (phase, kind, op) in enumerate(events) if phase == "backward" and kind == "post" for name in op
    }
    state = dict.fromkeys(chunk_of, "held")
    gathered: set[int] = set()
    gathers: collections.Counter[int] = collections.Counter()
    peak = 0
    for i, (_phase, kind, op) in enumerate(events):
        used = {chunk_of[n].index for n in op} & sharded.keys()
        if kind == "pre":
            state.update(dict.fromkeys((n for n in op if state[n] == "held"), "computing"))
            gathered -= {c for c in gathered - used if all(state[n] == "held" for n in members[c])}
            gathers.update(used - gathered)
            gathered |= used
            peak = max(peak, sum(sharded[c].size - sharded[c].held for c in gathered))
            continue
        state.update(dict.fromkeys((n for n in op if state[n] == "computing"), "held"))
        for name in (n for n in op if last.get(n) == i):
            state[name] = "graded"
            index = chunk_of[name].index
            if all(state[n] == "graded" for n in members[index]):
                state.update(dict.fromkeys(members[index], "held"))
                gathered.discard(index)
    return gathers, peak


@dataclass(frozen=True)
class GeminiMemory:
    """Gemini's bytes beside the optimizer on one rank, and its chunks' traffic (derived)."""

    working: int  # the working-precision chunk shards (kept-gathered chunks whole)
    masters: int  # the fp32 master chunk shards
    gradients: int  # the fp32 gradients dist_optim's wrapper hands the optimizer for a step
    gathered: int  # working-precision bytes of chunks gathered at once in the forward and backward
    sent: tuple[float, float]  # bytes a training step's chunk collectives send, without and with checkpointing


def gemini_rank_plan(plan: Any, pieces: Sequence[Piece], dtype: torch.dtype) -> Any:
    """``plan`` (a :class:`~dist_optim.plan.RankPlan` of ``pieces``) with Gemini's bytes beside the
    optimizer and its chunks' traffic (:func:`gemini_memory`) in place of the ZeRO plugins'."""
    memory = gemini_memory(pieces, dtype)
    return replace(
        plan,
        working_params=memory.working,
        fp32_masters=memory.masters,
        gradients=memory.gradients,
        gemini_gathered=memory.gathered,
        gemini_sent=memory.sent,
    )


def gemini_memory(pieces: Sequence[Piece], dtype: torch.dtype) -> GeminiMemory:
    """Derived from Gemini's rules for the chunks of ``pieces`` in working ``dtype``:

    * between steps a rank holds its shard of every working chunk and of every fp32 master chunk
      (padding included), a chunk kept gathered whole;
    * the reduced gradients overwrite the working shard (``reuse_fp16_chunk``, the default with
      master weights); dist_optim's wrapper copies the rank's ranges to fp32 for the step;
    * during the forward and backward, the chunks :func:`replay_chunks` finds gathered at once,
      beside the shards they replace, plus the largest parameter's gradient before it is copied
      into its chunk;
    * per training step, without and with activation checkpointing, each sharded chunk is
      all-gathered as often as :func:`replay_chunks` finds (``(g-1)/g`` of the chunk each time) and
      its gradients reduce-scattered (``(g-1)/g``); a chunk kept gathered all-reduces its gradients
      (``2 (g-1)/g``)."""
    chunks = {p.chunk.index: p.chunk for p in pieces if p.chunk is not None}.values()
    size = dtype.itemsize
    held = sum(c.held for c in chunks)

    def sent(checkpointed: int) -> float:
        # a sharded chunk: its all-gathers and one reduce-scatter; a kept one: one all-reduce
        rounds = [(c.gathers[checkpointed] + 1 if not c.keep_gathered else 2, c) for c in chunks]
        return float(sum((Fraction(n * (c.ranks - 1) * c.size * size, c.ranks) for n, c in rounds), Fraction(0)))

    peak = max((c.peak for c in chunks), default=0)
    return GeminiMemory(
        working=held * size,
        masters=held * 4,
        gradients=sum(p.master.numel() for p in pieces) * 4,
        gathered=(peak + max((p.working.numel() for p in pieces), default=0)) * size,
        sent=(sent(0), sent(1)),
    )
