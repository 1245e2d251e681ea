"""Adafactor (Shazeer & Stern, 2018, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost",
arXiv:1804.04235), exact under tensor parallelism and ZeRO.

Two variants, selected by ``variant`` (each reproduces one widely used implementation exactly):

``variant="transformers"`` (default): ``transformers.optimization.Adafactor`` (= fairseq's), per
parameter tensor, step ``t``::

    beta2_t = 1 - t^decay_rate
    R <- beta2_t R + (1 - beta2_t) mean_cols(G^2 + eps1)        (factored, ndim >= 2)
    C <- beta2_t C + (1 - beta2_t) mean_rows(G^2 + eps1)
    U  = G * rsqrt(R / mean_rows(R)) * rsqrt(C)                 (vectors: G * rsqrt(V))
    U <- U / max(1, RMS(U) / clip_threshold)
    rho = min(1e-2, 1/sqrt(t))  (relative_step; warmup_init: min(1e-6 t, 1/sqrt(t)))  else lr
    a   = max(eps2, RMS(W)) * rho  (scale_parameter)  else rho
    m  <- beta1 m + (1 - beta1) a U ; step = m                  (beta1 set) else step = a U
    W  <- W - weight_decay * a * W - step

``variant="torch"``: ``torch.optim.Adafactor`` (no first moment, always relative and parameter
scaled, ``lr`` caps the relative step, ``eps1`` clamps instead of being added)::

    R <- lerp(R, mean_cols(G^2), t^beta2_decay), same for C
    V  = R C / max(mean_rows(R), eps1)
    U  = G / max(sqrt(V), eps1)  (eps1=None: machine epsilon of the param's dtype)
    a  = max(eps2, RMS(W)) * min(lr, 1/sqrt(t))
    W  <- W (1 - lr weight_decay) - a U / max(1, RMS(U) / d)

Deviations from the paper (shared with the implementations above): the row/column statistics
are of the last two dims, leading dims kept (batched matrices, conv kernels); beta1 averages the
scaled update (fairseq) rather than the raw gradient; the user's ``lr`` is honoured when
``relative_step=False`` (transformers) and as the cap of the relative step (torch); weight
decay is decoupled. Deviations from ``torch.optim.Adafactor`` in the transformers variant: eps1
is added to the squared gradient (paper, fairseq) and the decay uses the scaled step.

State keys follow ``torch.optim.Adafactor``: ``step``; ``row_var`` (shape ``full[:-1] + (1,)``)
and ``col_var`` (``full[:-2] + (1, C)``) for parameters with >= 2 dims; ``variance`` for vectors and
``exp_avg`` (beta1), which have the parameter's local form. Deviation: a parameter shared by ``n``
ranks (TP slices, ZeRO chunks) keeps in ``optimizer.state`` only this rank's 1/n partition of
``row_var`` and ``col_var``, flattened, and a vector replicated over the TP group (a norm weight)
only this rank's part of its ``variance`` (:mod:`dist_optim.factored.statistics`); ``full_state()`` and
checkpoints have them in full form, as above, under every layout.

Distributed (see :mod:`dist_optim.factored.statistics`): the row/column statistics, RMS(W) and RMS(U)
are those of the full tensor. A step issues two flushes of one :class:`~dist_optim.comm.SumBucket`
(the statistics and RMS(W) of every parameter, then RMS(U) of every parameter): at most one
all-reduce per process group and flush, whatever the number of parameters, plus the NaN/Inf
check's flag (one all-reduce over the job and one host read, unless ``nonfinite="ignore"``; see
:class:`~dist_optim.base.DistOptimizer`). No gradient is gathered and there is no other host sync
(``step`` is a CPU scalar, as in torch).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..base import check_lr, check_range
from ..checks import group_lr
from ..comm import SumBucket
from ..registry import ANY, CatalogueEntry, Conversion, Demo, register, register_entry
from .statistics import (
    EPS_ADD,
    EPS_CLAMP,
    FactoredOptimizer,
    FactoredParam,
    clip_factor,
    ema_,
    fold_second_moment,
    init_second_moment,
    low_precision_copy,
    math_dtype,
    preconditioned,
    queue_sumsq,
    rms,
)

__all__ = ["DistributedAdafactor"]

VARIANTS = ("transformers", "torch")


class DistributedAdafactor(FactoredOptimizer):
    """Adafactor with exact factored statistics under TP and ZeRO (see the module docstring).

    Args:
        params: parameters or parameter groups (floating point).
        lr: transformers variant: the step size when ``relative_step=False`` (must be None when
            ``relative_step=True``, as in transformers); torch variant: the cap of the relative
            step and the weight-decay coefficient (default 1e-2, torch's).
        eps: ``(eps1, eps2)``: eps1 regularises the squared gradient (added, or a clamp in the
            torch variant, where None means the dtype's machine epsilon); eps2 is the floor of
            the parameter scale. Default ``(1e-30, 1e-3)``, torch variant ``(None, 1e-3)``.
        clip_threshold: update clipping threshold on RMS(U) (torch's ``d``).
        decay_rate: exponent of the second-moment decay ``beta2_t = 1 - t^decay_rate``
            (torch's ``beta2_decay``), <= 0.
        beta1: first-moment coefficient in [0, 1), or None for no first moment.
        weight_decay: decoupled weight decay coefficient.
        scale_parameter: multiply the step by ``max(eps2, RMS(W))``.
        relative_step: use the time-dependent step ``min(cap, 1/sqrt(t))``.
        warmup_init: the cap grows as ``1e-6 t`` (transformers; requires ``relative_step``).
        variant: ``"transformers"`` or ``"torch"``, which implementation to reproduce.
        maximize: maximise the objective (negate the gradient), as torch's ``maximize``.
        nonfinite: a step with a NaN/Inf gradient ``"raise"`` (default), ``"skip"`` or
            ``"ignore"`` (see :class:`~dist_optim.base.DistOptimizer`).
    """

    _sharded_state = ("exp_avg", "variance")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | None = None,
        eps: tuple[float | None, float] | None = None,
        clip_threshold: float = 1.0,
        decay_rate: float = -0.8,
        beta1: float | None = None,
        weight_decay: float = 0.0,
        scale_parameter: bool = True,
        relative_step: bool = True,
        warmup_init: bool = False,
        *,
        variant: str = "transformers",
        maximize: bool = False,
        nonfinite: str = "raise",
    ) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        if variant == "transformers":
            if lr is not None and relative_step:
                # transformers refuses it too: with relative_step the step size is computed.
                raise ValueError(
                    "lr: an explicit lr cannot be combined with relative_step=True (transformers semantics); "
                    "pass relative_step=False (and scale_parameter=False for a plain lr) or lr=None"
                )
            eps = (1e-30, 1e-3) if eps is None else eps
        else:
            lr = 1e-2 if lr is None else lr
            eps = (None, 1e-3) if eps is None else eps
        defaults = dict(
            lr=lr,
            eps=tuple(eps) if isinstance(eps, (tuple, list)) else eps,
            clip_threshold=clip_threshold,
            decay_rate=decay_rate,
            beta1=beta1,
            weight_decay=weight_decay,
            scale_parameter=bool(scale_parameter),
            relative_step=bool(relative_step),
            warmup_init=bool(warmup_init),
            variant=variant,
            maximize=bool(maximize),
        )
        super().__init__(params, defaults, nonfinite=nonfinite)

    def validate_group(self, group: dict[str, Any]) -> None:
        super().validate_group(group)
        if group["variant"] not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {group['variant']!r}")
        _check_eps(group["eps"], group["variant"])
        check_range("clip_threshold", group["clip_threshold"], 0.0, open_low=True)
        decay = group["decay_rate"]
        if not isinstance(decay, (int, float)) or isinstance(decay, bool) or not -math.inf < decay <= 0:
            raise ValueError(f"decay_rate must be a finite number <= 0, got {decay!r}")
        if group["beta1"] is not None:
            check_range("beta1", group["beta1"], 0.0, 1.0)
        check_range("weight_decay", group["weight_decay"], 0.0)
        if group["warmup_init"] and not group["relative_step"]:
            raise ValueError("warmup_init=True requires relative_step=True")
        if group["lr"] is not None:
            check_lr(group["lr"])
        elif not group["relative_step"]:
            raise ValueError("lr: relative_step=False needs an explicit lr")
        if group["variant"] == "torch":
            _check_torch_variant(group)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["variant"] == "transformers" and group["relative_step"] and group["lr"] is not None:
            # transformers ignores a group's lr under relative_step; say so rather than stay silent.
            warnings.warn(
                "DistributedAdafactor: a parameter group sets lr while relative_step=True; lr is ignored "
                "(transformers semantics). Set relative_step=False to use it.",
                stacklevel=3,
            )

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self._begin_step(closure)
        if not self._gradients_ok():
            return loss

        stats = SumBucket()
        items = self._items(stats)
        for item in items:
            if item.group["scale_parameter"]:
                item.sumsq["param"] = queue_sumsq(stats, item.layout, item.param)
        stats.flush()

        norms = SumBucket()
        for item in items:
            # step is a CPU scalar: no device sync.
            eps_mode, eps1 = self._eps(item)
            fold_second_moment(item, self._second_moment_decay(item)[0], eps_mode, eps1)
            update = preconditioned(item, eps_mode, eps1, self._workspace(item.grad))
            item.sumsq["update"] = queue_sumsq(norms, item.layout, update)
        norms.flush()

        for item in items:
            self._apply(item)
        return loss

    def _second_moment_decay(self, item: FactoredParam) -> tuple[float, float]:
        # Both variants' beta2_t is 1 - t^decay_rate; only the transformers variant adds eps1.
        beta = 1.0 - math.pow(float(item.state["step"]), item.group["decay_rate"])
        eps_mode, eps1 = self._eps(item)
        return beta, eps1 if eps_mode == EPS_ADD else 0.0

    def _init_state(self, item: FactoredParam) -> None:
        init_second_moment(item.state, item.param, item.fac, self._vector_part(item.param))
        if item.group["beta1"] is not None:
            item.state["exp_avg"] = torch.zeros_like(item.param, dtype=math_dtype(item.param))

    @staticmethod
    def _eps(item: FactoredParam) -> tuple[str, float]:
        """The epsilon placement and eps1 of the item's variant (torch's None: the dtype's eps)."""
        group = item.group
        if group["variant"] == "transformers":
            return EPS_ADD, group["eps"][0]
        eps1 = group["eps"][0]
        return EPS_CLAMP, torch.finfo(item.param.dtype).eps if eps1 is None else eps1

    def _apply(self, item: FactoredParam) -> None:
        group, state = item.group, item.state
        t = float(state["step"])
        # Step size: rho_t (a Python float) times the parameter scale (a tensor, from the reduced RMS).
        if group["relative_step"]:
            if group["warmup_init"]:
                cap = 1e-6 * t
            else:
                cap = 1e-2 if group["variant"] == "transformers" else group_lr(group)
            rho = min(cap, 1.0 / math.sqrt(t))
        else:
            rho = group_lr(group)
        if group["scale_parameter"]:
            scale = rms(item.sumsq["param"], item.layout).clamp_(min=group["eps"][1]) * rho
        else:
            scale = torch.full((1,), rho, dtype=math_dtype(item.param), device=item.param.device)
        # Clipping and step size ride on the recomputed update's small row factor.
        eps_mode, eps1 = self._eps(item)
        k = clip_factor(item.sumsq["update"], item.layout, group["clip_threshold"]) * scale
        update = preconditioned(item, eps_mode, eps1, self._workspace(item.grad), k)
        if group["beta1"] is not None:
            exp_avg = state["exp_avg"]
            ema_(exp_avg, update, group["beta1"])
            update = exp_avg
        p = item.param
        w = low_precision_copy(p)
        wd = group["weight_decay"]
        if wd != 0:
            if group["variant"] == "transformers":
                w.mul_(1.0 - wd * scale)
            else:
                w.mul_(1.0 - group_lr(group) * wd)
        w.sub_(update)
        if w is not p:
            p.copy_(w)


def _check_eps(eps: Any, variant: str) -> None:
    if not isinstance(eps, (tuple, list)) or len(eps) != 2:
        raise ValueError(f"eps must be a pair (eps1, eps2), got {eps!r}")
    if eps[0] is None:
        if variant != "torch":
            raise ValueError("eps[0]=None (machine epsilon) is torch.optim.Adafactor's; use variant='torch'")
    else:
        check_range("eps[0]", eps[0], 0.0, open_low=True)
    check_range("eps[1]", eps[1], 0.0, open_low=True)


def _check_torch_variant(group: Mapping[str, Any]) -> None:
    # torch.optim.Adafactor has no switch for these: refuse rather than run a third algorithm.
    if not group["relative_step"] or not group["scale_parameter"] or group["warmup_init"]:
        raise ValueError(
            "variant='torch' is always relative_step=True, scale_parameter=True, warmup_init=False "
            "(lr caps the relative step); use variant='transformers' for the other combinations"
        )
    if group["beta1"] is not None:
        raise ValueError("beta1: torch.optim.Adafactor has no first moment; use variant='transformers'")
    if group["lr"] is None:
        raise ValueError("lr: variant='torch' needs lr (the cap of the relative step)")


# ---- conversions from the Adafactor classes users have -----------------------------------------
_HF_READS = frozenset(
    {
        "lr",
        "eps",
        "clip_threshold",
        "decay_rate",
        "beta1",
        "weight_decay",
        "scale_parameter",
        "relative_step",
        "warmup_init",
    }
)


def _hf_options(opt: torch.optim.Optimizer, g: Mapping[str, Any]) -> dict[str, Any]:
    return dict(
        lr=g["lr"],
        eps=tuple(g["eps"]),
        clip_threshold=g["clip_threshold"],
        decay_rate=g["decay_rate"],
        beta1=g["beta1"],
        weight_decay=g["weight_decay"],
        scale_parameter=bool(g["scale_parameter"]),
        relative_step=bool(g["relative_step"]),
        warmup_init=bool(g["warmup_init"]),
        variant="transformers",
        maximize=False,
    )


def _colossal_options(opt: torch.optim.Optimizer, g: Mapping[str, Any]) -> dict[str, Any]:
    # ColossalAI 0.5.0's Adafactor / DistributedAdaFactor overwrite lr with None in __init__ (the
    # user's lr is lost before we see the optimizer) and never update state["RMS"], so their
    # parameter scale is stuck at eps[1]. We convert to the algorithm they document (transformers').
    if not g["relative_step"] and g["lr"] is None:
        raise ValueError(
            f"convert: {type(opt).__name__} option relative_step=False with lr=None: ColossalAI's Adafactor "
            "discards the lr passed to it, so there is no step size to convert; set param_group['lr'] or build "
            "dist_optim.DistributedAdafactor(params, lr=..., relative_step=False) directly"
        )
    if g["scale_parameter"]:
        warnings.warn(
            f"convert: {type(opt).__name__} with scale_parameter=True is converted to transformers' Adafactor, "
            "which scales the step by max(eps[1], RMS(param)); ColossalAI 0.5.0 never updates its RMS and uses "
            "eps[1] instead, so trajectories differ from ColossalAI's (ours is the documented algorithm)",
            stacklevel=4,
        )
    return _hf_options(opt, g)


def _torch_options(opt: torch.optim.Optimizer, g: Mapping[str, Any]) -> dict[str, Any]:
    lr = g["lr"]
    if isinstance(lr, torch.Tensor):
        lr = float(lr)
    return dict(
        lr=lr,
        eps=tuple(g["eps"]),
        clip_threshold=g["d"],
        decay_rate=g["beta2_decay"],
        beta1=None,
        weight_decay=g["weight_decay"],
        scale_parameter=True,
        relative_step=True,
        warmup_init=False,
        variant="torch",
        maximize=bool(g["maximize"]),
    )


def _hf_state(state: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"step": torch.tensor(float(state["step"]), dtype=torch.float32)}
    if "exp_avg" in state:
        out["exp_avg"] = state["exp_avg"].float()
    if "exp_avg_sq_row" in state:
        out["row_var"] = state["exp_avg_sq_row"].float().unsqueeze(-1)
        out["col_var"] = state["exp_avg_sq_col"].float().unsqueeze(-2)
    else:
        out["variance"] = state["exp_avg_sq"].float()
    return out


def _torch_state(state: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"step": torch.tensor(float(state["step"]), dtype=torch.float32)}
    for key in ("row_var", "col_var", "variance"):
        if key in state:
            out[key] = state[key].float()
    return out


register(
    Conversion("transformers.optimization.Adafactor", DistributedAdafactor, _hf_options, _HF_READS, state=_hf_state)
)
register(Conversion("colossalai.nn.optimizer.adafactor.Adafactor", DistributedAdafactor, _colossal_options, _HF_READS))
# ColossalAI's distributed class keeps TP/ZeRO-local state: only convertible before its first step.
register(
    Conversion(
        "colossalai.nn.optimizer.distributed_adafactor.DistributedAdaFactor",
        DistributedAdafactor,
        _colossal_options,
        _HF_READS,
    )
)
register(
    Conversion(
        "torch.optim.Adafactor",
        DistributedAdafactor,
        _torch_options,
        frozenset({"lr", "eps", "d", "beta2_decay", "weight_decay", "maximize"}),
        neutral={"foreach": ANY},
        state=_torch_state,
    )
)

register_entry(
    CatalogueEntry(
        "adafactor",
        DistributedAdafactor,
        recommended={"relative_step": False, "scale_parameter": False},
        plan_options={"relative_step": False, "lr": 1e-3},
        transient="none (row/column statistics are small)",
        demo=Demo("Adafactor (transformers -> ours)", 2.2e-3),
    )
)
