"""GaLore: gradient low-rank projection (Zhao et al., 2024, "GaLore: Memory-Efficient LLM Training
by Gradient Low-Rank Projection", arXiv:2403.03507), with AdamW in the low-rank space and optional
8-bit block-wise quantised moments (Dettmers et al., 2022, "8-bit Optimizers via Block-wise
Quantization", arXiv:2110.02861).

For a matrix parameter ``W`` (``M x N``) in a GaLore group (a group with a ``rank`` key, as in
``galore_torch``), with gradient ``G``:

* every ``update_proj_gap`` steps of that parameter (and at its first step) a projector is taken
  from the SVD ``G = U S V^T`` of the *full* gradient: ``P = U[:, :r]`` ("left", ``M x r``) or
  ``Q = V^T[:r]`` ("right", ``r x N``) or both ("full"). ``proj_type`` chooses as galore_torch's
  ``GaLoreProjector``: ``std`` projects the smaller side (right when ``M >= N``),
  ``reverse_std`` the larger, ``left``/``right``/``full`` as named;
* the low-rank gradient ``R = P^T G`` / ``G Q^T`` / ``P^T G Q^T`` drives AdamW moments of the
  low-rank shape; the normalised step ``m / (sqrt(v) + eps)`` is projected back
  (``P N`` / ``N Q`` / ``P N Q``), multiplied by ``scale`` and applied with the bias-corrected
  step size; decoupled weight decay ``W <- W - lr * wd * W`` follows the update, as galore_torch
  does.

Parameters in groups without ``rank`` get plain AdamW with the same update rule.

``adam_style`` picks which reference the AdamW arithmetic follows:

* ``"hf"`` (default): ``galore_torch.GaLoreAdamW`` (transformers' AdamW): ``eps`` is added to
  ``sqrt(v)`` *before* bias correction, ``step = lr * sqrt(1 - b2^t) / (1 - b1^t)``, and
  ``correct_bias=False`` drops the correction; weight decay after the update.
* ``"bnb"``: ``galore_torch.GaLoreAdamW8bit`` / ColossalAI's ``GaLoreAdamW8bit`` (bitsandbytes'
  Adam kernel): ``denom = sqrt(v) / sqrt(1 - b2^t) + eps``, ``step = lr / (1 - b1^t)``; GaLore
  params are decayed after their update (galore_torch), plain params before it (bitsandbytes).

8-bit states (``optim_bits=8``): the moments (low-rank ``low_rank_exp_avg[_sq]`` of GaLore params,
``exp_avg[_sq]`` of plain params, as bitsandbytes' GaLoreAdamW8bit) are stored as uint8 codes plus
one fp32 absmax per block of 256 values, quantised with bitsandbytes'
``functional.quantize_blockwise`` / ``dequantize_blockwise`` and its signed / unsigned dynamic
maps (the format of bitsandbytes' own 8-bit blockwise Adam; :mod:`dist_optim.bnb_states`). Each
step dequantises, updates in fp32, takes the step from the fp32 values and re-quantises, as
bitsandbytes' kernel does. Like bitsandbytes, moments with fewer than ``min_8bit_size`` elements
stay fp32. ``is_paged`` allocates moments of >= 1e5 elements in bitsandbytes' paged (CUDA
unified) memory; on CPU it warns and uses ordinary tensors.

Distributed (TP slices, ZeRO chunks, both): every quantity the algorithm reads is of the full
matrix.

* Refresh steps: the full gradients of the refreshing parameters are gathered (one bucketed
  ``comm.gather_full``), each SVD is computed by one owner rank of the matrix's work group (the TP
  x ZeRO/data-parallel grid of the ranks that hold it, :mod:`dist_optim.owners`; owners balanced
  by the SVDs' cost) and the projectors go to every rank of the work group
  (``owners.share_results``: one all-gather per work group).
* Every step: the projection is a sum over the projected dim. Each rank multiplies the pieces of
  ``G`` it holds (a TP slice, or the <= 3 rectangles a flat ZeRO chunk covers: a partial first row,
  whole rows, a partial last row) with the matching rows/cols of the projector, adds them into a
  zero low-rank tensor of the full shape, and the partial sums of all parameters go through one
  :class:`~dist_optim.comm.SumBucket` (one all-reduce per group). The low-rank moments are then the
  same full tensors on every rank (replicated, layout-independent state), and the back-projection
  gives each rank exactly its own elements. No full gradient is gathered between refreshes.
* Before anything changes, the NaN/Inf check's flag: one all-reduce over the job and one host read
  per step, unless ``nonfinite="ignore"`` (see :class:`~dist_optim.base.DistOptimizer`).

Deviations from galore_torch (all deliberate):

* ``rank`` larger than ``min(M, N)`` raises (galore_torch silently uses ``min(M, N)``).
* ``reverse_std`` on an ``M < N`` matrix with ``rank == M`` back-projects on the side it
  projected (galore_torch picks the side from the low-rank shape and fails with a shape error).
* 8-bit plain-param moments are quantised in blocks of the *full* flattened parameter
  (``bnb_states.FullBlocks``), as on one device: a ZeRO chunk or TP slice holds pieces of blocks, whose absmax
  is max-reduced over its holders (one collective per group and step) and forced on
  bitsandbytes' quantiser, so codes and absmax are the same on every layout. Between the two
  passes this needs, the new moments are recomputed rather than held.
* The projector is kept in the gradient's dtype (as galore_torch) in 32-bit mode; the SVD is done
  in fp32. In 8-bit mode it is *stored* in float16 by default (``projector_dtype``) and widened to
  the gradient's dtype to multiply: with 8-bit moments fp32 projectors would be a fifth of the
  state (the moments shrink 4x, the projectors not at all). Projector entries are entries of
  orthonormal vectors, so |x| <= 1 and fp16 cannot overflow; its rounding (relative 5e-4) keeps the
  8-bit runs within bitsandbytes' own test tolerances of the bitsandbytes-based GaLoreAdamW8bit
  (mean relative parameter error 6e-5 against the 1.2e-3 allowed, tested), where bfloat16's
  (4e-3) does not (2.1e-3). Q-GaLore (Zhang et al., 2024, arXiv:2407.08296) goes further with
  INT4 projectors. ``projector_dtype=torch.float32`` restores galore_torch's storage.
* State is tensors only (``proj_left`` / ``proj_right`` instead of a projector object; low-rank
  moments as ``low_rank_exp_avg`` / ``low_rank_exp_avg_sq``, with ``*_absmax`` in 8-bit mode) so it
  can be checkpointed and does not depend on the layout.
"""

from __future__ import annotations

import collections
import functools
import math
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import bnb_states as bnb
from .. import comm
from ..base import DistOptimizer, check_adam_options, check_range
from ..layout import ParamLayout
from ..owners import ALONE, WorkGroup, assign, data_group, share_results, work_grids, work_group
from ..registry import Conversion, PlanEntry, register, register_plan

__all__ = ["DistributedGaLore", "galore_param_groups"]

PROJ_TYPES = ("std", "reverse_std", "left", "right", "full")
ADAM_STYLES = ("hf", "bnb")
#: Defaults the paper (and ColossalAI) use for GaLore groups that do not set them.
GROUP_DEFAULTS: dict[str, Any] = {"update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}
_PROJECTOR_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_OPTIMIZER_WIDE = ("optim_bits", "min_8bit_size", "is_paged", "adam_style")


# ---- geometry --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """A dense rectangle of the full matrix held by this rank.

    ``local[offset : offset + rows * cols].view(rows, cols)`` of the flat local tensor (or the
    whole local matrix when ``offset`` is None) is ``full[row0 : row0 + rows, col0 : col0 + cols]``.
    """

    offset: int | None
    rows: int
    cols: int
    row0: int
    col0: int


@functools.lru_cache(maxsize=4096)
def matrix_pieces(layout: ParamLayout) -> tuple[Piece, ...]:
    """The rectangles of the full 2-D matrix that this rank's tensor holds.

    A TP slice (or a whole matrix) is one rectangle. A flat ZeRO chunk ``[s, e)`` of the
    (TP-local) ``m x n`` matrix is at most three: the tail of row ``s // n``, the whole rows after
    it, and the head of the row where the chunk ends; padding and empty chunks give none.
    """
    if layout.ndim != 2:
        raise ValueError(f"matrix_pieces: expected a 2-D layout, got full shape {layout.full_shape}")
    boxes = layout.local_boxes(layout.full_shape)
    assert boxes is not None, "a TP slice of a matrix is a box of it"
    whole = layout.zero is None  # the whole local matrix: offset None (a view of any tensor)
    return tuple(Piece(None if whole else offset, r1 - r0, c1 - c0, r0, c0) for ((r0, r1), (c0, c1)), offset in boxes)


def _view(tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The piece of ``tensor`` (a view when ``tensor`` is contiguous)."""
    if piece.offset is None:
        return tensor.reshape(piece.rows, piece.cols)
    return tensor.reshape(-1)[piece.offset : piece.offset + piece.rows * piece.cols].view(piece.rows, piece.cols)


def projection_side(shape: tuple[int, ...], proj_type: str) -> str:
    """``left``, ``right`` or ``full``: which singular vectors galore_torch's projector keeps."""
    m, n = shape
    if proj_type == "std":
        return "right" if m >= n else "left"
    if proj_type == "reverse_std":
        return "left" if m >= n else "right"
    if proj_type in ("left", "right", "full"):
        return proj_type
    raise ValueError(f"proj_type must be one of {PROJ_TYPES}, got {proj_type!r}")


def low_rank_shape(shape: tuple[int, ...], side: str, rank: int) -> tuple[int, int]:
    m, n = shape
    return {"left": (rank, n), "right": (m, rank), "full": (rank, rank)}[side]


# ---- the optimizer ---------------------------------------------------------------------------
class DistributedGaLore(DistOptimizer):
    """GaLore AdamW (optionally with 8-bit moments), exact under TP and ZeRO (module docstring).

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
            ``optim_bits=8`` (see the module docstring), else the gradient's dtype, as galore_torch.
            Projections always multiply in the gradient's dtype.
        nonfinite: a step with a NaN/Inf gradient ``"raise"`` (default), ``"skip"`` or
            ``"ignore"`` (see :class:`~dist_optim.base.DistOptimizer`).
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
    ) -> None:
        if args is not None:
            quant = bnb.quant_args(args, "DistributedGaLore")
            optim_bits = quant.get("optim_bits", optim_bits)
            min_8bit_size = quant.get("min_8bit_size", min_8bit_size)
        if adam_style is None:
            adam_style = "bnb" if args is not None else "hf"
        if optim_bits not in (8, 32):
            raise ValueError(f"optim_bits must be 8 or 32, got {optim_bits!r}")
        check_range("min_8bit_size", min_8bit_size, 0)
        if adam_style not in ADAM_STYLES:
            raise ValueError(f"adam_style must be one of {ADAM_STYLES}, got {adam_style!r}")
        if projector_dtype is not None and projector_dtype not in _PROJECTOR_DTYPES:
            raise TypeError(
                f"projector_dtype must be None or one of {_PROJECTOR_DTYPES}, got {projector_dtype!r} "
                "(None: float16 with optim_bits=8, else the gradient's dtype)"
            )
        self.projector_dtype = projector_dtype
        self.optim_bits = int(optim_bits)
        self.min_8bit_size = int(min_8bit_size)
        self.is_paged = bool(is_paged)
        self._buffers = bnb.Buffers(self.is_paged, "DistributedGaLore")
        self.adam_style = adam_style
        #: Bytes this rank moved per collective kind (gather at refresh, share of projectors,
        #: all-reduce of low-rank partial sums) and the number of refresh steps.
        self.comm_stats: collections.Counter[str] = collections.Counter()
        self._shapes_checked = False
        #: Process groups of the TP x data-parallel grids (owners.work_grids), made at bind.
        self._grids: dict[tuple[int, ...], Any] = {}
        # betas is checked with the group (validate_group); a list becomes the usual tuple
        betas = tuple(betas) if isinstance(betas, list) else betas
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, correct_bias=bool(correct_bias))
        super().__init__(params, defaults, nonfinite=nonfinite)
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
        for key in _OPTIMIZER_WIDE:
            # Optimizer-wide options may arrive in groups (from a conversion): they must agree.
            if key in param_group:
                value = param_group.pop(key)
                if value != getattr(self, key):
                    raise ValueError(
                        f"DistributedGaLore: {key} is optimizer-wide; a param group sets {key}={value!r} "
                        f"but the optimizer has {getattr(self, key)!r}"
                    )
        if "rank" in param_group:
            for key, value in GROUP_DEFAULTS.items():
                param_group.setdefault(key, value)
            self._shapes_checked = False
        super().add_param_group(param_group)

    def validate_group(self, group: dict[str, Any]) -> None:
        """AdamW's options, and a GaLore group's (a group with ``rank``): positive int ``rank`` and
        ``update_proj_gap``, a finite ``scale``, a known ``proj_type``, parameters that can be
        matrices. Full shapes (2-D, ``rank`` <= both dims) are checked at bind or the first step."""
        super().validate_group(group)
        check_adam_options(**{k: group[k] for k in ("lr", "betas", "eps", "weight_decay")})
        if "rank" not in group:
            return
        rank = group["rank"]
        if not _positive_int(rank):
            raise ValueError(f"DistributedGaLore: rank must be a positive int, got {rank!r}")
        if not _positive_int(group["update_proj_gap"]):
            raise ValueError(
                f"DistributedGaLore: update_proj_gap must be a positive int, got {group['update_proj_gap']!r}"
            )
        scale = group["scale"]
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
            raise ValueError(f"DistributedGaLore: scale must be a finite number, got {scale!r}")
        if group["proj_type"] not in PROJ_TYPES:
            raise ValueError(f"DistributedGaLore: proj_type must be one of {PROJ_TYPES}, got {group['proj_type']!r}")
        for p in group["params"]:
            # TP slices keep their dims and ZeRO chunks are 1-D: a param with more than two
            # dims is never a matrix. Full shapes are checked again at bind / first step.
            if p.dim() > 2:
                raise ValueError(
                    f"DistributedGaLore: a GaLore group (rank={rank}) holds a {p.dim()}-D parameter of shape "
                    f"{tuple(p.shape)}; GaLore projects 2-D matrices only, put other parameters in a group "
                    "without 'rank'"
                )

    def keeps_saved_dtype(self, key: str, value: torch.Tensor) -> bool:
        """8-bit codes, their fp32 absmax and projectors stored in ``proj_dtype`` keep their saved
        dtype on load (torch's loader would cast them to the parameter's dtype)."""
        return value.dtype == torch.uint8 or key.endswith("_absmax") or key.startswith("proj_")

    # ---- validation against full shapes ---------------------------------------------------
    def _on_bind(self) -> None:
        self._check_shapes()
        # The SVDs are split over the TP x data-parallel grid of each matrix's ranks: the grids are
        # process groups, made now, collectively over the job (every process binds).
        galore = [self.layout(p) for g in self.param_groups if "rank" in g for p in g["params"]]
        self._grids = work_grids(self.tp_group, [data_group(lay, self.dp_group) for lay in galore])

    def _check_shapes(self) -> None:
        for gi, group in enumerate(self.param_groups):
            if "rank" not in group:
                continue
            for p in group["params"]:
                layout = self.layout(p)
                shape = layout.full_shape
                if len(shape) != 2:
                    raise ValueError(
                        f"DistributedGaLore: param group {gi} (rank={group['rank']}) holds a parameter of full "
                        f"shape {shape}; GaLore projects 2-D matrices only, put it in a group without 'rank'"
                    )
                if group["rank"] > min(shape):
                    raise ValueError(
                        f"DistributedGaLore: rank={group['rank']} exceeds min{shape} = {min(shape)} for a "
                        f"parameter in param group {gi}; use rank <= {min(shape)}"
                    )
        self._shapes_checked = True

    # ---- the step -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self._begin_step(closure)
        if not self._gradients_ok():
            return loss
        if not self._shapes_checked:
            self._check_shapes()

        items: list[_Item] = []
        for group in self.param_groups:
            params, grads = self._grads(group)
            if not params:
                continue
            if "rank" not in group:
                self._plain_adamw(group, params, grads)
                continue
            for p, g in zip(params, grads):
                items.append(self._item(group, p, g))

        if not items:
            return loss
        refresh = [it for it in items if it.refresh]
        if refresh:
            self._refresh(refresh)

        bucket = comm.SumBucket()
        for it in items:
            it.low = self._project(it)
            if it.layout.sum_groups:
                bucket.add(it.low, it.layout.sum_groups)
                self.comm_stats["sum_bytes"] += it.low.numel() * it.low.element_size()
        bucket.flush()

        for it in items:
            self._galore_update(it)
        return loss

    # ---- GaLore params --------------------------------------------------------------------
    def _item(self, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor) -> _Item:
        layout = self.layout(p)
        side = projection_side(layout.full_shape, group["proj_type"])
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
        step = int(state["step"])
        has_proj = ("proj_left" in state) or ("proj_right" in state)
        refresh = (not has_proj) or step % int(group["update_proj_gap"]) == 0
        return _Item(group, p, grad, layout, side, state, refresh)

    def _refresh(self, items: list[_Item]) -> None:
        """New projectors from the SVDs of the full gradients: gather, owners compute, share."""
        gathered = comm.gather_full([(it.layout, it.grad) for it in items])
        self.comm_stats["refresh_steps"] += 1
        for it, full in zip(items, gathered):
            if not it.layout.is_local:
                self.comm_stats["gather_bytes"] += full.numel() * full.element_size()
            it.full_grad = full

        # One owner per SVD in the matrix's work group; the projectors then go to its other ranks.
        owners = assign([(self._work_group(it.layout), _svd_cost(it.layout.full_shape)) for it in items])
        results = []
        for it, owner in zip(items, owners):
            results.append((owner, self._new_projectors(it, compute=owner.mine, shared=owner.shared)))
        share_results(results)
        self.comm_stats["share_bytes"] += sum(
            t.numel() * t.element_size() for owner, tensors in results if owner.shared for t in tensors
        )
        for it in items:
            it.full_grad = None

    def _work_group(self, layout: ParamLayout) -> WorkGroup:
        """The ranks that share a matrix's SVDs (:func:`dist_optim.owners.work_group`); this rank
        alone when unbound."""
        if not self.is_bound:
            return ALONE
        return work_group(layout, self.dp_group, self.tp_group, self._grids)

    def _new_projectors(self, it: _Item, compute: bool, shared: bool) -> list[torch.Tensor]:
        """Allocate (and on the owner, compute) the item's projectors; stored in its state.

        A projector shared with other ranks is stored contiguous on its owner too: the slice of
        U / V^T is strided, the receivers' copies are not, and matmuls on the two round
        differently. Unshared, the strided slice is kept, as galore_torch keeps it (same rounding)."""
        m, n = it.layout.full_shape
        rank = int(it.group["rank"])
        dtype = self._projector_dtype(it.grad.dtype)
        device = it.grad.device
        out: list[torch.Tensor] = []
        u = vh = None
        if compute:
            assert it.full_grad is not None
            try:
                u, _, vh = torch.linalg.svd(it.full_grad.float(), full_matrices=False)
            except torch.linalg.LinAlgError as exc:
                # Raising here would leave the other ranks waiting in share_owned: keep the previous
                # projector (NaN if there is none, which the NaN gradient has earned), as ColossalAI does.
                warnings.warn(f"DistributedGaLore: SVD failed ({exc}); keeping the previous projector", stacklevel=4)
        for key, side, shape in (
            ("proj_left", ("left", "full"), (m, rank)),
            ("proj_right", ("right", "full"), (rank, n)),
        ):
            if it.side not in side:
                continue
            if compute and u is not None and vh is not None:
                tensor = (u[:, :rank] if key == "proj_left" else vh[:rank, :]).to(dtype)
                tensor = tensor.contiguous() if shared else tensor
                if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
                    # A slice of the SVD's factors keeps all of U (m x k) or Vh (k x n) alive: a
                    # GPU's row-major Vh slice is contiguous and stays a view. Copy it; a dense
                    # slice (LAPACK's column-major U[:, :r]) keeps its strides, so its products
                    # round as before.
                    tensor = tensor.clone()
            elif compute and key in it.state:
                tensor = it.state[key].clone()
            elif compute:
                tensor = torch.full(shape, float("nan"), dtype=dtype, device=device)
            else:
                tensor = torch.empty(shape, dtype=dtype, device=device)
            it.state[key] = tensor
            out.append(tensor)
        return out

    def _project(self, it: _Item) -> torch.Tensor:
        """This rank's share of the low-rank gradient (the whole of it when the layout is local)."""
        left, right = _projectors(it.state, it.grad.dtype)
        pieces = matrix_pieces(it.layout)
        if len(pieces) == 1 and it.layout.is_local:
            g = _view(it.grad, pieces[0])
            if it.side == "left":
                return torch.matmul(left.t(), g)
            if it.side == "right":
                return torch.matmul(g, right.t())
            return torch.matmul(left.t(), g) @ right.t()
        shape = low_rank_shape(it.layout.full_shape, it.side, int(it.group["rank"]))
        low = torch.zeros(shape, dtype=it.grad.dtype, device=it.grad.device)
        for pc in pieces:
            g = _view(it.grad, pc)
            rows = slice(pc.row0, pc.row0 + pc.rows)
            cols = slice(pc.col0, pc.col0 + pc.cols)
            if it.side == "left":
                low[:, cols] += torch.matmul(left[rows].t(), g)
            elif it.side == "right":
                low[rows] += torch.matmul(g, right[:, cols].t())
            else:
                low += torch.matmul(left[rows].t(), g) @ right[:, cols].t()
        return low

    def _project_back(self, it: _Item, norm: torch.Tensor) -> torch.Tensor:
        """This rank's elements of ``scale * back_projection(norm)``, in the param's local form."""
        left, right = _projectors(it.state, norm.dtype)
        scale = it.group["scale"]
        pieces = matrix_pieces(it.layout)

        def block(pc: Piece) -> torch.Tensor:
            rows = slice(pc.row0, pc.row0 + pc.rows)
            cols = slice(pc.col0, pc.col0 + pc.cols)
            if it.side == "left":
                return torch.matmul(left[rows], norm[:, cols])
            if it.side == "right":
                return torch.matmul(norm[rows], right[:, cols])
            return torch.matmul(left[rows], norm) @ right[:, cols]

        if len(pieces) == 1 and pieces[0].offset is None:
            return (block(pieces[0]) * scale).view(it.param.shape)
        update = torch.zeros(it.param.shape, dtype=it.param.dtype, device=it.param.device)  # contiguous
        for pc in pieces:
            _view(update, pc).copy_(block(pc) * scale)
        return update

    def _add_back_projection(self, it: _Item, norm: torch.Tensor, alpha: float) -> None:
        """``param += alpha * scale * back_projection(norm)`` on this rank's elements. Each piece's
        product is accumulated straight into the parameter (``addmm_``): no temporary of the
        parameter's size, which on the CPU costs more in page faults than the update itself."""
        p = it.param
        if p.dtype != norm.dtype or not p.is_contiguous():
            p.add_(self._project_back(it, norm).to(p.dtype), alpha=alpha)
            return
        left, right = _projectors(it.state, norm.dtype)
        coef = alpha * it.group["scale"]
        for pc in matrix_pieces(it.layout):
            rows = slice(pc.row0, pc.row0 + pc.rows)
            cols = slice(pc.col0, pc.col0 + pc.cols)
            target = _view(p, pc)
            if it.side == "left":
                target.addmm_(left[rows], norm[:, cols], alpha=coef)
            elif it.side == "right":
                target.addmm_(norm[rows], right[:, cols], alpha=coef)
            else:
                target.addmm_(torch.matmul(left[rows], norm), right[:, cols], alpha=coef)

    def _galore_update(self, it: _Item) -> None:
        group, state, low = it.group, it.state, it.low
        assert low is not None, "projected before the update"
        beta1, beta2 = group["betas"]
        eight_bit = self.optim_bits == 8 and low.numel() >= self.min_8bit_size
        if "low_rank_exp_avg" not in state:
            self._init_low_rank_state(state, low, eight_bit)
        state["step"] += 1
        t = float(state["step"])
        self._buffers.prefetch(state["low_rank_exp_avg"], state["low_rank_exp_avg_sq"])
        # The low-rank moments are whole on every rank: bitsandbytes' own blocks of them.
        blocks = bnb.FullBlocks(ParamLayout(tuple(low.shape)), low.device) if eight_bit else None
        if blocks is not None:
            exp_avg, exp_avg_sq = (m.to(low.dtype) for m in bnb.read_moments_8bit(state, "low_rank_", blocks))
        else:
            exp_avg, exp_avg_sq = state["low_rank_exp_avg"], state["low_rank_exp_avg_sq"]
        exp_avg.mul_(beta1).add_(low, alpha=1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(low, low, value=1.0 - beta2)
        step_size, denom = self._step_size_and_denom(group, exp_avg_sq, t)
        norm = exp_avg / denom
        if blocks is not None:
            bnb.write_moments_8bit(state, "low_rank_", blocks, [exp_avg, exp_avg_sq])
        self._add_back_projection(it, norm, -step_size)
        if group["weight_decay"] > 0.0:
            it.param.add_(it.param, alpha=-group["lr"] * group["weight_decay"])
        it.low = None

    def _step_size_and_denom(
        self, group: dict[str, Any], exp_avg_sq: torch.Tensor, t: float
    ) -> tuple[float, torch.Tensor]:
        beta1, beta2 = group["betas"]
        if self.adam_style == "hf":
            denom = exp_avg_sq.sqrt().add_(group["eps"])
            step_size = group["lr"]
            if group["correct_bias"]:
                step_size = step_size * math.sqrt(1.0 - beta2**t) / (1.0 - beta1**t)
            return step_size, denom
        c1, c2 = (1.0 - beta1**t, math.sqrt(1.0 - beta2**t)) if group["correct_bias"] else (1.0, 1.0)
        denom = (exp_avg_sq.sqrt() / c2).add_(group["eps"])
        return group["lr"] / c1, denom

    def _init_low_rank_state(self, state: dict[str, Any], low: torch.Tensor, eight_bit: bool) -> None:
        if eight_bit:
            bnb.new_moments_8bit(state, "low_rank_", low.shape, low.numel(), self._buffers, low.device)
        else:
            state["low_rank_exp_avg"] = self._buffers.zeros(low.shape, low.dtype, low.device)
            state["low_rank_exp_avg_sq"] = self._buffers.zeros(low.shape, low.dtype, low.device)

    # ---- plain AdamW params ---------------------------------------------------------------
    def _plain_adamw(self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        eight = [self.optim_bits == 8 and self.layout(p).full_numel >= self.min_8bit_size for p in params]
        for p, e in zip(params, eight):
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                if e:
                    bnb.new_moments_8bit(state, "", p.shape, self.layout(p).full_numel, self._buffers, p.device)
                else:
                    state["exp_avg"] = self._buffers.zeros(p.shape, p.dtype, p.device)
                    state["exp_avg_sq"] = self._buffers.zeros(p.shape, p.dtype, p.device)
        self._buffers.prefetch(*(self.state[p][key] for p in params for key in ("exp_avg", "exp_avg_sq")))
        wd, lr = group["weight_decay"], group["lr"]
        if not any(eight):
            fused = self._fused_plain_adamw(group, params, grads)
            if fused:
                return
        if self.adam_style == "bnb" and wd > 0.0:
            torch._foreach_mul_(params, 1.0 - lr * wd)

        # 8-bit moments of a parameter held in pieces: the absmax of every quantisation block of
        # the full tensor first (the new moments are recomputed below rather than held), in one
        # max-reduction per process group for the whole parameter group.
        sharded: dict[int, tuple[bnb.FullBlocks, list[torch.Tensor]]] = {}
        maxes = comm.MaxBucket()
        for i, (p, grad, e) in enumerate(zip(params, grads, eight)):
            layout = self.layout(p)
            if e and not layout.is_local:
                blocks = bnb.FullBlocks(layout, p.device)
                moments = self._plain_moments_8bit(self.state[p], grad, blocks, beta1, beta2)
                sharded[i] = (blocks, [maxes.add(blocks.amax(m), layout.sum_groups) for m in moments])
        maxes.flush()

        for i, (p, grad, e) in enumerate(zip(params, grads, eight)):
            state = self.state[p]
            state["step"] += 1
            if e:
                # A whole tensor: bitsandbytes computes each block's absmax itself (None here).
                blocks, absmax = sharded.get(i) or (bnb.FullBlocks(self.layout(p), p.device), None)
                m, v = self._plain_moments_8bit(state, grad, blocks, beta1, beta2)
            else:
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(grad, alpha=1.0 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
            step_size, denom = self._step_size_and_denom(group, v, float(state["step"]))
            p.addcdiv_(m.to(p.dtype), denom.to(p.dtype), value=-step_size)
            if e:
                bnb.write_moments_8bit(state, "", blocks, [m, v], absmax)
        if self.adam_style == "hf" and wd > 0.0:
            torch._foreach_add_(params, params, alpha=-lr * wd)

    def _fused_plain_adamw(self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor]) -> bool:
        """fp32-moment AdamW of plain params through torch's fused kernel (one pass over param,
        grad and moments; on the CPU ~5x faster than the per-op path, which allocates
        param-sized temporaries). Returns False, having changed nothing, where the kernel does not
        apply: it always bias-corrects, and wants dense tensors of one dtype per param.

        The kernel computes ``p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``
        (bitsandbytes' form). transformers' form ``lr * sqrt(1 - b2^t) / (1 - b1^t) * m /
        (sqrt(v) + eps)`` is the same update with ``eps / sqrt(1 - b2^t)`` in its place, so the
        "hf" style passes that (one call per distinct step count); its weight decay follows the
        update, as before."""
        if not group["correct_bias"] or not _FUSED_ADAMW:
            return False
        for p, g in zip(params, grads):
            st = self.state[p]
            m, v = st["exp_avg"], st["exp_avg_sq"]
            # meta: the kernel has a meta implementation; dist_optim.plan then simulates the GPU's path
            if p.device.type not in ("cpu", "cuda", "meta") or not p.dtype.is_floating_point:
                return False
            if not all(t.dtype == p.dtype and t.device == p.device and t.is_contiguous() for t in (p, g, m, v)):
                return False
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        by_step: dict[tuple[float, torch.device], list[int]] = collections.defaultdict(list)
        for i, p in enumerate(params):
            self.state[p]["step"] += 1
            by_step[(float(self.state[p]["step"]), p.device)].append(i)
        for (t, device), idx in by_step.items():
            ps = [params[i] for i in idx]
            states = [self.state[p] for p in ps]
            steps = [st["step"] if device.type == "cpu" else st["step"].to(device) for st in states]
            step_eps = eps / math.sqrt(1.0 - beta2**t) if self.adam_style == "hf" else eps
            torch._fused_adamw_(
                ps,
                [grads[i] for i in idx],
                [st["exp_avg"] for st in states],
                [st["exp_avg_sq"] for st in states],
                [],
                steps,
                amsgrad=False,
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                weight_decay=wd if self.adam_style == "bnb" else 0.0,
                eps=step_eps,
                maximize=False,
            )
        if self.adam_style == "hf" and wd > 0.0:
            torch._foreach_add_(params, params, alpha=-lr * wd)
        return True

    @staticmethod
    def _plain_moments_8bit(
        state: dict[str, Any], grad: torch.Tensor, blocks: bnb.FullBlocks, beta1: float, beta2: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's fp32 moments of a plain parameter from its 8-bit state (not stored)."""
        g = grad.float()
        m, v = bnb.read_moments_8bit(state, "", blocks)
        m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        return m, v


# state_dict() names the optimizer by its class path and load_state_dict refuses another: keep the
# single-module version's ``dist_optim.galore.DistributedGaLore`` (the package re-exports it), so
# checkpoints saved before and after the package split load into each other.
DistributedGaLore.__module__ = "dist_optim.galore"


def _projectors(state: dict[str, Any], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored projectors in the dtype they multiply (fp16-stored ones are widened per use:
    r x N or M x r, small next to the matrix). A side without one gets an empty tensor: a
    projection that used it would fail on shapes, never compute with a stale value."""
    left, right = state.get("proj_left"), state.get("proj_right")
    absent = torch.empty(0, dtype=dtype)
    return (absent if left is None else left.to(dtype), absent if right is None else right.to(dtype))


#: torch's fused AdamW kernel (CPU and CUDA since torch 2.4).
_FUSED_ADAMW = hasattr(torch, "_fused_adamw_")


def _svd_cost(shape: tuple[int, ...]) -> float:
    m, n = shape
    return float(m) * n * min(m, n)


class _Item:
    """One GaLore parameter in one step."""

    __slots__ = ("group", "param", "grad", "layout", "side", "state", "refresh", "full_grad", "low")

    def __init__(
        self,
        group: dict[str, Any],
        param: torch.Tensor,
        grad: torch.Tensor,
        layout: ParamLayout,
        side: str,
        state: dict[str, Any],
        refresh: bool,
    ) -> None:
        self.group = group
        self.param = param
        self.grad = grad
        self.layout = layout
        self.side = side
        self.state = state
        self.refresh = refresh
        self.full_grad: torch.Tensor | None = None
        self.low: torch.Tensor | None = None


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


# ---- building GaLore groups from a model ------------------------------------------------------
#: Module-name fragments of attention and MLP blocks (Llama, GPT-2, BERT, OPT, Mistral, ...).
DEFAULT_TARGETS = (r"attn", r"attention", r"mlp", r"ffn", r"feed_forward", r"intermediate", r"output\.dense")


def galore_param_groups(
    model: torch.nn.Module,
    rank: int,
    update_proj_gap: int = 200,
    scale: float = 0.25,
    proj_type: str = "std",
    weight_decay: float = 0.0,
    targets: Iterable[str] = DEFAULT_TARGETS,
    no_decay: Iterable[str] = ("bias", "norm"),
) -> list[dict[str, Any]]:
    """Parameter groups for :class:`DistributedGaLore` (or galore_torch) from a model.

    The 2-D ``weight`` of every module whose qualified name matches one of ``targets`` (regular
    expressions; attention and MLP blocks by default) goes into the GaLore group; embeddings, the
    LM head and other matrices get plain AdamW with ``weight_decay``; parameters whose name contains
    one of ``no_decay`` (biases, norms) get plain AdamW without weight decay. Empty groups are
    dropped. Use it before the model is sharded (as the optimizer is built in ColossalAI).
    """
    patterns = [re.compile(t) for t in targets]
    no_decay = tuple(s.lower() for s in no_decay)
    galore, decay, plain = [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        module_name, _, leaf = name.rpartition(".")
        if any(s in name.lower() for s in no_decay):
            plain.append(param)
        elif leaf == "weight" and param.dim() == 2 and any(p.search(module_name) for p in patterns):
            if rank > min(param.shape):
                raise ValueError(f"galore_param_groups: rank={rank} exceeds min{tuple(param.shape)} of {name}")
            galore.append(param)
        else:
            decay.append(param)
    groups = [
        {
            "params": galore,
            "rank": rank,
            "update_proj_gap": update_proj_gap,
            "scale": scale,
            "proj_type": proj_type,
            "weight_decay": weight_decay,
        },
        {"params": decay, "weight_decay": weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


# ---- conversions from the GaLore optimizers users have ----------------------------------------
_GALORE_KEYS = ("rank", "update_proj_gap", "scale", "proj_type")


def _galore_keys(g: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    if "rank" not in g:
        return {}
    out = {"rank": g["rank"]}
    for key in _GALORE_KEYS[1:]:
        if key in g:
            out[key] = g[key]
        elif key in defaults:
            out[key] = defaults[key]
        else:
            raise ValueError(f"convert: GaLore group with rank={g['rank']} has no {key!r}")
    return out  # checked by DistributedGaLore.validate_group


def _galore_torch_adamw(opt: torch.optim.Optimizer, g: Mapping[str, Any]) -> dict[str, Any]:
    # galore_torch.GaLoreAdamW reads group["update_proj_gap"] etc. with no default.
    return dict(
        lr=g["lr"],
        betas=tuple(g["betas"]),
        eps=g["eps"],
        weight_decay=g["weight_decay"],
        correct_bias=bool(g["correct_bias"]),
        optim_bits=32,
        adam_style="hf",
        **_galore_keys(g, {}),
    )


def _bnb_galore(opt: torch.optim.Optimizer, g: Mapping[str, Any], positional_shift: bool) -> dict[str, Any]:
    args = getattr(opt, "args", None)
    if positional_shift and args is not None:
        # galore_torch.GaLoreAdamW8bit passes (min_8bit_size, percentile_clipping, block_wise)
        # positionally; on bitsandbytes >= 0.45 those land in (min_8bit_size, max_unorm,
        # skip_zeros). Read them back as what the user wrote.
        args = {
            "optim_bits": getattr(args, "optim_bits", 8),
            "min_8bit_size": getattr(args, "min_8bit_size", 4096),
            "percentile_clipping": getattr(args, "max_unorm", 100),
            "block_wise": getattr(args, "skip_zeros", True),
        }
    quant = bnb.quant_args(args, "DistributedGaLore") if args is not None else {}
    if "weight_decay_saved" in g:
        raise ValueError("convert: the optimizer is in the middle of a step (weight_decay_saved is set)")
    return dict(
        lr=g["lr"],
        betas=tuple(g["betas"][:2]),
        eps=g["eps"],
        weight_decay=g["weight_decay"],
        correct_bias=True,
        optim_bits=quant.get("optim_bits", 8),
        min_8bit_size=quant.get("min_8bit_size", 4096),
        is_paged=bool(getattr(opt, "is_paged", False)),
        adam_style="bnb",
        **_galore_keys(g, GROUP_DEFAULTS),
    )


def _galore_torch_8bit(opt: torch.optim.Optimizer, g: Mapping[str, Any]) -> dict[str, Any]:
    import inspect

    from bitsandbytes.optim.optimizer import Optimizer2State

    shifted = "percentile_clipping" not in inspect.signature(Optimizer2State.__init__).parameters
    return _bnb_galore(opt, g, positional_shift=shifted)


def _colossal_galore_8bit(opt: torch.optim.Optimizer, g: Mapping[str, Any]) -> dict[str, Any]:
    return _bnb_galore(opt, g, positional_shift=False)


_HF_READS = frozenset({"lr", "betas", "eps", "weight_decay", "correct_bias", *_GALORE_KEYS})
_BNB_READS = frozenset({"lr", "betas", "eps", "weight_decay", *_GALORE_KEYS})
# bitsandbytes' AdEMAMix options in Optimizer2State's defaults: only their "off" values convert.
_BNB_NEUTRAL = {"alpha": 0.0, "t_alpha": None, "t_beta3": None}

register(Conversion("galore_torch.adamw.AdamW", DistributedGaLore, _galore_torch_adamw, _HF_READS))
register(
    Conversion("galore_torch.adamw8bit.AdamW8bit", DistributedGaLore, _galore_torch_8bit, _BNB_READS, _BNB_NEUTRAL)
)
for _path in (
    "colossalai.nn.optimizer.galore.GaLoreAdamW8bit",
    "colossalai.nn.optimizer.distributed_galore.DistGaloreAwamW",
):
    register(Conversion(_path, DistributedGaLore, _colossal_galore_8bit, _BNB_READS, _BNB_NEUTRAL))
del _path

register_plan(
    PlanEntry(
        "galore",
        DistributedGaLore,
        refresh={"update_proj_gap": 2},
        group_builder=("galore_param_groups", {"rank": 128}),
    )
)
