"""The optimizer class: a coordinator of the package's parts (see :mod:`dist_optim.galore`).

A step counts each parameter's step and makes its :class:`~.state.GaLoreMatrix`; refreshing parameters get
new projectors (:func:`.coordination.refresh`: pieces to an owner, SVD, each rank's partition back).
Then bucket by bucket: the whole projectors are gathered from their partitions
(:func:`.coordination.start_gather_projectors`: the next bucket's travel while one computes, the
first bucket's, between refreshes, during the NaN/Inf check), every GaLore parameter's low-rank
gradient is projected and reduce-scattered over its holders (:func:`.coordination.project_all`),
this rank's partition of its low-rank AdamW moments updated (:func:`.adamw.low_rank_adamw`), the
normalised step gathered (:func:`.coordination.gather_steps`) and projected back onto this rank's
elements (:func:`.projection.add_back_projection`). Plain parameters get AdamW (:mod:`.adamw`).
"""

from __future__ import annotations

import collections
import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..base import DistOptimizer
from ..checks import group_lr
from ..comm import group_size
from ..kernels.multi_tensor import scale_
from ..layout import ParamLayout
from ..sharding.budget import DEFAULT_BUCKET_BYTES, buckets, check_bucket_bytes
from ..sharding.partition import all_gather_parts, live_groups, partition_span
from ..sharding.runtime import OwnerRuntime
from ..states import bnb, codecs
from .adamw import fused_plain_adamw, low_rank_adamw, plain_adamw_update
from .coordination import (
    ProjectorGathering,
    gather_steps,
    plan_refresh,
    project_all,
    refresh,
    shared_absmax,
    start_gather_projectors,
)
from .geometry import low_rank_shape, projection_side
from .options import GROUP_DEFAULTS, OPTIMIZER_WIDE, check_full_shape, check_optimizer_options, validate_options
from .projection import add_back_projection
from .state import (
    LOW_RANK,
    MOMENTS,
    GaLoreMatrix,
    Partitioned,
    carry_over,
    init_plain_state,
    keeps_saved_dtype,
    low_rank_numel,
    new_item,
    projector_numel,
    state_partitions,
)

__all__ = ["DistributedGaLore"]


class DistributedGaLore(DistOptimizer):
    """GaLore AdamW (optionally with 8-bit moments), exact under TP and ZeRO (the package docstring).

    Args:
        params: parameters or groups. Groups with a ``rank`` key are GaLore groups (2-D params
            only) and may set ``update_proj_gap`` (default 200), ``scale`` (0.25) and
            ``proj_type`` (``std``); see :func:`galore_param_groups`.
        lr: learning rate.
        betas: moment coefficients in [0, 1).
        eps: added to the denominator (where: see ``adam_style``).
        weight_decay: decoupled weight decay.
        correct_bias: bias-correct the moments (bitsandbytes always does: its conversions set True).
        optim_bits: 32 (fp32 moments) or 8 (8-bit block-wise low-rank moments).
        min_8bit_size: low-rank moments with fewer elements stay fp32 (bitsandbytes' rule).
        is_paged: paged moment memory (CUDA only; bitsandbytes).
        adam_style: ``"hf"`` (galore_torch.GaLoreAdamW) or ``"bnb"`` (the bitsandbytes-based
            GaLoreAdamW8bit); defaults to ``"bnb"`` when ``args`` is given, else ``"hf"``.
        args: bitsandbytes quantisation arguments (``optim_bits``, ``min_8bit_size``, ...) that
            override the keyword ones, as bitsandbytes' ``args``; ColossalAI passes them.
        projector_dtype: storage dtype of the projectors. ``None``: ``torch.float16`` with
            ``optim_bits=8`` (see the package docstring), else the gradient's dtype, as galore_torch.
            Projections always multiply in the gradient's dtype.
        nonfinite: a step with a NaN/Inf gradient ``"raise"`` (default), ``"skip"`` or
            ``"ignore"`` (see :class:`~dist_optim.base.DistOptimizer`).
        bucket_bytes: the step-memory budget (:mod:`dist_optim.sharding.budget`; default
            ``DEFAULT_BUCKET_BYTES``, None: one bucket per step). A refresh goes through the GaLore
            parameters in buckets of at most this many bytes of *full* gradients (what an SVD owner
            assembles), the projection and update in buckets of this many bytes of low-rank
            gradients and whole projectors (the partial sums sent and received, the projectors
            gathered from their partitions). Results are bit-identical for every
            value; only the number of collectives (one set per bucket) changes.
    """

    #: Moments of plain-AdamW params are param-shaped; GaLore params' states are full-form.
    _sharded_state = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        correct_bias: bool = True,
        optim_bits: int = 32,
        min_8bit_size: int = 4096,
        is_paged: bool = False,
        adam_style: str | None = None,
        args: Any = None,
        projector_dtype: torch.dtype | None = None,
        *,
        nonfinite: str = "raise",
        bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
    ) -> None:
        if args is not None:
            quant = bnb.quant_args(args, "DistributedGaLore")
            optim_bits = quant.get("optim_bits", optim_bits)
            min_8bit_size = quant.get("min_8bit_size", min_8bit_size)
        if adam_style is None:
            adam_style = "bnb" if args is not None else "hf"
        # Not group options (options.py says why): checked once here; every group's in validate_group.
        check_optimizer_options(optim_bits, min_8bit_size, adam_style, projector_dtype)
        self.bucket_bytes = check_bucket_bytes(bucket_bytes)
        self.projector_dtype = projector_dtype
        self.optim_bits = int(optim_bits)
        self.min_8bit_size = int(min_8bit_size)
        self.is_paged = bool(is_paged)
        self._buffers = bnb.Buffers(self.is_paged, "DistributedGaLore")
        self.adam_style = adam_style
        #: Bytes this rank moved per kind (at a refresh: pieces routed to SVD owners, whole
        #: gradients gathered, projectors scattered by their owners; every step: projectors
        #: gathered, low-rank partial sums) and the number of refresh steps.
        self.comm_stats: collections.Counter[str] = collections.Counter()
        self._shapes_checked = False
        #: Who computes each matrix's SVDs (this rank alone until bound, then over the TP x
        #: data-parallel grids made at bind; tasks planned at the first refresh after binding or a
        #: new group: :func:`.coordination.plan_refresh`), and the refresh's exchanges.
        self.owner_runtime = OwnerRuntime()
        self._groups_cache: dict[torch.Tensor, tuple[ParamLayout, tuple[Any, ...], tuple[Any, ...]]] = {}
        # betas is checked with the group (validate_group); a list becomes the usual tuple
        betas = tuple(betas) if isinstance(betas, list) else betas
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, correct_bias=bool(correct_bias))
        super().__init__(params, defaults, nonfinite=nonfinite)  # validate_group checks every group
        if not any("rank" in g for g in self.param_groups):
            warnings.warn(
                "DistributedGaLore: no parameter group has a 'rank', so GaLore is not applied (plain AdamW); "
                "build the groups with dist_optim.galore_param_groups(model, rank=...)",
                stacklevel=2,
            )

    def _projector_dtype(self, grad_dtype: torch.dtype) -> torch.dtype:
        if self.projector_dtype is not None:
            return self.projector_dtype
        return torch.float16 if self.optim_bits == 8 else grad_dtype

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, with GaLore's defaults in a group with ``rank``; optimizer-wide options a
        group names (a conversion's) are checked by :meth:`validate_group`, then dropped: the
        optimizer keeps them."""
        if "rank" in param_group:
            for key, value in GROUP_DEFAULTS.items():
                param_group.setdefault(key, value)
            self._shapes_checked = False
        self.owner_runtime.forget()
        super().add_param_group(param_group)
        for key in OPTIMIZER_WIDE:
            self.param_groups[-1].pop(key, None)

    def validate_group(self, group: dict[str, Any]) -> None:
        """AdamW's options, a GaLore group's (:func:`.options.validate_options`) and agreement with
        the optimizer-wide options. Full shapes are checked at bind or the first step."""
        super().validate_group(group)
        validate_options(group, {key: getattr(self, key) for key in OPTIMIZER_WIDE})

    def keeps_saved_dtype(self, key: str, value: torch.Tensor) -> bool:
        """8-bit codes, their fp32 absmax and projectors (:func:`.state.keeps_saved_dtype`)."""
        return keeps_saved_dtype(key, value)

    # ---- validation against full shapes ---------------------------------------------------
    def _on_bind(self) -> None:
        self._check_shapes()
        # The SVDs are split over the TP x data-parallel grid of each matrix's ranks: the grids are
        # process groups, made now, collectively over the job (every process binds).
        galore = [self.layout(p) for g in self.param_groups if "rank" in g for p in g["params"]]
        self.owner_runtime.bind(galore, self.dp_group, self.tp_group)
        self._groups_cache.clear()

    def _check_shapes(self) -> None:
        for gi, group in enumerate(self.param_groups):
            if "rank" in group:
                for p in group["params"]:
                    check_full_shape(gi, group["rank"], self.layout(p).full_shape)
        self._shapes_checked = True

    # ---- the step -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self._begin_step(closure)
        early = self._early_gather()
        try:
            if early is not None and early[2].carries_flag:
                early[2].wait()
                ok = self._gradients_ok(summed=early[2].flag_sum)
            else:
                ok = self._gradients_ok()
        except BaseException:
            if early is not None:
                early[2].wait()  # finished on every rank: each raises here
            raise
        if not ok:
            if early is not None:
                early[2].wait()
            return loss
        if not self._shapes_checked:
            self._check_shapes()
        for group in self.param_groups:
            if "rank" not in group:
                params, grads = self._grads(group)
                if params:
                    self._plain_adamw(group, params, grads)
        items, ranges, gathering = early if early is not None else (self._items(), None, None)
        if not items:
            return loss
        refreshing = [it for it in items if it.refresh]
        if refreshing:
            self._refresh_tasks()
            refresh(
                self.owner_runtime,
                refreshing,
                self._projector_dtype,
                self.comm_stats,
                self.bucket_bytes,
            )
        self._low_rank_buckets(items, ranges or self._buckets(items), gathering)
        return loss

    def _early_gather(self) -> tuple[list[GaLoreMatrix], list[tuple[int, int]], ProjectorGathering] | None:
        """Between refreshes the first bucket's projectors do not depend on this step's gradients:
        this step's items, their buckets and that bucket's projector all-gather, started before the
        NaN/Inf check. It carries the check's flag where a work group is the whole job (one
        collective instead of two), else travels during the check's all-reduce. None on a refresh
        step, and where making the items would change state (a GaLore parameter's first step)."""
        if not (self._shapes_checked and self._stepped_before()):
            return None
        items = self._items()
        if not items or any(it.refresh for it in items):
            return None
        ranges = self._buckets(items)
        checks = self.nonfinite != "ignore" and self.is_bound and group_size(None) > 1
        flag = self._local_nonfinite_flag() if checks else None
        return items, ranges, start_gather_projectors(items[slice(*ranges[0])], self.comm_stats, flag)

    def _low_rank_buckets(
        self, items: list[GaLoreMatrix], ranges: list[tuple[int, int]], gathering: ProjectorGathering | None
    ) -> None:
        """Projection, low-rank AdamW and update bucket by bucket (``ranges`` of ``items``), the
        next bucket's projectors travelling while one computes (``gathering``: the first bucket's,
        if started already): the projectors and partial low-rank gradients of two buckets at most
        are alive; their sums are in rank order, the same bits for any budget."""
        if gathering is None:
            gathering = start_gather_projectors(items[slice(*ranges[0])], self.comm_stats)
        for k, (lo, hi) in enumerate(ranges):
            bucket = items[lo:hi]
            gathering.wait()
            if k + 1 < len(ranges):
                gathering = start_gather_projectors(items[slice(*ranges[k + 1])], self.comm_stats)
            project_all(bucket, self.comm_stats, self._eight_bit)
            steps = self._low_rank_steps(bucket)
            norms = gather_steps(bucket, [norm for _, norm in steps], self._eight_bit)
            for it, (step_size, _), norm in zip(bucket, steps, norms):
                self._galore_update(it, step_size, norm)

    def _stepped_before(self) -> bool:
        """Whether every GaLore parameter with a gradient has state (so making its item changes none)."""
        return all(self.state[p] for g in self.param_groups if "rank" in g for p in self._grads(g)[0])

    def _items(self) -> list[GaLoreMatrix]:
        """This step's item of every GaLore parameter with a gradient, in ``param_groups`` order."""
        items: list[GaLoreMatrix] = []
        for group in self.param_groups:
            if "rank" not in group:
                continue
            for p, g in zip(*self._grads(group)):
                it = new_item(group, p, g, self.layout(p), self.state[p])
                it.proj_groups, it.replicas = self._item_groups(p, it.layout)
                items.append(it)
        return items

    def _buckets(self, items: list[GaLoreMatrix]) -> list[tuple[int, int]]:
        sizes = [(low_rank_numel(it) + projector_numel(it)) * it.grad.element_size() for it in items]
        return list(buckets(sizes, self.bucket_bytes))

    def _item_groups(self, p: torch.Tensor, layout: ParamLayout) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """The groups of :meth:`_projector_groups` and :meth:`_replica_groups`, kept per parameter
        until the next bind (asked every step of every parameter otherwise)."""
        cached = self._groups_cache.get(p)
        if cached is None or cached[0] is not layout:
            cached = (layout, self._projector_groups(layout), self._replica_groups(layout))
            self._groups_cache[p] = cached
        return cached[1], cached[2]

    def _projector_groups(self, layout: ParamLayout) -> tuple[Any, ...]:
        """The groups a GaLore parameter's projectors are partitioned over: its work group's (the
        SVD owner's ranks, which all need the whole projectors), none where it is this rank alone."""
        work = self.owner_runtime.work_of(layout)
        return (work.group,) if work.size > 1 else ()

    def _replica_groups(self, layout: ParamLayout) -> tuple[Any, ...]:
        """The groups over which a GaLore parameter is replicated whole or as the same ZeRO chunk
        (the optimizer's TP group for a matrix TP does not split): its low-rank moments are
        partitioned over them too, each replica keeping its part of the same sum."""
        if layout.tp is None and self.tp_group is not None and group_size(self.tp_group) > 1:
            return (self.tp_group,)
        return ()

    def _eight_bit(self, it: GaLoreMatrix) -> bool:
        """Whether the item's low-rank moments are 8-bit (:meth:`_eight_bit_numel` of its full
        low-rank numel)."""
        return self._eight_bit_numel(low_rank_numel(it))

    def _eight_bit_numel(self, numel: int) -> bool:
        """Whether low-rank moments of ``numel`` elements are 8-bit (bitsandbytes' ``min_8bit_size``
        rule)."""
        return codecs.EightBit.of(self).keeps(numel)

    def state_partitions(self, p: torch.Tensor) -> dict[str, Partitioned]:
        """How this rank keeps each entry of GaLore parameter ``p``'s state: its full shape, the
        groups it is partitioned over and the alignment of the parts
        (:func:`.state.state_partitions`, :func:`dist_optim.sharding.partition.partition_span`)."""
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        layout = self.layout(p)
        side = projection_side(layout.full_shape, group["proj_type"])
        rank = int(group["rank"])
        rows, cols = low_rank_shape(layout.full_shape, side, rank)
        eight = self._eight_bit_numel(rows * cols)
        return state_partitions(layout, side, rank, self._projector_groups(layout), eight, self._replica_groups(layout))

    # ---- full-form state ------------------------------------------------------------------
    def full_state(self) -> list[dict[str, Any]]:
        """Every parameter's state in full form (:meth:`DistOptimizer.full_state`), a GaLore
        parameter's projectors and low-rank moments assembled from the partitions of the ranks that
        keep them (:func:`.state.state_partitions`; one all-gather per group, dtype and stage).
        Collective when bound."""
        out = super().full_state()
        requests, where = [], []
        entries = iter(out)  # in param_groups order
        for group in self.param_groups:
            for p, entry in zip(group["params"], entries):
                if "rank" not in group:
                    continue
                for key, (shape, groups, align) in self.state_partitions(p).items():
                    if key in entry and live_groups(groups):
                        requests.append((entry[key], groups, math.prod(shape), align))
                        where.append((entry, key, shape))
        for (entry, key, shape), full in zip(where, all_gather_parts(requests)):
            entry[key] = full.view(shape)
        return out

    def _localize_state(self, param: torch.Tensor, state: dict[str, Any]) -> dict[str, Any]:
        """For ``load_full_state``: this rank's partitions of a GaLore parameter's full-form
        projectors and low-rank moments (checked against their full shapes)."""
        group = next(g for g in self.param_groups if any(q is param for q in g["params"]))
        if "rank" not in group:
            return state
        partitions = self.state_partitions(param)
        low = partitions[LOW_RANK + MOMENTS[0].name][0]
        if not self._eight_bit_numel(math.prod(low)):
            # Low-rank moments saved in 8 bits, loaded where they are kept in 32: dequantised while
            # whole, as this optimizer's partitions of 32-bit moments need not be whole blocks.
            batch = bnb.Batch8bit()
            for e in MOMENTS:
                key = LOW_RANK + e.name
                if isinstance(state.get(key), torch.Tensor):
                    e.codec.to_plain(batch, state, key, ParamLayout(low), state[key].device, param.dtype)
        for key, (shape, groups, align) in partitions.items():
            value = state.get(key)
            if not isinstance(value, torch.Tensor):
                continue
            if tuple(value.shape) != shape:
                raise ValueError(
                    f"load_full_state: GaLore state {key!r} has shape {tuple(value.shape)}, expected {shape} for a "
                    f"parameter of full shape {self.layout(param).full_shape}"
                )
            if live_groups(groups):
                lo, hi = partition_span(value.numel(), groups, align)
                state[key] = value.reshape(-1)[lo:hi].clone()
        return state

    def _refresh_tasks(self) -> None:
        """Every GaLore parameter's SVD task, planned once in the owner runtime (pure; its routes are
        asked of the work groups by the first refresh that runs, on every rank at the same step)."""
        if not self.owner_runtime.tasks:
            params = [p for g in self.param_groups if "rank" in g for p in g["params"]]
            layouts = [self.layout(p) for p in params]
            plan_refresh(self.owner_runtime, params, [(layout, layout.full_shape) for layout in layouts])

    def _low_rank_steps(self, items: list[GaLoreMatrix]) -> list[tuple[float, torch.Tensor]]:
        """Low-rank AdamW on this rank's partition of each item's low-rank gradient: the step size
        and the partition of the normalised step (:func:`.adamw.low_rank_adamw`)."""
        entries = []
        for it in items:
            assert it.low is not None, "projected before the update"
            entries.append((it.state, it.low, it.group, self._eight_bit(it)))
            it.low = None
        return low_rank_adamw(entries, self.adam_style, self._buffers)

    def _galore_update(self, it: GaLoreMatrix, step_size: float, norm: torch.Tensor) -> None:
        """The whole normalised step projected back onto this rank's elements, then decoupled
        weight decay (after the update, as galore_torch)."""
        group = it.group
        assert it.proj is not None, "projectors gathered before the update"
        left, right = (t.to(norm.dtype) for t in it.proj)
        add_back_projection(it.param, it.layout, it.side, group["scale"], norm, -step_size, left, right)
        if group["weight_decay"] > 0.0:
            it.param.add_(it.param, alpha=-group_lr(group) * group["weight_decay"])
        it.proj = None

    def _plain_adamw(self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """AdamW of a group without ``rank``: torch's fused kernel where it applies, else per
        parameter; decay before the update in the "bnb" style (bitsandbytes), after it in "hf"."""
        layouts = [self.layout(p) for p in params]
        eight = [self._eight_bit_numel(layout.full_numel) for layout in layouts]
        states = [self.state[p] for p in params]
        carry = bnb.Batch8bit()
        for p, layout, state, e in zip(params, layouts, states, eight):
            if not state:
                init_plain_state(state, p, layout.full_numel, e, self._buffers)
            else:  # moments saved with the other optim_bits
                carry_over(state, "", layout, p, e, carry)
        carry.store()
        self._buffers.prefetch(*(state[key] for state in states for key in ("exp_avg", "exp_avg_sq")))
        wd, lr = group["weight_decay"], group_lr(group)
        if not any(eight) and fused_plain_adamw(group, self.adam_style, states, params, grads):
            return
        if self.adam_style == "bnb" and wd > 0.0:
            scale_(params, 1.0 - lr * wd)
        sharded = shared_absmax(states, params, grads, layouts, eight, group["betas"])
        for i, (p, grad, layout, state, e) in enumerate(zip(params, grads, layouts, states, eight)):
            # A whole tensor: bitsandbytes computes each block's absmax itself (None).
            blocks = (sharded.get(i) or (bnb.FullBlocks(layout, p.device), None)) if e else None
            plain_adamw_update(state, p, grad, group, self.adam_style, blocks)
        if self.adam_style == "hf" and wd > 0.0:
            torch._foreach_add_(params, params, alpha=-lr * wd)
