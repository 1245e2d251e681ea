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

Step memory (:mod:`dist_optim.sharding.budget`): the step goes through the parameters (in param-group
order) in buckets of at most ``bucket_bytes`` of local update buffers (a parameter's bytes: its
local tensor's, the update having its dtype; of a flat-range shard, the largest rank's piece, so
that every rank cuts the buckets alike); per bucket the moments and updates, the norms' one
all-reduce per process group, the trust ratios and the update applied, then the buffers are
freed. So the step holds one bucket's updates instead of one per parameter, and issues at most one
all-reduce per group *per bucket* (``bucket_bytes=None``: one bucket, the fewest collectives).
Every parameter's arithmetic is the same whatever the bucketing, and so are the results, bit for
bit, where a reduction's sum does not depend on its buffer's length (the tests: groups of 2 ranks);
a backend that sums more ranks in an order set by the position in the buffer may differ in the
last bit of a norm.

8-bit moments (``optim_bits=8``, bitsandbytes' option; Dettmers et al., 2022, "8-bit Optimizers
via Block-wise Quantization", arXiv:2110.02861): ``m`` and ``v`` of a parameter of at least
``min_8bit_size`` elements (full tensor) are kept as bitsandbytes' block-wise codes
(:mod:`dist_optim.states.bnb`: blocks of 256 values of the *full* flattened tensor, one fp32 absmax
each; the signed dynamic map for ``m``, the unsigned one for ``v``), 2.03 bytes per element for
the pair instead of 8. As bitsandbytes' 8-bit kernels do, a step dequantises them, updates them and
computes ``u`` in fp32, then stores them quantised again; the trust ratio's norms are those of the
fp32 ``u`` and of ``w``, over the full tensor as above. A tensor held in pieces quantises with the
blocks of the full tensor, each block's absmax max-reduced over the ranks holding a piece of it
(one all-reduce per bucket and process group, :class:`dist_optim.states.bnb.Batch8bit`), so
its codes are the single-device ones. What stays fp32: the step counter, the absmax, and the
moments of smaller tensors (biases, norms: a few elements, where an absmax per 256 would save
little and quantising hurts most), as in bitsandbytes.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..base import DistOptimizer, check_adam_options, check_range
from ..checks import group_lr
from ..comm import SumBucket
from ..kernels.dtypes import accumulation_dtype
from ..kernels.multi_tensor import scale_
from ..layout import ParamLayout
from ..registry import CatalogueEntry, Conversion, Demo, register, register_entry
from ..sharding.budget import DEFAULT_BUCKET_BYTES, buckets, check_bucket_bytes
from ..states import bnb, codecs

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
        optim_bits: 32, or 8 for ``exp_avg``/``exp_avg_sq`` kept as bitsandbytes' block-wise 8-bit
            codes (module docstring), the update computed in fp32 from their dequantised values.
        min_8bit_size: with ``optim_bits=8``, moments of tensors with fewer elements (full tensor)
            stay 32-bit (bitsandbytes' default 4096).
        bucket_bytes: the step's budget of local update buffers per bucket of parameters
            (:mod:`dist_optim.sharding.budget`; default 256 MiB), or None for one bucket per step. An 8-bit
            parameter counts its update and the fp32 moments it holds until they are re-quantised.
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
        optim_bits: int = 32,
        min_8bit_size: int = 4096,
        bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
        nonfinite: str = "raise",
    ) -> None:
        self.optim_bits, self.min_8bit_size = codecs.check_8bit_options(
            optim_bits, min_8bit_size, "8-bit block-wise exp_avg and exp_avg_sq"
        )
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
        codecs.refuse_group_8bit_options(group, type(self).__name__)
        check_adam_options(**{k: group[k] for k in ("lr", "betas", "eps", "weight_decay")})
        if group["clamp_value"] is not None:
            check_range("clamp_value", group["clamp_value"], 0.0)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self._begin_step(closure)
        if not self._gradients_ok():
            return loss
        work = [(group, p, g) for group in self.param_groups for p, g in zip(*self._grads(group))]
        # An 8-bit parameter also holds its two fp32 moments until the bucket's re-quantisation.
        sizes = [
            self.layout(p).largest_chunk_numel * (p.element_size() + 8 * self.eight_bit(self.layout(p)))
            for _, p, _ in work
        ]
        for start, stop in buckets(sizes, self.bucket_bytes):
            self._step_bucket(work[start:stop])
        return loss

    def _step_bucket(self, work: list[tuple[dict[str, Any], torch.Tensor, torch.Tensor]]) -> None:
        """One bucket of ``(group, param, grad)``, consecutive in param-group order: moments and
        updates, the sums of squares of all its groups in one :class:`SumBucket` (one collective
        per process group), then each group finishes with the reduced norms. The updates are freed
        on return."""
        bucket = SumBucket()
        batch = bnb.Batch8bit()
        pending = []
        for _, run in itertools.groupby(work, key=lambda w: id(w[0])):  # each group's consecutive params
            part = list(run)
            group, params, grads = part[0][0], [w[1] for w in part], [w[2] for w in part]
            pending.append(self._queue_group(group, params, grads, bucket, batch))
        # The fp32 moments of the bucket's 8-bit parameters go back to codes, one max-reduction of
        # the absmax per process group for all of them; the batch then lets go of them (they are
        # not needed for the norms' all-reduce).
        batch.store()
        bucket.flush()
        for group, params, updates, steps, sq, parts in pending:
            for index, reduced in parts:
                sq.index_copy_(1, index, reduced)
            scale = _trust_scale(group, sq, steps)
            if params[0].device.type != "cpu":
                scale_(updates, list(scale.to(updates[0].dtype).unbind()))
                torch._foreach_add_(params, updates)
            else:
                # On the CPU a scalar read is no device sync; one fused pass per tensor.
                for p, u, c in zip(params, updates, scale.tolist()):
                    p.add_(u, alpha=c)

    def _queue_group(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        bucket: SumBucket,
        batch: bnb.Batch8bit,
    ) -> tuple[Any, ...]:
        """Moments and updates of ``params`` (of ``group``, with gradients ``grads``); the local
        sums of squares of the parameters held in pieces queued in ``bucket``; the 8-bit moments
        read from ``batch`` (their new fp32 values stored by its ``store``)."""
        eight = [self._start_state(p, batch) for p in params]
        states = [self.state[p] for p in params]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1.0)
        use_foreach = group["foreach"] if group["foreach"] is not None else params[0].device.type != "cpu"
        compute = _updates_foreach if use_foreach else _updates_per_tensor
        plain = [i for i, e in enumerate(eight) if not e]
        moments = [(states[i]["exp_avg"], states[i]["exp_avg_sq"]) for i in plain]
        if len(plain) == len(params):
            updates, sq = compute(params, grads, [m for m, _ in moments], [v for _, v in moments], group)
        else:
            sq = torch.empty((2, len(params)), dtype=torch.float32, device=params[0].device)
            slots: list[torch.Tensor | None] = [None] * len(params)
            if plain:
                ps, gs = [params[i] for i in plain], [grads[i] for i in plain]
                done, plain_sq = compute(ps, gs, [m for m, _ in moments], [v for _, v in moments], group)
                sq[:, plain] = plain_sq.to(sq.device)
                for i, u in zip(plain, done):
                    slots[i] = u
            for i in (i for i, e in enumerate(eight) if e):
                slots[i], sq[:, i] = _update_8bit(params[i], grads[i], states[i], self.layout(params[i]), group, batch)
            updates = [u for u in slots if u is not None]
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

    def _start_state(self, p: torch.Tensor, batch: bnb.Batch8bit) -> bool:
        """Start ``p``'s state at its first step; whether its moments are 8-bit (they are created
        by :func:`_update_8bit`). A state saved with the other ``optim_bits`` is carried over: 32-bit
        moments are quantised at the next step, 8-bit ones dequantised here."""
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
        layout = self.layout(p)
        if self.eight_bit(layout):
            return True
        for entry in STATE.entries:
            if entry.name not in state:
                state[entry.name] = torch.zeros_like(p, memory_format=torch.preserve_format)
            else:
                entry.codec.to_plain(batch, state, entry.name, layout, p.device, p.dtype)
        return False

    def eight_bit(self, layout: ParamLayout) -> bool:
        """Whether a parameter of this layout keeps its moments in 8 bits (``optim_bits``,
        ``min_8bit_size`` of its full tensor)."""
        return codecs.EightBit.of(self).keeps(layout.full_numel)

    def keeps_saved_dtype(self, key: str, value: torch.Tensor) -> bool:
        """8-bit moment codes and their fp32 absmax keep their saved dtype on load (32-bit moments
        take the parameter's, as torch's loader casts them)."""
        return STATE.keeps_saved_dtype(key, value)


#: LAMB's moments, bitsandbytes' 8-bit codes with ``optim_bits=8`` (exp_avg: its signed map).
STATE = codecs.StateSpec((codecs.Entry("exp_avg", codecs.BNB_SIGNED), codecs.Entry("exp_avg_sq", codecs.BNB_UNSIGNED)))


def _update_8bit(
    p: torch.Tensor,
    g: torch.Tensor,
    state: dict[str, Any],
    layout: ParamLayout,
    group: dict[str, Any],
    batch: bnb.Batch8bit,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LAMB's update of one parameter with 8-bit moments, and its local norms ([2]: param, update):
    the moments dequantised and updated in fp32 (float64 for float64 parameters), ``u`` computed
    from them, their new values stored quantised by ``batch.store()`` (as bitsandbytes' 8-bit
    kernels do, the update uses the fp32 moments, not their re-quantised values)."""
    beta1, beta2 = group["betas"]
    acc = accumulation_dtype(p.dtype)
    m, v = (e.codec.read(batch, state, e.name, layout, p, acc) for e in STATE.entries)
    g = g.to(acc)
    m.mul_(beta1).add_(g, alpha=1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    u = v.sqrt().add_(group["eps"])
    torch.div(m, u, out=u)
    if group["weight_decay"] != 0:
        u.add_(p, alpha=group["weight_decay"])
    norms = torch.stack([torch.linalg.vector_norm(p, dtype=acc), torch.linalg.vector_norm(u)]).float()
    return u.to(p.dtype), norms.square_()


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
    return (-group_lr(group) * coef).to(ratio) * ratio


def _updates_foreach(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    group: dict[str, Any],
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Moments, updates and the local sums of squares ([2, n]: params, updates), multi-tensor."""
    beta1, beta2 = group["betas"]
    scale_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta1)
    scale_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denom, group["eps"])
    updates = list(torch._foreach_div(exp_avgs, denom))
    del denom
    if group["weight_decay"] != 0:
        torch._foreach_add_(updates, params, alpha=group["weight_decay"])
    return updates, torch.stack([_norms(params), _norms(updates)]).float().square_()


def _norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's 2-norm accumulated as :func:`_updates_per_tensor` accumulates it: in fp32 for
    low-precision tensors (``_foreach_norm`` without a dtype returns a bf16 norm, rounded before the
    trust ratio), in float64 for float64 ones."""
    acc = {accumulation_dtype(t.dtype) for t in tensors}
    if len(acc) == 1:
        return torch.stack(torch._foreach_norm(tensors, 2, dtype=acc.pop()))
    return torch.stack([torch.linalg.vector_norm(t, dtype=accumulation_dtype(t.dtype)) for t in tensors])


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
        acc = accumulation_dtype(p.dtype)
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

register_entry(
    CatalogueEntry(
        "lamb",
        DistributedLamb,
        recommended={"weight_decay": 0.01},
        transient="bucket_bytes (the local update buffers of one bucket of parameters; default 256 MiB)",
        # The demo shows the swap: ColossalAI's own Lamb, boosted, runs as ours.
        demo=Demo("LAMB (colossalai Lamb -> ours)", 3e-2, "colossalai.nn.optimizer.Lamb"),
    )
)
