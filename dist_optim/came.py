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
(:mod:`dist_optim.factored`, shared with :class:`~dist_optim.DistributedAdafactor`).

State keys: ``step``, ``exp_avg``; ``row_var``/``col_var`` (second moment) and
``res_row_var``/``res_col_var`` (confidence) in full-matrix form for >= 2-D parameters;
``variance`` for vectors. ``exp_avg`` and ``variance`` have the parameter's local form.
Deviation: a parameter shared by ``n`` ranks (TP slices, ZeRO chunks) keeps in ``optimizer.state``
only this rank's 1/n partition of the four statistics, flattened, and a vector replicated over
the TP group only this rank's part of its ``variance`` (:mod:`dist_optim.factored`);
``full_state()`` and checkpoints have them in full form under every layout.

Distributed: every statistic is that of the full tensor. A step flushes three
:class:`~dist_optim.comm.SumBucket` s, shared by all parameters: second-moment statistics, RMS(U),
confidence statistics (at most one all-reduce per process group each), plus the NaN/Inf check's
flag (one all-reduce over the job and one host read, unless ``nonfinite="ignore"``; see
:class:`~dist_optim.base.DistOptimizer`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .base import check_range
from .comm import SumBucket
from .factored import (
    EPS_ADD,
    FactoredOptimizer,
    Item,
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
from .registry import Conversion, PlanEntry, register, register_plan

__all__ = ["DistributedCAME"]


class DistributedCAME(FactoredOptimizer):
    """CAME with exact factored statistics under TP and ZeRO (see the module docstring).

    Args:
        params: parameters or parameter groups (floating point).
        lr: learning rate (> 0; came_pytorch has no default and requires it).
        eps: ``(eps1, eps2)`` added to the squared gradient and to the squared instability, > 0.
        clip_threshold: update clipping threshold on RMS(U), > 0.
        betas: ``(b1, b2, b3)``: first moment, second moment, confidence, each in [0, 1).
        weight_decay: decoupled weight decay, applied as ``W <- W - lr weight_decay W``.
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
        nonfinite: str = "raise",
    ) -> None:
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
        if group["lr"] is None:
            raise ValueError("lr: DistributedCAME needs an explicit lr > 0 (came_pytorch has no default)")
        check_range("lr", group["lr"], 0.0, open_low=True)
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

    def _init_state(self, item: Item) -> None:
        state = item.state
        state["exp_avg"] = torch.zeros_like(item.param, dtype=math_dtype(item.param))
        init_second_moment(state, item.param, item.fac, self._vector_part(item.param))
        if item.fac is not None:
            init_statistics(state, item.param, item.fac, ("res_row_var", "res_col_var"))

    def _second_moment_decay(self, item: Item) -> tuple[float, float]:
        return item.group["betas"][1], item.group["eps"][0]

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
        for item in items:
            group = item.group
            beta1 = group["betas"][0]
            clip = clip_factor(item.sumsq["update"], item.layout, group["clip_threshold"])
            update = preconditioned(item, EPS_ADD, group["eps"][0], self._workspace(item.grad), clip)
            # The full second-moment statistics are not needed again this step: free them.
            item.full.clear()
            exp_avg = item.state["exp_avg"]
            ema_(exp_avg, update, beta1)
            if item.fac is not None:
                # Instability of the update w.r.t. its running mean: the statistic CAME factors.
                instability = update.sub_(exp_avg).square_()
                keys = ("res_row_var", "res_col_var")
                queue_factored_sums(confidence, item, instability, keys, group["betas"][2], group["eps"][1])

        confidence.flush()

        # Phase 4: the step, m preconditioned by the confidence statistics.
        for item in items:
            group, state = item.group, item.state
            exp_avg = state["exp_avg"]
            p = item.param
            w = low_precision_copy(p)
            lr = group["lr"]
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

register_plan(PlanEntry("came", DistributedCAME, {"lr": 1e-4}))
