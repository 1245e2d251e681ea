"""The simulated job: a parallel layout as the plugins take it (:class:`Layout`) and one rank of it
on the ``fake`` backend (:class:`SimWorld`), laid out as HybridParallelPlugin lays out its ranks."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .models import PlanError

__all__ = [
    "PLUGINS",
    "PP_STYLES",
    "PRECISIONS",
    "ChunkSearch",
    "Layout",
    "SimWorld",
    "install_cpu_shims",
    "meta_device_mesh",
]

PLUGINS = ("hybrid", "zero", "ddp", "fsdp", "gemini")
#: HybridParallelPlugin's ``pp_style`` values the planner simulates (``zbv`` is not).
PP_STYLES = ("1f1b", "interleaved")
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ChunkSearch:
    """GeminiPlugin's chunk search options, by its keyword names, with its defaults (ColossalAI
    0.5.0): the chunk size is searched from the largest parameter (or ``min_chunk_size_m`` Mi
    elements) over ``search_range_m`` Mi elements in steps of ``hidden_dim`` (1024 when None), and
    a model smaller than ``min_chunk_size_m`` is kept in one chunk, whole on every rank."""

    min_chunk_size_m: float = 32
    search_range_m: float = 32
    hidden_dim: int | None = None

    def describe(self) -> str:
        if self == ChunkSearch():
            return ""
        step = self.hidden_dim or 1024
        return f", chunk search from {self.min_chunk_size_m} Mi over {self.search_range_m} Mi in steps of {step}"


@dataclass(frozen=True)
class Layout:
    """A parallel layout as the plugins take it. Pipeline stages (``pp``) run HybridParallelPlugin's
    ``pp_style``: its one-forward-one-backward schedule (``1f1b``), or the interleaved one, where
    each stage holds ``num_model_chunks`` chunks of the layers (``interleaved``). Expert parallelism
    (``ep`` > 1) is MoeHybridParallelPlugin's:
    its ``dp`` data-parallel ranks are ``ep`` expert-parallel x ``dp / ep`` MoE data-parallel ranks
    (:attr:`moe_dp`); the model must have experts for it
    (:func:`~dist_optim.plan.models.check_model_layout`)."""

    plugin: str = "hybrid"
    tp: int = 1
    pp: int = 1
    zero: int = 0
    dp: int = 1
    ep: int = 1
    precision: str = "bf16"
    sp: int = 1  # sequence parallelism, the recipe's all_to_all mode (ZeRO and gradients over dp x sp)
    pp_style: str = "1f1b"  # HybridParallelPlugin's pp_style
    num_model_chunks: int = 1  # its num_model_chunks: layer chunks per stage (interleaved only)
    #: ZeRO's ``cpu_offload``: fp32 masters, their gradients and the optimizer in host memory.
    cpu_offload: bool = False
    #: GeminiPlugin's chunk search (``--plugin gemini`` only).
    chunk_search: ChunkSearch = ChunkSearch()

    def __post_init__(self) -> None:
        if self.plugin not in PLUGINS:
            raise PlanError(f"--plugin {self.plugin!r}: choose one of {', '.join(PLUGINS)}")
        if self.plugin == "gemini" or self.chunk_search != ChunkSearch():
            self._check_gemini()
        if self.precision not in PRECISIONS:
            raise PlanError(f"--precision {self.precision!r}: choose one of {', '.join(PRECISIONS)}")
        for name in ("tp", "pp", "dp", "ep", "sp"):
            if getattr(self, name) < 1:
                raise PlanError(f"--{name} {getattr(self, name)}: must be at least 1")
        if self.zero not in (0, 1, 2):
            raise PlanError(
                f"--zero {self.zero}: ZeRO stage 0, 1 or 2 (for parameters sharded too, plan --plugin fsdp)"
            )
        if self.pp > 1 and self.plugin != "hybrid":
            raise PlanError(f"--pp {self.pp} needs --plugin hybrid (the {self.plugin} plugin has no pipeline stages)")
        if self.sp > 1 and (self.plugin != "hybrid" or self.pp > 1):
            raise PlanError(
                f"--sp {self.sp} needs --plugin hybrid without --pp (the recipe's all_to_all sequence parallelism)"
            )
        if self.plugin == "hybrid" and self.zero and self.precision == "fp32":
            raise PlanError(
                f"--zero {self.zero} with --precision fp32: HybridParallelPlugin's ZeRO takes bf16 or fp16, "
                "or plan --zero 0"
            )
        if self.pp > 1 and self.zero > 1:
            raise PlanError(
                f"--zero {self.zero} with --pp {self.pp}: HybridParallelPlugin takes ZeRO 0 or 1 with pipeline stages"
            )
        if self.plugin != "hybrid" and self.tp > 1:
            raise PlanError(
                f"--tp {self.tp} needs --plugin hybrid (the {self.plugin} plugin has no tensor parallelism)"
            )
        self._check_data_parallel_plugins()
        if self.cpu_offload and not self.zero:
            raise PlanError(
                "--cpu-offload is ZeRO's (it moves the fp32 masters and the optimizer to host memory): "
                "add --zero 1 or --zero 2 (plugin hybrid or zero)"
            )
        self._check_schedule()
        if self.ep > 1:
            self._check_experts()

    def _check_data_parallel_plugins(self) -> None:
        """What LowLevelZeroPlugin, TorchDDPPlugin and TorchFSDPPlugin take, refused in one line."""
        if self.plugin == "zero" and self.zero == 0:
            raise PlanError("--plugin zero needs --zero 1 or 2 (LowLevelZeroPlugin always shards)")
        if self.plugin == "fsdp" and (self.zero or self.precision == "fp16"):
            raise PlanError(
                "--plugin fsdp runs --zero 0 (FSDP shards parameters, gradients and states itself) with --precision "
                "fp32 or bf16 (its plugin has no loss scaling)"
            )
        if self.plugin == "ddp" and (self.zero or self.precision != "fp32"):
            raise PlanError(
                "--plugin ddp runs --zero 0 --precision fp32 (TorchDDPPlugin has no ZeRO or mixed precision)"
            )

    def _check_gemini(self) -> None:
        """What dist_optim runs under GeminiPlugin (``plugins.gemini.SUPPORTED``: static placement
        without offload, ``tp_size=1``) and GeminiPlugin itself takes, refused in one line."""
        if self.plugin != "gemini":
            raise PlanError(
                "--min-chunk-size-m, --search-range-m and --hidden-dim are Gemini's chunk search: add --plugin gemini"
            )
        if self.tp > 1:
            raise PlanError(
                f"--tp {self.tp} with --plugin gemini: dist_optim runs Gemini with tp_size=1; plan --plugin hybrid "
                f"--tp {self.tp} --zero 1 for tensor parallelism with ZeRO"
            )
        if self.cpu_offload:
            raise PlanError(
                "--cpu-offload with --plugin gemini: dist_optim runs Gemini's static placement without offload; "
                "plan --plugin zero --zero 2 --cpu-offload for masters and optimizer states in host memory"
            )
        if self.zero:
            raise PlanError(
                f"--zero {self.zero} with --plugin gemini: Gemini shards parameters, gradients and masters in its "
                "chunks itself; plan --plugin gemini without --zero"
            )
        if self.precision == "fp32":
            raise PlanError(
                "--precision fp32 with --plugin gemini: GeminiPlugin takes bf16 or fp16 working chunks beside its "
                "fp32 masters; plan --precision bf16"
            )

    def _check_schedule(self) -> None:
        """HybridParallelPlugin's asserts on ``pp_style`` and ``num_model_chunks`` (ColossalAI 0.5.0),
        as one line each."""
        style, k = self.pp_style, self.num_model_chunks
        if style not in PP_STYLES:
            raise PlanError(f"--pp-style {style!r}: choose one of {', '.join(PP_STYLES)} (zbv is not simulated)")
        if style == "interleaved" and self.pp < 2:
            raise PlanError(
                f"--pp-style interleaved with --pp {self.pp}: the schedule runs over stages; use --pp 2 or more"
            )
        if style == "interleaved" and k < 2:
            raise PlanError(
                f"--num-model-chunks {k} with --pp-style interleaved: the interleaved schedule needs at least 2 "
                "chunks per stage; use --num-model-chunks 2 or more"
            )
        if style != "interleaved" and k != 1:
            raise PlanError(
                f"--num-model-chunks {k} with --pp-style {style}: 1F1B runs one chunk per stage; "
                "add --pp-style interleaved or drop --num-model-chunks"
            )

    def _check_experts(self) -> None:
        """MoeHybridParallelPlugin's own conditions on ``ep`` (ColossalAI 0.5.0), refused here in one
        line before it would assert or fail on rank 0, and the combinations not simulated."""
        ep = self.ep
        if self.plugin != "hybrid":
            raise PlanError(f"--ep {ep} needs --plugin hybrid (expert parallelism is MoeHybridParallelPlugin's)")
        if self.dp % ep:
            choices = ", ".join(str(d) for d in range(1, self.dp + 1) if self.dp % d == 0)
            raise PlanError(
                f"--ep {ep}: must divide the {self.dp} data-parallel ranks (MoeHybridParallelPlugin splits them into "
                f"ep x MoE data-parallel ranks); choose --ep among {choices}, or a --dp that {ep} divides"
            )
        if self.zero != 1:
            # ZeRO-0 with dp > 1 wraps the model in torch DDP, which ColossalAI refuses when the MoE
            # data-parallel group is not the data-parallel group (always so with ep > 1); ZeRO-2 it
            # silently runs as ZeRO-1 (its warning: ZeRO-2 hangs when some experts get no tokens).
            raise PlanError(
                f"--ep {ep} with --zero {self.zero}: MoeHybridParallelPlugin runs expert parallelism with ZeRO-1 "
                "only (ZeRO-0 would wrap the model in torch DDP, which it refuses with experts split; ZeRO-2 it "
                "turns into ZeRO-1); plan --zero 1"
            )
        if self.pp > 1 or self.sp > 1:
            raise PlanError(
                f"--ep {ep} with --{'pp' if self.pp > 1 else 'sp'} {max(self.pp, self.sp)}: expert parallelism is "
                "simulated without pipeline stages or sequence parallelism; plan --ep with --tp and --dp"
            )

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.sp

    @property
    def data_ranks(self) -> int:
        """Ranks that reduce each gradient and share ZeRO's partitions: dp, times sp with sequence
        parallelism (HybridParallelPlugin's ``mixed_dp_group``)."""
        return self.dp * self.sp

    @property
    def moe_dp(self) -> int:
        """MoE data-parallel ranks: those holding the same experts, over which ZeRO shards them."""
        return self.dp // self.ep

    def coordinates(self, rank: int) -> tuple[int, int, int, int]:
        """``rank``'s (dp, pp, tp, sp) coordinates in HybridParallelPlugin's ProcessGroupMesh(dp, pp,
        tp, sp) (its default ``dp_outside``; the sp axis innermost in the all_to_all mode). With
        experts, MoeHybridParallelPlugin's mesh (moe_dp, pp, ep, tp, sp) (its ``moe_dp_outside``):
        the data-parallel index is ``moe_dp_index x ep + ep_index``, the order of its dp group."""
        q, rest = rank % self.sp, rank // self.sp
        t, rest = rest % self.tp, rest // self.tp
        e, rest = rest % self.ep, rest // self.ep
        return (rest // self.pp) * self.ep + e, rest % self.pp, t, q

    def rank_of(self, d: int, s: int, t: int, q: int) -> int:
        m, e = divmod(d, self.ep)
        return (((m * self.pp + s) * self.ep + e) * self.tp + t) * self.sp + q

    def expert_index(self, rank: int) -> int:
        """``rank``'s place in its expert-parallel group: which ``1/ep`` of the experts it holds."""
        return self.coordinates(rank)[0] % self.ep

    @property
    def uses_torch_ddp(self) -> bool:
        """Whether the plugin wraps the model in torch's DistributedDataParallel, whose reducer keeps
        gradient buckets as large as the model's local parameters beside ``.grad`` (the plugins'
        default ``gradient_as_bucket_view=False``): TorchDDPPlugin always; HybridParallelPlugin by
        ColossalAI 0.5.0's rule (``HybridParallelPlugin.boost``: dp > 1 without ZeRO, or dp == 1,
        both without pipeline stages); LowLevelZeroPlugin never."""
        if self.plugin == "ddp":
            return True
        if self.plugin == "hybrid":
            return self.pp == 1 and (self.data_ranks == 1 or self.zero == 0)
        return False

    @property
    def zero_size(self) -> int:
        """Ranks one parameter's ZeRO chunks are spread over (0: no ZeRO)."""
        return self.data_ranks if self.zero else 0

    @property
    def working_dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision]

    def describe(self) -> str:
        zero = f" x ZeRO-{self.zero}" if self.zero else ""
        pp = f" x pp={self.pp}" if self.pp > 1 else ""
        if self.pp_style == "interleaved":
            pp += f" (interleaved, {self.num_model_chunks} chunks)"
        sp = f" x sp={self.sp}" if self.sp > 1 else ""
        ep = f" (ep={self.ep} x moe_dp={self.moe_dp})" if self.ep > 1 else ""
        kind = self.precision + (", CPU offload" if self.cpu_offload else "")
        if self.plugin == "fsdp":
            zero = " x FSDP full shard, a unit per decoder layer"
        if self.plugin == "gemini":
            zero = f" x Gemini static chunks{self.chunk_search.describe()}"
        return f"{self.plugin} tp={self.tp}{pp}{sp} x dp={self.dp}{ep}{zero} ({self.world} ranks, {kind})"

    def stage_of(self, rank: int) -> int:
        """``rank``'s pipeline stage in HybridParallelPlugin's mesh."""
        return self.coordinates(rank)[1]

    def stage_ranks(self, stage: int) -> list[int]:
        return [r for r in range(self.world) if self.stage_of(r) == stage]

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage (tp x dp x sp)."""
        return self.tp * self.dp * self.sp


# ---- the simulated world ------------------------------------------------------------------
def install_cpu_shims() -> None:
    """ColossalAI's CPU accelerator lacks calls ShardFormer makes (random state with a device
    argument, ...); :mod:`dist_optim.plugins.cpu` fills them, so ShardFormer runs without a GPU."""
    from dist_optim.plugins.cpu import install

    install()


#: torch's switch for a store barrier at the end of init_process_group and new_group.
_INIT_BARRIER = "TORCH_DIST_INIT_BARRIER"


@contextlib.contextmanager
def _without_init_barrier() -> Iterator[None]:
    """``TORCH_DIST_INIT_BARRIER`` off inside, as it was after. A cluster's environment may set it;
    its barrier needs a store the fake backend's does not have, and one simulated rank has nobody to
    wait for."""
    before = os.environ.get(_INIT_BARRIER)
    os.environ[_INIT_BARRIER] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_INIT_BARRIER, None)
        else:
            os.environ[_INIT_BARRIER] = before


def _destroy_if_initialized() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class SimWorld:
    """``rank`` of a job of ``layout.world`` ranks on the ``fake`` backend (collectives are
    no-ops; groups, ranks and sizes are real), with its TP, data-parallel and pipeline groups laid
    out as HybridParallelPlugin's ProcessGroupMesh(dp, pp, tp) (its default ``dp_outside=True``):
    TP innermost, data parallelism outermost (rank ``(d * pp + s) * tp + t``). With pipeline stages
    it also holds ColossalAI's own mesh and PipelineStageManager over those groups, for
    ShardFormer's stage split."""

    def __init__(self, layout: Layout, rank: int) -> None:
        if not 0 <= rank < layout.world:
            raise PlanError(f"rank {rank} is outside a world of {layout.world}")
        self.layout = layout
        self.rank = rank
        # zero_rank by rank: an all_gather_object of holdings asks it per parameter and member,
        # each a walk of the data-parallel group
        self._zero_ranks: dict[int, int] = {}
        self.tp_group: Any = None
        self.dp_group: Any = None
        self.stage_manager: Any = None
        self.sp_group: Any = None
        self.ep_group: Any = None  # MoeHybridParallelPlugin's groups, with ep > 1
        self.moe_dp_group: Any = None
        self._undo = contextlib.ExitStack()  # what __enter__ set up, undone at __exit__

    def tp_ranks(self, rank: int) -> tuple[int, ...]:
        d, s, _, q = self.layout.coordinates(rank)
        return tuple(self.layout.rank_of(d, s, t, q) for t in range(self.layout.tp))

    def stage(self, rank: int) -> int:
        return self.layout.stage_of(rank)

    def dp_ranks(self, rank: int) -> tuple[int, ...]:
        """The data-parallel group (with sequence parallelism, the plugin's dp x sp group), sorted."""
        _, s, t, _ = self.layout.coordinates(rank)
        lay = self.layout
        return tuple(sorted(lay.rank_of(d, s, t, q) for d in range(lay.dp) for q in range(lay.sp)))

    def pp_ranks(self, rank: int) -> tuple[int, ...]:
        d, _, t, q = self.layout.coordinates(rank)
        return tuple(self.layout.rank_of(d, s, t, q) for s in range(self.layout.pp))

    def sp_ranks(self, rank: int) -> tuple[int, ...]:
        d, s, t, _ = self.layout.coordinates(rank)
        return tuple(self.layout.rank_of(d, s, t, q) for q in range(self.layout.sp))

    def moe_dp_ranks(self, rank: int) -> tuple[int, ...]:
        """The ranks holding the same experts as ``rank`` (ZeRO's group for them), sorted."""
        d, s, t, q = self.layout.coordinates(rank)
        lay = self.layout
        return tuple(lay.rank_of(m * lay.ep + d % lay.ep, s, t, q) for m in range(lay.moe_dp))

    def ep_ranks(self, rank: int) -> tuple[int, ...]:
        """The ranks over which ``rank``'s data-parallel group's experts are split, sorted."""
        d, s, t, q = self.layout.coordinates(rank)
        lay = self.layout
        return tuple(lay.rank_of(d - d % lay.ep + e, s, t, q) for e in range(lay.ep))

    def zero_rank(self, rank: int) -> int:
        """``rank``'s index in its ZeRO group (its data-parallel group)."""
        found = self._zero_ranks.get(rank)
        if found is None:
            found = self._zero_ranks[rank] = self.dp_ranks(rank).index(rank)
        return found

    def __enter__(self) -> SimWorld:
        if dist.is_initialized():
            raise PlanError("the planner needs its own process: a process group is already initialised here")
        with contextlib.ExitStack() as stack:  # undone here if the set-up fails, else at __exit__
            stack.enter_context(_without_init_barrier())
            stack.callback(_destroy_if_initialized)
            self._connect()
            self._undo = stack.pop_all()
        return self

    def _connect(self) -> None:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=self.rank, world_size=self.layout.world)
        self.tp_group = dist.new_group(list(self.tp_ranks(self.rank)))
        self.dp_group = dist.new_group(list(self.dp_ranks(self.rank)))
        # The plugin's sequence-parallel group; without sequence parallelism this rank alone (a
        # ShardConfig without one would reduce the loss over the whole world).
        self.sp_group = dist.new_group(list(self.sp_ranks(self.rank)))
        if self.layout.ep > 1:
            self.ep_group = dist.new_group(list(self.ep_ranks(self.rank)))
            self.moe_dp_group = dist.new_group(list(self.moe_dp_ranks(self.rank)))
        self.stage_manager = None
        if self.layout.pp > 1:
            from colossalai.cluster import ProcessGroupMesh
            from colossalai.pipeline.stage_manager import PipelineStageManager

            mesh = ProcessGroupMesh(self.layout.dp, self.layout.pp, self.layout.tp, self.layout.sp)
            # as HybridParallelPlugin makes it for its pp_style (ShardFormer reads the chunks from it)
            interleaved = self.layout.pp_style == "interleaved"
            self.stage_manager = PipelineStageManager(
                mesh, pipeline_axis=1, enable_interleave=interleaved, num_model_chunks=self.layout.num_model_chunks
            )

    def __exit__(self, *exc: Any) -> None:
        self._undo.close()

    def peers(self, obj: Any, group: Any) -> list[Any]:
        """What every member of ``group`` sends in an ``all_gather_object`` of ``obj``: this rank's
        object with its TP and ZeRO ranks and its groups replaced by the member's. The objects
        dist_optim exchanges are holdings (``owners.holding``) and group keys (``comm.spanning_groups``);
        anything else is a gap of the simulation and raises."""
        members = list(dist.get_process_group_ranks(group) if group is not None else range(self.layout.world))
        # Holdings exchanged among ranks that hold the same experts (their ZeRO group or its TP grid)
        # are of expert parameters, ZeRO-sharded over the MoE data-parallel group; any other group
        # spans several expert sets and exchanges shared parameters.
        experts = self.layout.ep > 1 and len({self.layout.expert_index(m) for m in members}) == 1
        return [self._as(obj, m, experts) for m in members]

    def _as(self, obj: Any, member: int, experts: bool = False) -> Any:
        if _is_holding(obj):
            shape, tp_rank, zero_rank = obj
            return (
                shape,
                None if tp_rank is None else self.layout.coordinates(member)[2],
                None if zero_rank is None else self._zero_rank_of(member, experts),
            )
        if isinstance(obj, tuple) and obj and all(isinstance(i, int) for i in obj):
            every = tuple(range(self.layout.world))
            for ranks_of in (self.tp_ranks, self.dp_ranks, self.pp_ranks, self.moe_dp_ranks, lambda r: every):
                if obj == ranks_of(self.rank):
                    return ranks_of(member)
        elif isinstance(obj, (list, tuple)):
            return type(obj)(self._as(x, member, experts) for x in obj)
        raise PlanError(f"the simulation cannot tell what other ranks send for {obj!r} (all_gather_object)")

    def _zero_rank_of(self, member: int, expert: bool = False) -> int:
        """``member``'s rank in the ZeRO group of a parameter (``expert``: of an expert's)."""
        if expert:
            return self.moe_dp_ranks(member).index(member)
        return member if self.layout.plugin == "zero" else self.zero_rank(member)


def _is_holding(obj: Any) -> bool:
    return (
        isinstance(obj, tuple)
        and len(obj) == 3
        and isinstance(obj[0], tuple)
        and all(isinstance(i, int) for i in obj[0])
        and all(x is None or isinstance(x, int) for x in obj[1:])
    )


@contextlib.contextmanager
def meta_device_mesh() -> Iterator[None]:
    """ColossalAI's DeviceMesh maps a group's backend to a device; teach it that the ``fake``
    backend's tensors live on the meta device, for the duration of the sharding."""
    from colossalai.device.device_mesh import DeviceMesh

    table = DeviceMesh._DIST_BACKEND
    table["meta"] = "fake"
    try:
        yield
    finally:
        table.pop("meta", None)
