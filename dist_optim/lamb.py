"""LAMB: layer-wise adaptive moments (You et al., 2019, "Large Batch Optimization for Deep
Learning: Training BERT in 76 minutes", arXiv:1904.00962).

Per parameter tensor::

    m <- b1 m + (1 - b1) g
    v <- b2 v + (1 - b2) g^2
    u  = m / (sqrt(v) + eps) + weight_decay * w
    r  = ||w|| / ||u||            (1 when either norm is 0; ||w|| optionally clamped)
    w <- w - lr * c_t * r * u,     c_t = sqrt(1 - b2^t) / (1 - b1^t) with bias correction, else 1

Deviation from the paper, kept for compatibility with the LAMB that users already run
(``colossalai.nn.optimizer.Lamb``, ``torch_optimizer.Lamb``): bias correction is folded into the
step size ``c_t`` instead of correcting ``m`` and ``v`` before ``eps`` is added, and the paper's
scaling function ``phi`` is the identity, or a clamp at ``clamp_value`` (torch_optimizer's
``clamp_value``) when set.

Distributed: the two norms are of the *full* parameter and update. Each rank squares and sums the
elements it holds (a TP slice, a ZeRO chunk, or both); the sums of the parameters of a bucket are
all-reduced in one collective per process group (see :class:`dist_optim.comm.SumBucket`), plus the
NaN/Inf check's flag (one all-reduce over the job and one host read, unless ``nonfinite="ignore"``;
see :class:`~dist_optim.base.DistOptimizer`). No other ``.item()``: the trust ratio stays a tensor.

Step memory (:mod:`dist_optim.budget`): the step goes through the parameters (in param-group
order) in buckets of at most ``bucket_bytes`` of local update buffers (a parameter's bytes: its
local tensor's, the update having its dtype); per bucket the moments and updates, the norms' one
all-reduce per process group, the trust ratios and the update applied, then the buffers are
freed. So the step holds one bucket's updates instead of one per parameter, and issues at most one
all-reduce per group *per bucket* (``bucket_bytes=None``: one bucket, the fewest collectives).
Every parameter's arithmetic is the same whatever the bucketing, and so are the results, bit for
bit, where a reduction's sum does not depend on its buffer's length (the tests: groups of 2 ranks);
a backend that sums more ranks in an order set by the position in the buffer may differ in the
last bit of a norm.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .base import DistOptimizer, check_adam_options, check_range
from .budget import DEFAULT_BUCKET_BYTES, buckets, check_bucket_bytes
from .comm import SumBucket
from .registry import Conversion, PlanEntry, register, register_plan

__all__ = ["DistributedLamb"]


class DistributedLamb(DistOptimizer):
    """LAMB, exact under tensor parallelism and ZeRO (see the module docstring).

    Args:
        params: parameters or parameter groups.
        lr: learning rate (>= 0).
        betas: coefficients of the running averages of the gradient and its square, in [0, 1).
        eps: added to ``sqrt(v)`` (>= 0).
        weight_decay: L2 term added to the update before the trust ratio (LAMB's decoupled form).
        bias_correction: scale the step by ``sqrt(1 - b2^t) / (1 - b1^t)``.
        adam: use a trust ratio of 1 (Adam with LAMB's update form), for comparisons.
        clamp_value: if set, ``||w||`` is clamped to ``[0, clamp_value]`` before the ratio.
        foreach: multi-tensor (foreach) kernels; ``None`` (default) uses them on accelerators and a
            per-tensor loop on the CPU, as torch's optimizers do. The result is the same.
        bucket_bytes: the step's budget of local update buffers per bucket of parameters
            (:mod:`dist_optim.budget`; default 256 MiB), or None for one bucket per step.
        nonfinite: a step with a NaN/Inf gradient ``"raise"`` (default), ``"skip"`` or
            ``"ignore"`` (see :class:`~dist_optim.base.DistOptimizer`).
    """

    _sharded_state = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        adam: bool = False,
        clamp_value: float | None = None,
        foreach: bool | None = None,
        *,
        bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
        nonfinite: str = "raise",
    ) -> None:
        self.bucket_bytes = check_bucket_bytes(bucket_bytes)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bool(bias_correction),
            adam=bool(adam),
            clamp_value=clamp_value,
            foreach=foreach,
        )
        super().__init__(params, defaults, nonfinite=nonfinite)

    def validate_group(self, group: dict[str, Any]) -> None:
        super().validate_group(group)
        check_adam_options(**{k: group[k] for k in ("lr", "betas", "eps", "weight_decay")})
        if group["clamp_value"] is not None:
            check_range("clamp_value", group["clamp_value"], 0.0)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self._begin_step(closure)
        if not self._gradients_ok():
            return loss
        work = [(group, p, g) for group in self.param_groups for p, g in zip(*self._grads(group))]
        sizes = [p.numel() * p.element_size() for _, p, _ in work]
        for start, stop in buckets(sizes, self.bucket_bytes):
            self._step_bucket(work[start:stop])
        return loss

    def _step_bucket(self, work: list[tuple[dict[str, Any], torch.Tensor, torch.Tensor]]) -> None:
        """One bucket of ``(group, param, grad)``, consecutive in param-group order: moments and
        updates, the sums of squares of all its groups in one :class:`SumBucket` (one collective
        per process group), then each group finishes with the reduced norms. The updates are freed
        on return."""
        bucket = SumBucket()
        pending = []
        for _, run in itertools.groupby(work, key=lambda w: id(w[0])):  # each group's consecutive params
            part = list(run)
            pending.append(self._queue_group(part[0][0], [w[1] for w in part], [w[2] for w in part], bucket))
        bucket.flush()
        for group, params, updates, steps, sq, parts in pending:
            for index, reduced in parts:
                sq.index_copy_(1, index, reduced)
            scale = _trust_scale(group, sq, steps)
            if params[0].device.type != "cpu":
                torch._foreach_mul_(updates, list(scale.to(updates[0].dtype).unbind()))
                torch._foreach_add_(params, updates)
            else:
                # On the CPU a scalar read is no device sync; one fused pass per tensor.
                for p, u, c in zip(params, updates, scale.tolist()):
                    p.add_(u, alpha=c)

    def _queue_group(
        self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor], bucket: SumBucket
    ) -> tuple[Any, ...]:
        """Moments and updates of ``params`` (of ``group``, with gradients ``grads``); the local
        sums of squares of the parameters held in pieces queued in ``bucket``."""
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1.0)
        use_foreach = group["foreach"] if group["foreach"] is not None else params[0].device.type != "cpu"
        compute = _updates_foreach if use_foreach else _updates_per_tensor
        updates, sq = compute(params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], group)
        by_groups: dict[tuple[int, ...], list[int]] = collections.defaultdict(list)
        group_objs: dict[tuple[int, ...], tuple[Any, ...]] = {}
        for i, p in enumerate(params):
            sum_groups = self.layout(p).sum_groups
            if sum_groups:
                key = tuple(id(g) for g in sum_groups)
                by_groups[key].append(i)
                group_objs[key] = sum_groups
        parts = []
        for key, idx in by_groups.items():
            index = torch.tensor(idx, device=sq.device)
            parts.append((index, bucket.add(sq.index_select(1, index), group_objs[key])))
        return group, params, updates, steps, sq, parts


def _trust_scale(group: dict[str, Any], sq: torch.Tensor, steps: list[torch.Tensor]) -> torch.Tensor:
    """Each parameter's step factor ``-lr * bias correction * trust ratio`` from the full sums of
    squares ``sq`` ([2, n]: weights, updates)."""
    norms = sq.sqrt_()
    w_norm, u_norm = norms[0], norms[1]
    if group["clamp_value"] is not None:
        w_norm = w_norm.clamp(0, group["clamp_value"])
    if group["adam"]:
        ratio = torch.ones_like(w_norm)
    else:
        ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
    beta1, beta2 = group["betas"]
    if group["bias_correction"]:
        # ``step`` lives on the CPU (as in torch's optimizers), so reading it is no device sync.
        t = torch.stack(steps).double()
        coef = (1 - beta2**t).sqrt() / (1 - beta1**t)
    else:
        coef = torch.ones(len(steps), dtype=torch.float64)
    return (-group["lr"] * coef).to(ratio) * ratio


def _updates_foreach(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    group: dict[str, Any],
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Moments, updates and the local sums of squares ([2, n]: params, updates), multi-tensor."""
    beta1, beta2 = group["betas"]
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denom, group["eps"])
    updates = list(torch._foreach_div(exp_avgs, denom))
    del denom
    if group["weight_decay"] != 0:
        torch._foreach_add_(updates, params, alpha=group["weight_decay"])
    norms = [torch.stack(torch._foreach_norm(params)), torch.stack(torch._foreach_norm(updates))]
    return updates, torch.stack(norms).float().square_()


def _updates_per_tensor(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    group: dict[str, Any],
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The same math one tensor at a time: on the CPU every op then works on a tensor that is
    still in cache, where multi-tensor ops stream all parameters through memory once per op
    (torch's own optimizers choose the same way)."""
    beta1, beta2 = group["betas"]
    updates = []
    sq = torch.empty((2, len(params)), dtype=torch.float32)
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        u = v.sqrt().add_(group["eps"])
        torch.div(m, u, out=u)
        if group["weight_decay"] != 0:
            u.add_(p, alpha=group["weight_decay"])
        # fp32 accumulation for low-precision params; float64 ones keep theirs (vector_norm
        # refuses a narrowing dtype)
        acc = torch.promote_types(p.dtype, torch.float32)
        sq[0, i] = torch.linalg.vector_norm(p, dtype=acc)
        sq[1, i] = torch.linalg.vector_norm(u, dtype=acc)
        updates.append(u)
    return updates, sq.square_()


# ---- conversions from the LAMB classes users have -------------------------------------------
def _lamb_state(state: Any) -> dict[str, Any]:
    return {
        "step": torch.tensor(float(state["step"]), dtype=torch.float32),
        "exp_avg": state["exp_avg"],
        "exp_avg_sq": state["exp_avg_sq"],
    }


def _colossal_lamb(opt: torch.optim.Optimizer, g: Any) -> dict[str, Any]:
    # ``adam`` is an attribute of colossalai's Lamb, not a group option: ColossalAI's own
    # cast_to_distributed loses it.
    return dict(
        lr=g["lr"],
        betas=tuple(g["betas"]),
        eps=g["eps"],
        weight_decay=g["weight_decay"],
        bias_correction=bool(g.get("bias_correction", False)),
        adam=bool(getattr(opt, "adam", False)),
        clamp_value=None,
    )


def _torch_optimizer_lamb(opt: torch.optim.Optimizer, g: Any) -> dict[str, Any]:
    return dict(
        lr=g["lr"],
        betas=tuple(g["betas"]),
        eps=g["eps"],
        weight_decay=g["weight_decay"],
        bias_correction=bool(opt.debias),  # type: ignore[attr-defined]
        adam=bool(opt.adam),  # type: ignore[attr-defined]
        clamp_value=float(opt.clamp_value),  # type: ignore[attr-defined]
    )


_LAMB_READS = frozenset({"lr", "betas", "eps", "weight_decay", "bias_correction"})
for _path in ("colossalai.nn.optimizer.lamb.Lamb", "colossalai.nn.optimizer.distributed_lamb.DistributedLamb"):
    register(Conversion(_path, DistributedLamb, _colossal_lamb, _LAMB_READS, state=_lamb_state))
register(
    Conversion(
        "torch_optimizer.lamb.Lamb",
        DistributedLamb,
        _torch_optimizer_lamb,
        frozenset({"lr", "betas", "eps", "weight_decay"}),
        state=_lamb_state,
    )
)

register_plan(PlanEntry("lamb", DistributedLamb))
