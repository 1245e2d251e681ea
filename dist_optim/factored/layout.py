"""The index math of factored statistics on TP slices and ZeRO chunks (Adafactor, CAME).

:class:`FactoredLayout` does the index math. A ZeRO chunk is a contiguous range of the flattened
working param, so it covers a contiguous run of "rows" (index over ``local[:-1]``), the first and
last possibly cut. The chunk is padded at the front and back into a ``(rows, C_local)`` block, so
reductions and expansions are plain row/column operations plus an ``index_add_`` over *rows*:
the index tensors kept per parameter have one entry per row, not per element. ZeRO padding (the
suffix of the last rank's chunk beyond the working param) never enters the block.

The state-partition geometry is here too: which contiguous part of a flattened statistic a rank
keeps (:meth:`FactoredLayout.part`) and which part of a TP-replicated vector (:class:`VectorPart`).
The math of the optimizers that use it is in :mod:`dist_optim.factored.statistics`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..comm import group_rank, group_size
from ..layout import ParamLayout
from ..sharding.partition import partition_span

__all__ = ["FactoredLayout", "VectorPart"]


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
        # part(), by whether the statistic is a row one: asked several times per statistic and step.
        self._parts = {
            row: partition_span(math.prod(self.row_shape if row else self.col_shape), layout.sum_groups)
            for row in (True, False)
        }
        # The partition of every statistic this rank keeps: index in the product of the sum groups
        # (ZeRO rank, then TP rank), the same on every rank that sums over them.
        self.shares, self.share_index = 1, 0
        for g in layout.sum_groups:
            n = group_size(g)
            self.shares, self.share_index = self.shares * n, self.share_index * n + group_rank(g)
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

    def part(self, key: str) -> tuple[int, int]:
        """``[lo, hi)`` of the flattened statistic ``key`` (one of :data:`STAT_KEYS`) that this
        rank keeps: the ``share_index``-th of ``shares`` parts of ``ceil(numel / shares)``
        elements, ZeRO's rule (the last part shorter, possibly empty;
        :func:`dist_optim.sharding.partition.partition_span`, the rule GaLore's partitioned state
        follows too). The whole statistic when the parameter is not shared."""
        return self._parts[key.endswith("row_var")]

    def localize(self, key: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's partition (a copy) of the full-form statistic ``key``, as it is kept in
        ``optimizer.state`` (the full tensor itself when the parameter is not shared)."""
        if self.shares == 1:
            return full
        lo, hi = self.part(key)
        return full.reshape(-1)[lo:hi].clone()

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


@dataclass(frozen=True)
class VectorPart:
    """The part ``[lo, hi)`` of a TP-replicated vector's flattened local ``variance`` (``numel``
    elements) that this rank keeps: ``group`` is the TP group of its replicas, ``stage`` the
    :class:`~dist_optim.comm.SumBucket` stage at which it is summed over that group."""

    group: Any
    lo: int
    hi: int
    numel: int
    stage: int
