"""Factored second moments (Adafactor, CAME), exact on TP slices and ZeRO chunks.

Adafactor (Shazeer & Stern, 2018) and CAME (Luo et al., 2023) keep, for a parameter with two or
more dims, the running means of a squared quantity along its last dim ("row" statistics, shape
``full[:-1] + (1,)``) and along its second-to-last dim ("column" statistics, shape
``full[:-2] + (1, C)``), leading dims kept, as ``torch.optim.Adafactor`` stores them. Under tensor
parallelism or ZeRO a rank holds a slice or a flat chunk of the parameter, and these statistics
must still be those of the *full* matrix.

How, without gathering a gradient: each rank reduces the elements it holds into *full-size*
row/column bins (zeros where it holds nothing), and the bins are summed over the parameter's
``sum_groups`` (ZeRO group, then TP group) through a :class:`~dist_optim.comm.SumBucket` shared by
all parameters of the step. After the flush every rank has the step's full statistics, and
expands them back onto its own elements.

What a rank keeps between steps is only its *partition* of each statistic: the flattened
statistic cut into ``n`` equal contiguous parts over the ``n`` ranks that share the parameter (the
product of its ``sum_groups``, ZeRO-style, :meth:`FactoredLayout.part`), so the state is 1/n of
the full statistics. The exponential moving average is folded into the same all-reduce: each rank
adds ``(1 - beta)/count`` times its partial sums everywhere and ``beta`` times its old partition
(plus the epsilon term, once) on its own partition, so the sum over the ranks *is* the new full
statistic (``beta old + (1 - beta) mean``). That is the all-reduce of today's bins (same
collectives, same bytes), no reduce-scatter or all-gather more; the full statistic lives for the
step only (as the reduced bins did), and the rank copies its partition back into its state.
Deviation: the EMA is then summed in the all-reduce rather than taken by a ``lerp`` after it,
equal in exact arithmetic and within fp32 rounding (a whole, unshared parameter keeps the
``lerp``). Checkpoints stay in full form (:meth:`FactoredOptimizer.full_state` assembles the
partitions; :meth:`FactoredOptimizer._localize_state` cuts a full-form state to this rank's
partition), so they do not depend on the layout.

A vector's ``variance`` (param-shaped, ZeRO-sharded like the parameter) is the same on the ranks
of a TP group when the vector is not TP-split (norm weights): those replicas keep one part each
(:class:`VectorPart`). The rank that keeps a part folds it (the same elementwise EMA as a whole
vector's), writes it into zeros of the local chunk's size, and one all-reduce over the TP group,
queued at the stage where the TP-split parameters' bins are summed over that group (no collective
more), gives every replica the new chunk, bit for bit (one rank's value plus zeros).

The index math (:class:`FactoredLayout`, :class:`VectorPart`) is in :mod:`dist_optim.factored.layout`.

The shared steps of both optimizers live here too: queueing the partial statistics of a step,
folding them into the state, and preconditioning the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..base import DistOptimizer
from ..comm import SumBucket, group_rank, group_size
from ..kernels.dtypes import accumulation_dtype
from ..layout import ParamLayout
from .layout import FactoredLayout, VectorPart

__all__ = [
    "FactoredLayout",
    "FactoredParam",
    "STAT_KEYS",
    "VectorPart",
    "EPS_ADD",
    "EPS_CLAMP",
    "init_second_moment",
    "queue_factored_sums",
    "fold_sums",
    "fold_second_moment",
    "preconditioned",
    "approx_inv_sqrt",
    "queue_sumsq",
    "rms",
    "clip_factor",
    "low_precision_copy",
    "check_floating",
]

#: Epsilon placements. ``EPS_ADD`` (paper, transformers, fairseq, CAME): ``eps1`` is added to every
#: squared element before the statistics; ``V^-1/2 = rsqrt(R / mean(R)) * rsqrt(C)``.
#: ``EPS_CLAMP`` (``torch.optim.Adafactor``): statistics of the plain squares;
#: ``V = R C / max(mean(R), eps1)`` and ``V^-1/2 = rsqrt(max(V, eps1^2))``.
EPS_ADD = "add"
EPS_CLAMP = "clamp"

#: The factored statistics, in full form in checkpoints and partitioned over the ranks that share
#: a parameter in ``optimizer.state`` (module docstring); row statistics end in ``row_var``.
STAT_KEYS = ("row_var", "col_var", "res_row_var", "res_col_var")


# ---- shared step pieces -------------------------------------------------------------------------
@dataclass
class FactoredParam:
    """One parameter's data during a step (local tensors; fp32 math).

    A factored parameter keeps no param-sized tensor between the phases of a step: its
    preconditioned gradient is recomputed from ``grad`` and the small row/column statistics when a
    phase needs it (two elementwise passes), in the optimizer's workspace. Holding it instead would
    keep a gradient-sized temporary per parameter alive across the step's collectives, and on the
    CPU a fresh large tensor costs more in page faults than the two passes it saves.
    """

    param: torch.Tensor
    group: dict[str, Any]
    state: dict[str, Any]
    layout: ParamLayout
    fac: FactoredLayout | None
    grad: torch.Tensor  # fp32, local form, sign applied (maximize)
    sums: tuple[torch.Tensor, torch.Tensor] | None = None
    # What the queued sums fold into: (row key, col key), beta, eps_add (queue_factored_sums).
    fold: tuple[tuple[str, str], float, float] | None = None
    # This step's full statistics by key, after fold_sums (the state holds only a partition); a
    # TP-replicated vector's whole local variance after the flush of queue_vector_moment.
    full: dict[str, torch.Tensor] = field(default_factory=dict)
    update: torch.Tensor | None = None  # vectors only: the preconditioned gradient
    sumsq: dict[str, torch.Tensor] = field(default_factory=dict)


def math_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype of the statistics and arithmetic for a parameter: fp32, or float64 for float64
    parameters (which then get the single-device algorithm in double precision)."""
    return accumulation_dtype(p.dtype)


def init_statistics(state: dict[str, Any], param: torch.Tensor, fac: FactoredLayout, keys: tuple[str, str]) -> None:
    """Zero row and column statistics ``keys``: this rank's partitions (:meth:`FactoredLayout.part`),
    or the full shapes when the parameter is not shared; fp32 (float64 for float64 parameters)."""
    dtype = math_dtype(param)
    for key, shape in zip(keys, (fac.row_shape, fac.col_shape)):
        if fac.shares == 1:
            state[key] = torch.zeros(shape, dtype=dtype, device=param.device)
        else:
            lo, hi = fac.part(key)
            state[key] = torch.zeros(hi - lo, dtype=dtype, device=param.device)


def init_second_moment(
    state: dict[str, Any], item_param: torch.Tensor, fac: FactoredLayout | None, part: VectorPart | None = None
) -> None:
    """Zero row/column statistics (factored, :func:`init_statistics`) or a param-shaped
    ``variance`` (vectors; this rank's part of it for a TP-replicated one), in fp32 (float64 for
    float64 parameters)."""
    dtype = math_dtype(item_param)
    if fac is not None:
        init_statistics(state, item_param, fac, ("row_var", "col_var"))
    elif part is not None:
        state["variance"] = torch.zeros(part.hi - part.lo, dtype=dtype, device=item_param.device)
    else:
        state["variance"] = torch.zeros_like(item_param, dtype=dtype, memory_format=torch.preserve_format)


def queue_factored_sums(
    bucket: SumBucket,
    item: FactoredParam,
    values: torch.Tensor,
    keys: tuple[str, str],
    beta: float,
    eps_add: float = 0.0,
) -> None:
    """Queue this step's row/column means of ``values`` (local form; may be the workspace, which
    is free again on return) in ``bucket``, to be folded into the statistics ``keys`` (row, col)
    with decay ``beta`` by :func:`fold_sums` after ``bucket.flush()``. ``eps_add`` is the epsilon
    the references add to every squared element before the means: added to the means instead
    (the same value in exact arithmetic, and no pass over the elements).

    A shared parameter's EMA rides in the all-reduce (module docstring): the sum over the ranks of
    ``(1 - beta) partial / count``, plus ``beta old + (1 - beta) eps_add`` on each rank's own
    partition, is the new full statistic."""
    fac = item.fac
    assert fac is not None, "only factored parameters have row/column sums"
    rows, cols = fac.partial_sums(fac.to_work(values))
    if fac.shares > 1:
        for key, bins, count in zip(keys, (rows, cols), (fac.cols_full, fac.rows_full)):
            bins.mul_((1.0 - beta) / count)
            lo, hi = fac.part(key)
            mine = bins.view(-1)[lo:hi]
            mine.add_(item.state[key], alpha=beta)
            if eps_add:
                mine.add_((1.0 - beta) * eps_add)
    groups = item.layout.sum_groups
    item.sums = (bucket.add(rows, groups), bucket.add(cols, groups))
    item.fold = (keys, beta, eps_add)


def queue_vector_moment(bucket: SumBucket, item: FactoredParam, part: VectorPart, beta: float, eps_add: float) -> None:
    """A TP-replicated vector's second moment (module docstring): fold this rank's part with
    decay ``beta`` (``g^2 + eps_add``, as :func:`fold_second_moment` folds a whole vector) and
    queue it, in zeros of the local size, to be summed over the replicas; after the flush,
    ``item.full["variance"]`` is the whole local variance."""
    g = item.grad.reshape(-1)[part.lo : part.hi]
    sq = g * g
    if eps_add:
        sq.add_(eps_add)
    mine = item.state["variance"]
    ema_(mine, sq, beta)
    whole = mine.new_zeros(part.numel)
    whole[part.lo : part.hi] = mine
    bucket.add(whole, (part.group,), first_stage=part.stage)
    item.full["variance"] = whole.view(item.grad.shape)


def fold_sums(item: FactoredParam) -> None:
    """After the flush of the bucket :func:`queue_factored_sums` used: the statistics it named
    hold their EMA with this step's means, and ``item.full`` their full form for the step (a
    shared parameter keeps its partition of the reduced statistic; a whole one folds it in)."""
    fac = item.fac
    assert fac is not None and item.sums is not None and item.fold is not None, "queue the factored sums first"
    keys, beta, eps_add = item.fold
    if fac.shares > 1:
        for key, new in zip(keys, item.sums):
            lo, hi = fac.part(key)
            item.state[key].copy_(new.view(-1)[lo:hi])
            item.full[key] = new
        return
    rows, cols = item.sums
    rows = rows.div_(fac.cols_full)
    cols = cols.div_(fac.rows_full)
    if eps_add:
        rows.add_(eps_add)
        cols.add_(eps_add)
    for key, new in zip(keys, (rows, cols)):
        ema_(item.state[key], new, beta)
        item.full[key] = item.state[key]


def ema_(avg: torch.Tensor, new: torch.Tensor, beta: float) -> None:
    """``avg <- beta avg + (1 - beta) new`` in one pass (transformers/came_pytorch write it as
    ``mul_`` then ``add_``: the same value up to fp32 rounding)."""
    avg.lerp_(new, 1.0 - beta)


def approx_inv_sqrt(
    fac: FactoredLayout,
    row: torch.Tensor,
    col: torch.Tensor,
    values: torch.Tensor,
    eps_mode: str = EPS_ADD,
    eps1: float = 0.0,
    out: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``values * V^-1/2`` (times ``scale``, a 1-element tensor, if given), in local form, where
    ``V`` is the rank-1 estimate from full row/column statistics ``row``, ``col``; see
    :data:`EPS_ADD` / :data:`EPS_CLAMP`. ``out`` (optional, a contiguous local-form tensor that
    is not ``values``) receives the result when the work form is a view (no ZeRO)."""
    w = fac.to_work(values)
    buf = fac.to_work(out) if out is not None and not fac.zero else None
    if eps_mode == EPS_ADD:
        # transformers' _approx_sq_grad: rsqrt(R / mean_rows(R)) * rsqrt(C), on the small full vectors;
        # then G * r * c, one broadcast at a time (cheaper than materialising the outer product r c).
        # A scalar factor rides on the small row vector for free.
        r_factor = (row / row.mean(dim=-2, keepdim=True)).rsqrt_()
        if scale is not None:
            r_factor.mul_(scale)
        r, c = fac.expand(r_factor, col.rsqrt())
        return fac.from_work(torch.mul(w, r, out=buf).mul_(c) if buf is not None else (w * r).mul_(c))
    # torch: V = R C / max(mean_rows(R), eps1); U = G / max(sqrt(V), eps1).
    scaled_col = col / row.mean(dim=-2, keepdim=True).clamp(min=eps1)
    r, c = fac.expand(row, scaled_col)
    v = torch.mul(r, c, out=buf) if buf is not None else r * c
    v = v.clamp_(min=eps1 * eps1).rsqrt_().mul_(w)
    if scale is not None:
        v.mul_(scale)
    return fac.from_work(v)


def fold_second_moment(item: FactoredParam, beta: float, eps_mode: str, eps1: float) -> None:
    """Fold this step's statistics into the second moment: a factored parameter's (reduced)
    row/column means, queued with their decay (:func:`queue_factored_sums`); a vector's squared
    gradient with decay ``beta``, also computing its preconditioned gradient (``item.update``)."""
    state, g = item.state, item.grad
    if item.fac is not None:
        fold_sums(item)
        return
    if "variance" in item.full:  # a TP-replicated vector: folded before the flush
        variance = item.full["variance"]
        if eps_mode == EPS_ADD:
            item.update = variance.rsqrt().mul_(g)
        else:
            item.update = variance.clamp(min=eps1 * eps1).rsqrt_().mul_(g)
        return
    variance = state["variance"]
    sq = g * g
    if eps_mode == EPS_ADD:
        ema_(variance, sq.add_(eps1), beta)
        item.update = variance.rsqrt().mul_(g)
        return
    ema_(variance, sq, beta)
    item.update = variance.clamp(min=eps1 * eps1).rsqrt_().mul_(g)


def preconditioned(
    item: FactoredParam, eps_mode: str, eps1: float, out: torch.Tensor, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """``G V^-1/2`` (times ``scale``) in local form, after :func:`fold_second_moment`: for a
    factored parameter computed afresh into ``out`` (the workspace); for a vector, the update kept
    from the fold (scaled in place)."""
    if item.fac is None:
        assert item.update is not None, "fold the second moment first"
        return item.update if scale is None else item.update.mul_(scale)
    full = item.full
    return approx_inv_sqrt(item.fac, full["row_var"], full["col_var"], item.grad, eps_mode, eps1, out, scale)


def queue_sumsq(bucket: SumBucket, layout: ParamLayout, t: torch.Tensor) -> torch.Tensor:
    """Queue the full tensor's sum of squares (ZeRO padding is zero, so it adds nothing)."""
    # One pass, no temporary of t's size; fp32 accumulation for low-precision tensors, float64
    # ones keep theirs (vector_norm refuses a narrowing dtype).
    return bucket.add(torch.linalg.vector_norm(t, dtype=math_dtype(t)).square().reshape(1), layout.sum_groups)


def rms(sumsq: torch.Tensor, layout: ParamLayout) -> torch.Tensor:
    """Root mean square of the full tensor from its reduced sum of squares (a 1-element tensor)."""
    return (sumsq / layout.full_numel).sqrt_()


def clip_factor(sumsq: torch.Tensor, layout: ParamLayout, threshold: float) -> torch.Tensor:
    """``1 / max(1, RMS(update) / threshold)`` (a 1-element tensor) from the update's reduced sum
    of squares: update clipping, to be folded into the step's other scalar factors."""
    return (rms(sumsq, layout) / threshold).clamp_(min=1.0).reciprocal_()


def low_precision_copy(p: torch.Tensor) -> torch.Tensor:
    """The fp32 tensor to do the math on: ``p`` itself, or an fp32 copy for fp16/bf16 params
    (written back by the caller), as transformers' Adafactor does."""
    return p.float() if p.dtype in (torch.float16, torch.bfloat16) else p


def check_floating(params: Any, name: str) -> None:
    """TypeError for a non-floating-point parameter (integer, bool or complex)."""
    for i, p in enumerate(params):
        if not p.is_floating_point():
            raise TypeError(f"{name}: parameter #{i} has dtype {p.dtype}; only floating-point parameters are supported")


class FactoredOptimizer(DistOptimizer):
    """Base of the factored optimizers (Adafactor, CAME): caches each parameter's
    :class:`FactoredLayout` (``None`` for vectors), rebuilt when the optimizer is re-bound."""

    def __init__(self, params: Any, defaults: dict[str, Any], *, nonfinite: str = "raise") -> None:
        self._factored: dict[torch.Tensor, FactoredLayout | None] = {}
        self._vector_parts: dict[torch.Tensor, VectorPart | None] = {}
        self._scratch = torch.empty(0, dtype=torch.float32)
        super().__init__(params, defaults, nonfinite=nonfinite)

    def validate_group(self, group: dict[str, Any]) -> None:
        super().validate_group(group)
        check_floating(group["params"], type(self).__name__)

    def _on_bind(self) -> None:
        self._factored.clear()
        self._vector_parts.clear()

    def _vector_part(self, p: torch.Tensor) -> VectorPart | None:
        """The part of a vector's ``variance`` this rank keeps when the vector is replicated over
        the TP group (not TP-split); None otherwise (the whole local variance)."""
        if p not in self._vector_parts:
            layout = self.layout(p)
            part = None
            n = group_size(self.tp_group) if self.tp_group is not None else 1
            if layout.ndim < 2 and layout.tp is None and n > 1:
                numel = p.numel()
                size = -(-numel // n)
                lo = min(numel, group_rank(self.tp_group) * size)
                part = VectorPart(self.tp_group, lo, min(numel, lo + size), numel, len(layout.sum_groups))
            self._vector_parts[p] = part
        return self._vector_parts[p]

    def keeps_saved_dtype(self, key: str, value: torch.Tensor) -> bool:
        """Every statistic is kept in :func:`math_dtype` (fp32 for bf16/fp16 parameters): restored
        as saved, not cast to the parameter's dtype as torch's loader would."""
        return True

    def _init_state(self, item: FactoredParam) -> None:
        """The state a parameter starts with besides ``step`` (called at its first step)."""
        raise NotImplementedError

    def _second_moment_decay(self, item: FactoredParam) -> tuple[float, float]:
        """``(beta, eps_add)`` of this step's second moment of ``item`` (after its step is counted)."""
        raise NotImplementedError

    # ---- full-form state --------------------------------------------------------------------------
    def full_state(self) -> list[dict[str, Any]]:
        """Every parameter's state in full form (:meth:`DistOptimizer.full_state`), the factored
        statistics assembled from the partitions of the ranks that share them: each rank puts its
        partition into zeros of the full shape and one :class:`~dist_optim.comm.SumBucket`
        flush adds them up (exact: every element is one rank's value plus zeros). Collective when
        bound."""
        params = self._all_params()
        vectors = SumBucket()
        kept: dict[torch.Tensor, torch.Tensor] = {}
        for p in params:
            part = self._vector_part(p) if "variance" in self.state.get(p, {}) else None
            if part is not None:
                mine = self.state[p]["variance"]
                whole = mine.new_zeros(part.numel)
                whole[part.lo : part.hi] = mine
                kept[p] = mine
                self.state[p]["variance"] = vectors.add(whole, (part.group,)).view(p.shape)
        vectors.flush()
        try:
            out = super().full_state()
        finally:
            for p, mine in kept.items():
                self.state[p]["variance"] = mine
        bucket = SumBucket()
        for entry, p in zip(out, params):
            fac = self._fac(p) if p in self.state else None
            if fac is None or fac.shares == 1:
                continue
            for key in STAT_KEYS:
                if key in entry:
                    lo, hi = fac.part(key)
                    shape = fac.row_shape if key.endswith("row_var") else fac.col_shape
                    full = entry[key].new_zeros(shape)
                    full.view(-1)[lo:hi] = entry[key]
                    entry[key] = bucket.add(full, fac.layout.sum_groups)
        bucket.flush()
        return out

    def _localize_state(self, param: torch.Tensor, state: dict[str, Any]) -> dict[str, Any]:
        """For ``load_full_state``: a full-form statistic (checked against the parameter's full
        shape) becomes this rank's partition of it; a TP-replicated vector keeps its part of the
        local variance."""
        fac = self._fac(param)
        if fac is None:
            part = self._vector_part(param)
            if part is not None and isinstance(state.get("variance"), torch.Tensor):
                state["variance"] = state["variance"].reshape(-1)[part.lo : part.hi].clone()
            return state
        for key in STAT_KEYS:
            value = state.get(key)
            if not isinstance(value, torch.Tensor):
                continue
            shape = fac.row_shape if key.endswith("row_var") else fac.col_shape
            if tuple(value.shape) != shape:
                raise ValueError(
                    f"load_full_state: state {key!r} has shape {tuple(value.shape)}, expected {shape} for a "
                    f"parameter of full shape {fac.layout.full_shape}"
                )
            state[key] = fac.localize(key, value)
        return state

    def _items(self, stats: SumBucket) -> list[FactoredParam]:
        """The first phase of a step: every parameter with a gradient as an :class:`FactoredParam` (fp32
        gradient, negated for ``maximize``), its state started and its step counted, and the
        row/column sums of ``G^2`` of the factored ones queued in ``stats``."""
        items: list[FactoredParam] = []
        for group in self.param_groups:
            params, grads = self._grads(group)
            for p, grad in zip(params, grads):
                g = grad.float() if grad.dtype in (torch.float16, torch.bfloat16) else grad
                if group.get("maximize", False):
                    g = -g
                fac = self._fac(p)
                item = FactoredParam(p, group, self.state[p], self.layout(p), fac, g)
                if not item.state:
                    item.state["step"] = torch.zeros((), dtype=torch.float32)
                    self._init_state(item)
                item.state["step"] += 1
                part = self._vector_part(p) if fac is None else None
                if fac is not None:
                    beta, eps_add = self._second_moment_decay(item)
                    squares = torch.mul(g, g, out=self._workspace(g))
                    queue_factored_sums(stats, item, squares, ("row_var", "col_var"), beta, eps_add)
                elif part is not None:
                    queue_vector_moment(stats, item, part, *self._second_moment_decay(item))
                items.append(item)
        return items

    def _workspace(self, like: torch.Tensor) -> torch.Tensor:
        """An fp32 (float64 for float64 ``like``) scratch tensor of ``like``'s shape, free between
        uses within a step phase.

        On the CPU it is a view of one buffer kept across steps (grown to the largest parameter):
        freshly allocated large tensors are page-faulted in on every step there, which costs more
        than the arithmetic on them. Elsewhere the allocator caches blocks, so a new tensor is free.
        """
        dtype = math_dtype(like)
        if like.device.type != "cpu":
            return torch.empty(like.shape, dtype=dtype, device=like.device)
        n = like.numel()
        if self._scratch.numel() < n or self._scratch.dtype != dtype:
            self._scratch = torch.empty(n, dtype=dtype)
        return self._scratch[:n].view(like.shape)

    def _fac(self, p: torch.Tensor) -> FactoredLayout | None:
        if p not in self._factored:
            layout = self.layout(p)
            self._factored[p] = FactoredLayout(layout, p.device) if layout.ndim >= 2 else None
        return self._factored[p]
