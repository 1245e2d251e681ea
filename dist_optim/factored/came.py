"""CAME: Confidence-guided Adaptive Memory Efficient optimization (Luo et al., 2023, ACL,
arXiv:2307.02047), exact under tensor parallelism and ZeRO.

Per parameter tensor, as in the authors' ``came_pytorch.CAME`` (and ColossalAI's copy)::

    R <- b2 R + (1 - b2) mean_cols(G^2 + eps1)                  (factored, ndim >= 2)
    C <- b2 C + (1 - b2) mean_rows(G^2 + eps1)
    U  = G * rsqrt(R / mean_rows(R)) * rsqrt(C)                 (vectors: G * rsqrt(V))
    U <- U / max(1, RMS(U) / clip_threshold)
    m <- b1 m + (1 - b1) U
    Rr <- b3 Rr + (1 - b3) mean_cols((U - m)^2 + eps2)         (factored: confidence statistics)
    Cr <- b3 Cr + (1 - b3) mean_rows((U - m)^2 + eps2)
    step = m * rsqrt(Rr / mean_rows(Rr)) * rsqrt(Cr)             (vectors: step = m)
    W <- W - lr weight_decay W - lr step

Deviations from the paper, kept for compatibility with the implementation users run: the
second moment has no bias correction, and the factored statistics are over the last two dims
with leading dims kept. The second moment and its preconditioning are Adafactor's
(:mod:`dist_optim.factored.statistics`, shared with :class:`~dist_optim.DistributedAdafactor`).

State keys: ``step``, ``exp_avg``; ``row_var``/``col_var`` (second moment) and
``res_row_var``/``res_col_var`` (confidence) in full-matrix form for >= 2-D parameters;
``variance`` for vectors. ``exp_avg`` and ``variance`` have the parameter's local form.
Deviation: a parameter shared by ``n`` ranks (TP slices, ZeRO chunks) keeps in ``optimizer.state``
only this rank's 1/n partition of the four statistics, flattened, and a vector replicated over
the TP group only this rank's part of its ``variance`` (:mod:`dist_optim.factored.statistics`);
``full_state()`` and checkpoints have them in full form under every layout.

Distributed: every statistic is that of the full tensor. A step flushes three
:class:`~dist_optim.comm.SumBucket` s, shared by all parameters: second-moment statistics, RMS(U),
confidence statistics (at most one all-reduce per process group each), plus the NaN/Inf check's
flag (one all-reduce over the job and one host read, unless ``nonfinite="ignore"``; see
:class:`~dist_optim.base.DistOptimizer`).

8-bit first moment (``optim_bits=8``, bitsandbytes' option name; Dettmers et al., 2022, "8-bit
Optimizers via Block-wise Quantization", arXiv:2110.02861): ``m`` of a parameter of at least
``min_8bit_size`` elements (full tensor) is kept as bitsandbytes' block-wise codes
(:mod:`dist_optim.states.bnb`: blocks of 256 values of the *full* flattened tensor, one fp32 absmax
each, the signed dynamic map), 1.016 bytes per element instead of 4, under the same key
``exp_avg`` (its absmax under ``exp_avg_absmax``). As bitsandbytes' 8-bit kernels do, a step
dequantises it and updates it in fp32; the instability ``U - m`` and the step use that fp32 value,
which is stored quantised again (one max-reduction of the absmax per process group for all
parameters, so the codes of a tensor held in pieces are the single-device ones). Every
parameter's fp32 value is alive at the end of phase 3, where that one re-quantisation needs them,
and is kept for phase 4 (no higher peak): the memory saved is the state's, between steps. What
stays fp32: the factored second-moment and confidence statistics (rows plus columns of each
matrix, already a small fraction of its elements, and partitioned over the ranks that share it),
vectors' ``variance`` (the second moment of biases and norms, a few elements), the absmax and the
step counter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..base import check_lr, check_range
from ..checks import group_lr
from ..comm import SumBucket
from ..layout import ParamLayout
from ..registry import CatalogueEntry, Conversion, Demo, register, register_entry
from ..states import bnb, codecs
from .statistics import (
    EPS_ADD,
    FactoredOptimizer,
    FactoredParam,
    approx_inv_sqrt,
    clip_factor,
    ema_,
    fold_second_moment,
    fold_sums,
    init_second_moment,
    init_statistics,
    low_precision_copy,
    math_dtype,
    preconditioned,
    queue_factored_sums,
    queue_sumsq,
)

__all__ = ["DistributedCAME"]


#: CAME's first moment, bitsandbytes' signed 8-bit codes with ``optim_bits=8`` (the factored
#: statistics stay in :func:`math_dtype`).
EXP_AVG = codecs.Entry("exp_avg", codecs.BNB_SIGNED)


class DistributedCAME(FactoredOptimizer):
    """CAME with exact factored statistics under TP and ZeRO (see the module docstring).

    Args:
        params: parameters or parameter groups (floating point).
        lr: learning rate (> 0; came_pytorch has no default and requires it).
        eps: ``(eps1, eps2)`` added to the squared gradient and to the squared instability, > 0.
        clip_threshold: update clipping threshold on RMS(U), > 0.
        betas: ``(b1, b2, b3)``: first moment, second moment, confidence, each in [0, 1).
        weight_decay: decoupled weight decay, applied as ``W <- W - lr weight_decay W``.
        optim_bits: 32, or 8 for the first moment ``exp_avg`` kept as bitsandbytes' block-wise
            8-bit codes (module docstring); the factored statistics stay fp32.
        min_8bit_size: with ``optim_bits=8``, first moments of tensors with fewer elements (full
            tensor) stay 32-bit (bitsandbytes' default 4096).
        nonfinite: a step with a NaN/Inf gradient ``"raise"`` (default), ``"skip"`` or
            ``"ignore"`` (see :class:`~dist_optim.base.DistOptimizer`).
    """

    _sharded_state = ("exp_avg", "variance")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | None = None,
        eps: tuple[float, float] = (1e-30, 1e-16),
        clip_threshold: float = 1.0,
        betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
        weight_decay: float = 0.0,
        *,
        optim_bits: int = 32,
        min_8bit_size: int = 4096,
        nonfinite: str = "raise",
    ) -> None:
        self.optim_bits, self.min_8bit_size = codecs.check_8bit_options(
            optim_bits, min_8bit_size, "8-bit block-wise exp_avg"
        )
        defaults = dict(
            lr=lr,
            eps=tuple(eps) if isinstance(eps, (tuple, list)) else eps,
            clip_threshold=clip_threshold,
            betas=tuple(betas) if isinstance(betas, (tuple, list)) else betas,
            weight_decay=weight_decay,
        )
        super().__init__(params, defaults, nonfinite=nonfinite)

    def validate_group(self, group: dict[str, Any]) -> None:
        super().validate_group(group)
        codecs.refuse_group_8bit_options(group, type(self).__name__)
        if group["lr"] is None:
            raise ValueError("lr: DistributedCAME needs an explicit lr > 0 (came_pytorch has no default)")
        check_lr(group["lr"], open_low=True)
        eps = group["eps"]
        if not isinstance(eps, (tuple, list)) or len(eps) != 2:
            raise ValueError(f"eps must be a pair (eps1, eps2), got {eps!r}")
        for i, e in enumerate(eps):
            check_range(f"eps[{i}]", e, 0.0, open_low=True)
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 3:
            raise ValueError(f"betas must be a triple (beta1, beta2, beta3), got {betas!r}")
        for i, b in enumerate(betas):
            check_range(f"betas[{i}]", b, 0.0, 1.0)
        check_range("clip_threshold", group["clip_threshold"], 0.0, open_low=True)
        check_range("weight_decay", group["weight_decay"], 0.0)

    def _init_state(self, item: FactoredParam) -> None:
        state = item.state
        if not self.eight_bit(item.layout):  # 8 bits: created by _first_moment
            state["exp_avg"] = torch.zeros_like(item.param, dtype=math_dtype(item.param))
        init_second_moment(state, item.param, item.fac, self._vector_part(item.param))
        if item.fac is not None:
            init_statistics(state, item.param, item.fac, ("res_row_var", "res_col_var"))

    def _second_moment_decay(self, item: FactoredParam) -> tuple[float, float]:
        return item.group["betas"][1], item.group["eps"][0]

    def eight_bit(self, layout: ParamLayout) -> bool:
        """Whether a parameter of this layout keeps its first moment in 8 bits (``optim_bits``,
        ``min_8bit_size`` of its full tensor)."""
        return codecs.EightBit.of(self).keeps(layout.full_numel)

    def _first_moment(self, item: FactoredParam, dtype: torch.dtype, batch: bnb.Batch8bit) -> torch.Tensor:
        """``exp_avg`` to update in place: the state's 32-bit tensor, or an 8-bit one's values in
        ``dtype`` (read from ``batch``, stored quantised by its ``store``). A state saved with the
        other ``optim_bits`` is carried over (quantised, or dequantised into the state)."""
        state, p = item.state, item.param
        if self.eight_bit(item.layout):
            return EXP_AVG.codec.read(batch, state, EXP_AVG.name, item.layout, p, dtype)
        EXP_AVG.codec.to_plain(batch, state, EXP_AVG.name, item.layout, p.device, math_dtype(p))
        return state[EXP_AVG.name]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self._begin_step(closure)
        if not self._gradients_ok():
            return loss

        # Phase 1: this step's second-moment statistics of every parameter, one flush.
        stats = SumBucket()
        items = self._items(stats)
        stats.flush()

        # Phase 2: RMS of every U = G V^-1/2, one flush.
        norms = SumBucket()
        for item in items:
            eps1 = item.group["eps"][0]
            fold_second_moment(item, item.group["betas"][1], EPS_ADD, eps1)
            update = preconditioned(item, EPS_ADD, eps1, self._workspace(item.grad))
            item.sumsq["update"] = queue_sumsq(norms, item.layout, update)
        norms.flush()

        # Phase 3: first moment of the clipped U, and the confidence statistics of U - m, one flush.
        confidence = SumBucket()
        batch = bnb.Batch8bit()
        moments = []
        for item in items:
            group = item.group
            beta1 = group["betas"][0]
            clip = clip_factor(item.sumsq["update"], item.layout, group["clip_threshold"])
            update = preconditioned(item, EPS_ADD, group["eps"][0], self._workspace(item.grad), clip)
            # The full second-moment statistics are not needed again this step: free them.
            item.full.clear()
            exp_avg = self._first_moment(item, update.dtype, batch)
            moments.append(exp_avg)
            ema_(exp_avg, update, beta1)
            if item.fac is not None:
                # Instability of the update w.r.t. its running mean: the statistic CAME factors.
                instability = update.sub_(exp_avg).square_()
                keys = ("res_row_var", "res_col_var")
                queue_factored_sums(confidence, item, instability, keys, group["betas"][2], group["eps"][1])

        batch.store()  # one max-reduction of the 8-bit moments' block absmax per process group
        confidence.flush()

        # Phase 4: the step, m (an 8-bit one's fp32 value) preconditioned by the confidence statistics.
        for item, exp_avg in zip(items, moments):
            group = item.group
            p = item.param
            w = low_precision_copy(p)
            lr = group_lr(group)
            if group["weight_decay"] != 0:
                w.add_(w, alpha=-group["weight_decay"] * lr)
            if item.fac is not None:
                fold_sums(item)
                full = item.full
                step = approx_inv_sqrt(
                    item.fac, full["res_row_var"], full["res_col_var"], exp_avg, out=self._workspace(exp_avg)
                )
            else:
                step = exp_avg
            w.add_(step, alpha=-lr)
            if w is not p:
                p.copy_(w)
        return loss


# ---- conversions from the CAME classes users have -----------------------------------------------
def _came_options(opt: torch.optim.Optimizer, g: Mapping[str, Any]) -> dict[str, Any]:
    return dict(
        lr=g["lr"],
        eps=tuple(g["eps"]),
        clip_threshold=g["clip_threshold"],
        betas=tuple(g["betas"]),
        weight_decay=g["weight_decay"],
    )


def _came_state(state: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "step": torch.tensor(float(state["step"]), dtype=torch.float32),
        "exp_avg": state["exp_avg"].float(),
    }
    if "exp_avg_sq_row" in state:
        out["row_var"] = state["exp_avg_sq_row"].float().unsqueeze(-1)
        out["col_var"] = state["exp_avg_sq_col"].float().unsqueeze(-2)
        out["res_row_var"] = state["exp_avg_res_row"].float().unsqueeze(-1)
        out["res_col_var"] = state["exp_avg_res_col"].float().unsqueeze(-2)
    else:
        out["variance"] = state["exp_avg_sq"].float()
    return out


_CAME_READS = frozenset({"lr", "eps", "clip_threshold", "betas", "weight_decay"})
for _path in ("came_pytorch.CAME.CAME", "colossalai.nn.optimizer.came.CAME"):
    register(Conversion(_path, DistributedCAME, _came_options, _CAME_READS, state=_came_state))
# ColossalAI's distributed class keeps TP/ZeRO-local state: only convertible before its first step.
register(
    Conversion("colossalai.nn.optimizer.distributed_came.DistributedCAME", DistributedCAME, _came_options, _CAME_READS)
)

register_entry(
    CatalogueEntry(
        "came",
        DistributedCAME,
        plan_options={"lr": 1e-4},
        transient="none (row/column statistics are small)",
        demo=Demo("CAME", 2.2e-4),
    )
)
