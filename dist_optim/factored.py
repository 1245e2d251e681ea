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
all parameters of the step. After the flush every rank has the full statistics (replicated, in
full form, so checkpoints do not depend on the layout), and expands them back onto its own
elements.

:class:`FactoredLayout` does the index math. A ZeRO chunk is a contiguous range of the flattened
working param, so it covers a contiguous run of "rows" (index over ``local[:-1]``), the first and
last possibly cut. The chunk is padded at the front and back into a ``(rows, C_local)`` block, so
reductions and expansions are plain row/column operations plus an ``index_add_`` over *rows*:
the index tensors kept per parameter have one entry per row, not per element. ZeRO padding (the
suffix of the last rank's chunk beyond the working param) never enters the block.

The shared steps of both optimizers live here too: queueing the partial statistics of a step,
folding them into the state, and preconditioning the gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .base import DistOptimizer
from .comm import SumBucket
from .layout import ParamLayout

__all__ = [
    "FactoredLayout",
    "Item",
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


class FactoredLayout:
    """Maps a parameter's local tensor (whole, TP slice, or flat ZeRO chunk) to the row and column
    statistics of its full tensor (``ndim >= 2``).

    Work form: a view of the local tensor on which rows and columns are plain dims, ``(L, R, C)``
    for a whole tensor or TP slice, ``(rows, C)`` for a ZeRO chunk (padded at both ends to whole
    rows). :meth:`partial_sums` reduces a work-form tensor to full-size row/column bins;
    :meth:`expand` turns full row/column vectors into tensors that broadcast against the work form.
    """

    def __init__(self, layout: ParamLayout, device: torch.device | str | None = None) -> None:
        if layout.ndim < 2:
            raise ValueError(f"FactoredLayout: a factored parameter needs >= 2 dims, got shape {layout.full_shape}")
        full, local = layout.full_shape, layout.local_shape
        self.layout = layout
        self.rows_full, self.cols_full = full[-2], full[-1]
        self.row_shape: tuple[int, ...] = full[:-1] + (1,)
        self.col_shape: tuple[int, ...] = full[:-2] + (1, full[-1])
        self.lead_full = math.prod(full[:-2])
        self.lead_local = math.prod(local[:-2])
        self.rows_local, self.cols_local = local[-2], local[-1]
        tp = layout.tp
        last = layout.ndim - 1
        # Offset of this rank's columns in the full matrix (only a last-dim split moves them).
        self.col_offset = layout.tp_offset if tp is not None and tp.dim == last else 0
        self.zero = layout.zero is not None
        if not self.zero:
            # A whole tensor or TP slice: the statistics of the slice sit at the slice's position.
            sl = layout.tp_slices()
            self._row_index = sl[:-1] + (slice(None),)
            self._col_index = sl[:-2] + (slice(None), sl[-1])
            return
        # ZeRO: the chunk covers local rows [q0, q0 + nrows) of the (local[:-1]) row index.
        cl = self.cols_local
        start, _ = layout.chunk_range
        self.valid = layout.valid_numel
        q0 = start // cl
        self.front = start - q0 * cl
        nrows = -(-(self.front + self.valid) // cl) if self.valid else 0
        self.back = nrows * cl - self.front - self.valid
        self.nrows = nrows
        self.chunk_numel = layout.chunk_numel
        # Full flat row index of every local row, and full flat leading index of every local row:
        # the layouts of the row space full[:-1] and of the leading space full[:-2], with the TP
        # split kept when it cuts those dims.
        row_tp = tp if tp is not None and tp.dim < last else None
        lead_tp = tp if tp is not None and tp.dim < last - 1 else None
        q = torch.arange(q0, q0 + nrows, device=device)
        rowmap = ParamLayout(full[:-1], row_tp).full_flat_index(device=device)
        leadmap = ParamLayout(full[:-2], lead_tp).full_flat_index(device=device)
        self._rows = rowmap[q0 : q0 + nrows].contiguous()
        self._leads = leadmap[torch.div(q, self.rows_local, rounding_mode="floor")].contiguous()

    # ---- work form ------------------------------------------------------------------------
    def to_work(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (the optimizer's local tensor for this param) in work form."""
        if not self.zero:
            return t.reshape(self.lead_local, self.rows_local, self.cols_local)
        # Only the valid prefix: ZeRO padding is not part of the full tensor.
        valid = t.reshape(-1)[: self.valid]
        return torch.nn.functional.pad(valid, (self.front, self.back)).view(self.nrows, self.cols_local)

    def from_work(self, w: torch.Tensor) -> torch.Tensor:
        """Back to the local form; ZeRO padding elements are zero."""
        if not self.zero:
            return w.reshape(self.layout.local_shape)
        flat = w.reshape(-1)[self.front : self.front + self.valid]
        return torch.nn.functional.pad(flat, (0, self.chunk_numel - self.valid))

    # ---- statistics -------------------------------------------------------------------------
    def partial_sums(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the full row sums (over the last dim) and column sums (over the
        second-to-last dim) of a work-form tensor, as full-size tensors of shapes
        :attr:`row_shape` and :attr:`col_shape`. Summed over ``layout.sum_groups`` they are the
        sums of the full tensor."""
        if not self.zero:
            rows = w.sum(dim=-1, keepdim=True)
            cols = w.sum(dim=-2, keepdim=True)
            if self.layout.tp is None:
                return rows.view(self.row_shape), cols.view(self.col_shape)
            local = self.layout.local_shape
            row_full = w.new_zeros(self.row_shape)
            col_full = w.new_zeros(self.col_shape)
            row_full[self._row_index] = rows.view(local[:-1] + (1,))
            col_full[self._col_index] = cols.view(local[:-2] + (1, local[-1]))
            return row_full, col_full
        row_full = w.new_zeros(self.lead_full * self.rows_full)
        col_full = w.new_zeros(self.lead_full, self.cols_full)
        if self.nrows:
            row_full.index_add_(0, self._rows, w.sum(dim=-1))
            # Rows of one leading index add into the same column bins.
            col_full[:, self.col_offset : self.col_offset + self.cols_local].index_add_(0, self._leads, w)
        return row_full.view(self.row_shape), col_full.view(self.col_shape)

    def expand(self, row: torch.Tensor, col: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Full row/column tensors (shapes :attr:`row_shape`, :attr:`col_shape`) as tensors that
        broadcast against the work form: element (i, j) of the work form meets row i's and
        column j's values."""
        if not self.zero:
            if self.layout.tp is None:
                return (
                    row.reshape(self.lead_local, self.rows_local, 1),
                    col.reshape(self.lead_local, 1, self.cols_local),
                )
            return (
                row[self._row_index].reshape(self.lead_local, self.rows_local, 1),
                col[self._col_index].reshape(self.lead_local, 1, self.cols_local),
            )
        r = row.reshape(-1).index_select(0, self._rows).unsqueeze(1)
        c = col.reshape(self.lead_full, self.cols_full)[
            self._leads, self.col_offset : self.col_offset + self.cols_local
        ]
        return r, c


# ---- shared step pieces -------------------------------------------------------------------------
@dataclass
class Item:
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
    update: torch.Tensor | None = None  # vectors only: the preconditioned gradient
    sumsq: dict[str, torch.Tensor] = field(default_factory=dict)


def math_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype of the statistics and arithmetic for a parameter: fp32, or float64 for float64
    parameters (which then get the single-device algorithm in double precision)."""
    return torch.promote_types(p.dtype, torch.float32)


def init_second_moment(state: dict[str, Any], item_param: torch.Tensor, fac: FactoredLayout | None) -> None:
    """Zero row/column statistics (factored) or a param-shaped ``variance`` (vectors), in fp32
    (float64 for float64 parameters)."""
    dtype = math_dtype(item_param)
    if fac is not None:
        state["row_var"] = torch.zeros(fac.row_shape, dtype=dtype, device=item_param.device)
        state["col_var"] = torch.zeros(fac.col_shape, dtype=dtype, device=item_param.device)
    else:
        state["variance"] = torch.zeros_like(item_param, dtype=dtype, memory_format=torch.preserve_format)


def queue_factored_sums(bucket: SumBucket, item: Item, values: torch.Tensor) -> None:
    """Queue the full row/column sums of ``values`` (local form; may be the workspace, which is
    free again on return) in ``bucket`` as ``item.sums``; complete after ``bucket.flush()``."""
    fac = item.fac
    assert fac is not None, "only factored parameters have row/column sums"
    rows, cols = fac.partial_sums(fac.to_work(values))
    groups = item.layout.sum_groups
    item.sums = (bucket.add(rows, groups), bucket.add(cols, groups))


def fold_sums(item: Item, row_key: str, col_key: str, beta: float, eps_add: float = 0.0) -> None:
    """``state[row_key]``/``state[col_key]`` <- EMA with the reduced means of this step's
    ``item.sums``. ``eps_add`` is the epsilon the references add to every squared element before
    the means: added to the means instead (the same value in exact arithmetic, and no pass over
    the elements)."""
    fac = item.fac
    assert fac is not None and item.sums is not None, "queue the factored sums before folding them"
    rows, cols = item.sums
    rows = rows.div_(fac.cols_full)
    cols = cols.div_(fac.rows_full)
    if eps_add:
        rows.add_(eps_add)
        cols.add_(eps_add)
    ema_(item.state[row_key], rows, beta)
    ema_(item.state[col_key], cols, beta)


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


def fold_second_moment(item: Item, beta: float, eps_mode: str, eps1: float) -> None:
    """Fold this step's (reduced) statistics into the second moment with decay ``beta``; for a
    vector, also compute its preconditioned gradient (``item.update``)."""
    state, g = item.state, item.grad
    if item.fac is not None:
        fold_sums(item, "row_var", "col_var", beta, eps1 if eps_mode == EPS_ADD else 0.0)
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
    item: Item, eps_mode: str, eps1: float, out: torch.Tensor, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """``G V^-1/2`` (times ``scale``) in local form, after :func:`fold_second_moment`: for a
    factored parameter computed afresh into ``out`` (the workspace); for a vector, the update kept
    from the fold (scaled in place)."""
    if item.fac is None:
        assert item.update is not None, "fold the second moment first"
        return item.update if scale is None else item.update.mul_(scale)
    state = item.state
    return approx_inv_sqrt(item.fac, state["row_var"], state["col_var"], item.grad, eps_mode, eps1, out, scale)


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
        self._scratch = torch.empty(0, dtype=torch.float32)
        super().__init__(params, defaults, nonfinite=nonfinite)

    def validate_group(self, group: dict[str, Any]) -> None:
        super().validate_group(group)
        check_floating(group["params"], type(self).__name__)

    def _on_bind(self) -> None:
        self._factored.clear()

    def keeps_saved_dtype(self, key: str, value: torch.Tensor) -> bool:
        """Every statistic is kept in :func:`math_dtype` (fp32 for bf16/fp16 parameters): restored
        as saved, not cast to the parameter's dtype as torch's loader would."""
        return True

    def _init_state(self, item: Item) -> None:
        """The state a parameter starts with besides ``step`` (called at its first step)."""
        raise NotImplementedError

    def _items(self, stats: SumBucket) -> list[Item]:
        """The first phase of a step: every parameter with a gradient as an :class:`Item` (fp32
        gradient, negated for ``maximize``), its state started and its step counted, and the
        row/column sums of ``G^2`` of the factored ones queued in ``stats``."""
        items: list[Item] = []
        for group in self.param_groups:
            params, grads = self._grads(group)
            for p, grad in zip(params, grads):
                g = grad.float() if grad.dtype in (torch.float16, torch.bfloat16) else grad
                if group.get("maximize", False):
                    g = -g
                fac = self._fac(p)
                item = Item(p, group, self.state[p], self.layout(p), fac, g)
                if not item.state:
                    item.state["step"] = torch.zeros((), dtype=torch.float32)
                    self._init_state(item)
                item.state["step"] += 1
                if fac is not None:
                    queue_factored_sums(stats, item, torch.mul(g, g, out=self._workspace(g)))
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
