"""The Muon optimizer class: the per-step coordination of momenta, owners and the auxiliary AdamW
(the package docstring, :mod:`dist_optim.muon`, states the algorithm and its distribution)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..base import DistOptimizer, check_lr, check_range
from ..checks import group_lr
from ..comm.dtypes import check_communication_dtype
from ..kernels import structured
from ..kernels.dtypes import promote
from ..kernels.multi_tensor import scale_
from ..kernels.newton_schulz import Coefficients, newton_schulz_flops, newton_schulz_many
from ..layout import ParamLayout
from ..sharding.budget import DEFAULT_BUCKET_BYTES, check_bucket_bytes
from ..sharding.owners import Task, WorkGroup
from ..sharding.runtime import OwnedWork, OwnerRuntime, Transport
from ..states import codecs
from .adamw import MOMENTS, adamw_step
from .coefficients import DEFAULT_NS_COEFFICIENTS, check_coefficients, schedule
from .momentum import MOMENTUM, momentum_directions
from .qk_clip import HeadMaxima, LogitSource, check_qk_clip, clip_heads

__all__ = ["DistributedMuon", "DEFAULT_NS_COEFFICIENTS", "ADJUST_LR_FNS", "EPS_FORMS", "adjusted_lr"]

ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
EPS_FORMS = ("max", "add")


def adjusted_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """The step size of the orthogonalized update of a ``rows x cols`` matrix: ``lr *
    sqrt(max(1, rows / cols))`` (None / ``"original"``, Jordan et al.) or ``0.2 * lr *
    sqrt(max(rows, cols))`` (``"match_rms_adamw"``: the update's RMS matches AdamW's, Liu et al.)."""
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * lr * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1.0, rows / cols))


def is_stacked(full_shape: tuple[int, ...], group: dict[str, Any]) -> bool:
    """Whether a tensor of ``full_shape`` in ``group`` is a stack of matrices (``stacked``, 3+ dims)."""
    return bool(group["stacked"]) and len(full_shape) > 2


def _heads(group: dict[str, Any]) -> int:
    """Row blocks each matrix of the group is cut into (1: the whole matrix)."""
    return int(group.get("heads") or 1)


def _matrix_shape(full_shape: tuple[int, ...], group: dict[str, Any]) -> tuple[int, int]:
    """The shape of one matrix of a parameter: ``shape[0] x prod(shape[1:])``, or with
    ``stacked`` (3+ dims) ``shape[1] x prod(shape[2:])`` for each of its ``shape[0]`` slices, or
    with ``heads`` one of its ``heads`` row blocks, ``shape[0] / heads x prod(shape[1:])``."""
    if is_stacked(full_shape, group):
        return full_shape[1], math.prod(full_shape[2:])
    return full_shape[0] // _heads(group), math.prod(full_shape[1:])


def _matrix_boxes(
    full_shape: tuple[int, ...], group: dict[str, Any], heads: int | None = None
) -> list[tuple[tuple[int, int], ...]]:
    """The boxes of the tensor (of ``full_shape``) that are one matrix each: the whole tensor, its
    slices (``stacked``) or its row blocks (``heads`` of them: the group's, or those of a view)."""
    rest = tuple((0, s) for s in full_shape[1:])
    if is_stacked(full_shape, group):
        return [((i, i + 1), *rest) for i in range(full_shape[0])]
    n = _heads(group) if heads is None else heads
    rows = full_shape[0] // n
    return [((h * rows, (h + 1) * rows), *rest) for h in range(n)]


def local_heads(layout: ParamLayout, heads: int) -> int | None:
    """How many of a matrix's ``heads`` row blocks this rank's TP slice holds whole, where its rows
    are split over TP (dim 0, Linear1D_Col's q/k/v) into whole heads; None otherwise. Those heads
    are then orthogonalized from the slice alone: no head crosses the TP group."""
    tp = layout.tp
    if heads <= 1 or tp is None or tp.dim % len(layout.full_shape) != 0 or heads % tp.size:
        return None
    return heads // tp.size


def _schedule(group: dict[str, Any]) -> list[Coefficients]:
    """The per-iteration coefficients of a group (:func:`.coefficients.schedule`)."""
    return schedule(group["ns_coefficients"], int(group["ns_steps"]))


#: Muon's state entries and their codec with ``optim_bits=8``: the momentum and the AdamW moments.
STATE = codecs.StateSpec((MOMENTUM, *MOMENTS))


class DistributedMuon(DistOptimizer):
    """Muon with an auxiliary AdamW, exact under tensor parallelism and ZeRO (module docstring).

    The argument names and defaults are ``torch.optim.Muon``'s (torch >= 2.9): switching is a
    rename.

    Args:
        params: parameters or parameter groups. A group with ``use_muon=False`` is stepped by
            AdamW; every parameter of a Muon group needs at least 2 dims (see
            :func:`muon_param_groups`).
        lr: learning rate (>= 0), of Muon and AdamW groups alike.
        weight_decay: decoupled weight decay (>= 0): ``W <- W (1 - lr * weight_decay)``.
        momentum: in [0, 1).
        nesterov: use ``G + momentum * B`` instead of ``B`` (with ``momentum_ema``, ``G.lerp(B, momentum)``).
        ns_coefficients: ``(a, b, c)`` of the quintic iteration, a list of such triples, one per
            iteration (its length then sets the iterations, ``ns_steps`` is not used), or a named
            schedule of ``ns_steps`` iterations: ``"jordan"`` (the default's), ``"newton_schulz"``,
            ``"polar_express"`` (Amsel et al. 2025; :mod:`.coefficients`).
        eps: floor of the norm that ``C`` is divided by (> 0).
        ns_steps: iterations with a single triple (1 to 100).
        adjust_lr_fn: None / ``"original"`` or ``"match_rms_adamw"`` (see :func:`adjusted_lr`).
        ns_dtype: dtype of the iteration (None: the parameter's; torch's and KellerJordan's Muon
            iterate in bfloat16, so their conversions set ``torch.bfloat16``). On a CPU without
            bf16 instructions (AVX2 only) bf16 products are many times slower than fp32 ones
            (``bench/vs_heavyball.py --only muon``, docs/benchmarks.md): keep None there.
        communication_dtype: dtype in which pieces of ``C`` travel to the owners and the
            orthogonalized pieces back (None: the parameters' dtype; bfloat16 halves the bytes).
        momentum_ema: keep the momentum as an exponential moving average (KellerJordan's and
            torch's implementations) instead of the sum ``momentum * B + G``.
        nesterov_sum: with ``nesterov``, orthogonalize ``G + B``: heavyball's ``nesterov_ema``
            (with ``momentum_ema``; Grokfast's gradient plus its slow average, Lee et al. 2024,
            arXiv:2405.20233), which weighs the average against the gradient differently from
            the interpolation above.
        ns_gram_space: iterate a wide matrix (long side at least twice the short one) in Gram
            space, in every ``ns_dtype`` (Dao AI Lab's Gram Newton-Schulz: fewer flops, somewhat
            less accurate, within the bounds tests/unit/test_muon.py asserts; the other matrices
            then take blockwise symmetric products in bf16/fp16 too; costs and the AMX caveat:
            :func:`dist_optim.kernels.newton_schulz.newton_schulz_gram_space`). Default False: the
            formula (a converted torch or KellerJordan Muon computes exactly what it did).
        stacked: a parameter with 3+ dims is a stack of matrices along its first dim (experts or
            heads stored in one tensor): each ``p[i]``, seen as ``shape[1] x prod(shape[2:])``, is
            orthogonalized on its own (on its own owner rank) with that shape's lr adjustment.
            Default: the whole parameter is one ``shape[0] x prod(shape[1:])`` matrix (a conv
            weight).
        heads: per-head Muon, a param-group option (None: off): each matrix's rows are cut into
            ``heads`` equal blocks (a q_proj's attention heads, a k_proj's or v_proj's key/value
            heads), each orthogonalized on its own with its own shape's lr adjustment, as
            torchtitan's Muon and Megatron-Core's split QKV do (:func:`muon_param_groups` with
            ``per_head=True`` sets it from a model's config). Where TP splits the rows into whole
            heads, each rank orthogonalizes its own heads from its slice: nothing crosses the TP
            group. Not with ``stacked`` 3+-dim parameters.
        eps_form: ``"max"`` (``C / max(||C||, eps)``, torch) or ``"add"`` (``C / (||C|| + eps)``,
            KellerJordan).
        adamw_betas: AdamW's ``(beta1, beta2)`` in ``use_muon=False`` groups.
        adamw_eps: AdamW's epsilon (>= 0).
        optim_bits: 32, or 8 for bitsandbytes' block-wise 8-bit codes (Dettmers et al. 2022,
            arXiv:2110.02861: blocks of 256 values of the full flattened tensor, one fp32 absmax
            each) of the Muon groups' momentum (signed map; :mod:`.momentum`) and of the auxiliary
            AdamW's ``exp_avg`` (signed) and ``exp_avg_sq`` (unsigned; :mod:`.adamw`), as
            bitsandbytes' AdamW8bit: dequantised, updated and used in fp32, stored quantised again.
            The codes equal the single-device ones under any layout (docs/optimizers.md).
        min_8bit_size: with ``optim_bits=8``, tensors with fewer elements (full tensor) keep
            32-bit states (bitsandbytes' default 4096).
        bucket_bytes: the step-memory budget (:mod:`dist_optim.sharding.budget`): the matrices are
            orthogonalized in buckets of consecutive parameters of at most this many bytes of full
            ``C`` (a larger matrix is a bucket of its own), each bucket's ``C`` made, moved to the
            owners, iterated, moved back and applied before the next, so the step's transient
            memory is bounded by the budget, not the model. Default
            :data:`~dist_optim.sharding.budget.DEFAULT_BUCKET_BYTES`; None: every matrix at once (the
            fewest collectives). The result does not depend on it (bit for bit).
        nonfinite: a step with a NaN/Inf gradient ``"raise"`` (default), ``"skip"`` or
            ``"ignore"`` (see :class:`~dist_optim.base.DistOptimizer`).
        qk_clip_tau: QK-clip (MuonClip, Kimi K2; :mod:`dist_optim.muon.qk_clip`; None: off):
            after each step, the ``q_proj``/``k_proj`` rows (any group) of every head whose
            largest logit in the step exceeded this bound are scaled down to it (Kimi K2: 100).
            The logits are measured by :func:`~dist_optim.muon.qk_clip.watch_attention_logits`,
            which the dist_optim booster plugins call at ``booster.boost``.
        qk_clip_alpha: the query's share ``alpha`` of a clipped head's scaling (the report's 0.5).
    """

    _sharded_state = ("momentum_buffer", "exp_avg", "exp_avg_sq")
    _counters_on_param_device = True  # the auxiliary AdamW makes its steps beside the parameter

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: str | Coefficients | Sequence[Coefficients] = DEFAULT_NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        ns_dtype: torch.dtype | None = None,
        communication_dtype: torch.dtype | None = None,
        *,
        momentum_ema: bool = False,
        nesterov_sum: bool = False,
        ns_gram_space: bool = False,
        stacked: bool = False,
        heads: int | None = None,
        eps_form: str = "max",
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-10,
        optim_bits: int = 32,
        min_8bit_size: int = 4096,
        bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
        nonfinite: str = "raise",
        qk_clip_tau: float | None = None,
        qk_clip_alpha: float = 0.5,
    ) -> None:
        check_communication_dtype(communication_dtype)
        check_qk_clip(qk_clip_tau, qk_clip_alpha)
        self.qk_clip_tau = qk_clip_tau
        self.qk_clip_alpha = float(qk_clip_alpha)
        #: The model's attention logits, measured for QK-clip (:func:`watch_attention_logits`).
        self.attention_logits: LogitSource | None = None
        #: Per attention module, the last step's largest logit of each query head of this rank
        #: (``.values``), reduced over the data-parallel ranks: what QK-clip acted on.
        self.last_max_logits: dict[str, HeadMaxima] = {}
        what = "8-bit block-wise momentum and AdamW moments"
        self.optim_bits, self.min_8bit_size = codecs.check_8bit_options(optim_bits, min_8bit_size, what)
        self.communication_dtype = communication_dtype
        self.bucket_bytes = check_bucket_bytes(bucket_bytes)
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            ns_dtype=ns_dtype,
            momentum_ema=momentum_ema,
            nesterov_sum=nesterov_sum,
            ns_gram_space=ns_gram_space,
            stacked=stacked,
            heads=heads,
            eps_form=eps_form,
            adamw_betas=tuple(adamw_betas) if isinstance(adamw_betas, (tuple, list)) else adamw_betas,
            adamw_eps=adamw_eps,
            use_muon=True,
            **self._variant_defaults(),
        )
        self.owner_runtime = OwnerRuntime()  # who orthogonalizes each matrix, and the step's exchanges
        self._view_heads: dict[torch.Tensor, int] = {}  # heads of the tensor each task sees (_ensure_tasks)
        self._checked = False
        super().__init__(params, defaults, nonfinite=nonfinite)

    def _variant_defaults(self) -> dict[str, Any]:
        """Group options a variant adds to Muon's (:class:`~dist_optim.muon.DistributedNorMuon`)."""
        return {}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self.owner_runtime.forget()
        self._checked = False

    def validate_group(self, group: dict[str, Any]) -> None:
        """ValueError/TypeError naming the option for anything out of range in a param group."""
        super().validate_group(group)
        codecs.refuse_group_8bit_options(group, type(self).__name__)
        use_muon = group.get("use_muon", True)
        if not isinstance(use_muon, bool):
            raise TypeError(f"use_muon must be True or False, got {use_muon!r}")
        check_lr(group["lr"])
        check_range("weight_decay", group["weight_decay"], 0.0)
        check_range("momentum", group["momentum"], 0.0, 1.0)
        check_range("eps", group["eps"], 0.0, open_low=True)
        for flag in ("nesterov", "momentum_ema", "nesterov_sum", "ns_gram_space", "stacked"):
            if not isinstance(group[flag], bool):
                raise TypeError(f"{flag} must be True or False, got {group[flag]!r}")
        heads = group.get("heads")
        if heads is not None and (not isinstance(heads, int) or isinstance(heads, bool) or heads < 1):
            raise ValueError(f"heads must be None or a positive integer (row blocks per matrix), got {heads!r}")
        steps = group["ns_steps"]
        if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= 100:
            raise ValueError(f"ns_steps must be an integer in [1, 100], got {steps!r}")
        check_coefficients(group["ns_coefficients"])
        if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
            raise ValueError(
                f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {group['adjust_lr_fn']!r}"
            )
        dtype = group["ns_dtype"]
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise ValueError(f"ns_dtype must be None or a floating torch.dtype (e.g. torch.bfloat16), got {dtype!r}")
        if group["eps_form"] not in EPS_FORMS:
            raise ValueError(f"eps_form must be 'max' or 'add', got {group['eps_form']!r}")
        betas = group["adamw_betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"adamw_betas must be a pair (beta1, beta2), got {betas!r}")
        check_range("adamw_betas[0]", betas[0], 0.0, 1.0)
        check_range("adamw_betas[1]", betas[1], 0.0, 1.0)
        check_range("adamw_eps", group["adamw_eps"], 0.0)

    # ---- binding and planning ---------------------------------------------------------------
    def _on_bind(self) -> None:
        self._checked = False
        self._check_matrices()
        # Under TP the matrices are split over the TP x data-parallel grid: every rank of it can
        # own a matrix, not only one TP rank's data-parallel group. Collective over the job.
        self.owner_runtime.bind([self.layout(p) for p in self._muon_params()], self.dp_group, self.tp_group)

    def _muon_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups if g["use_muon"] for p in g["params"]]

    def _check_matrices(self) -> None:
        """Every parameter of a Muon group must be a matrix (or more dims): by its layout's full
        shape, since under ZeRO the optimizer holds flat chunks."""
        if self._checked:
            return
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            for p in group["params"]:
                shape = self.layout(p).full_shape
                if len(shape) < 2:
                    raise ValueError(
                        f"DistributedMuon: {self.param_label(p)} has shape {tuple(shape)}, but Muon orthogonalizes "
                        "matrices: put parameters with fewer than 2 dims (biases, norms) in a param group with "
                        "use_muon=False (AdamW); dist_optim.muon_param_groups(model) builds the usual split"
                    )
                heads = _heads(group)
                if heads > 1 and (is_stacked(shape, group) or shape[0] % heads):
                    why = "is a stack of matrices (stacked=True)" if is_stacked(shape, group) else "rows"
                    raise ValueError(
                        f"DistributedMuon: heads={heads} for {self.param_label(p)} of shape {tuple(shape)}, whose "
                        f"{shape[0]} {why}: give its group a heads that divides its rows, or heads=None"
                    )
        self._checked = True

    def _ensure_tasks(self) -> dict[torch.Tensor, Task]:
        """Each Muon parameter's owner :class:`~dist_optim.sharding.owners.Task`: its matrices
        (:func:`_matrix_boxes`) owned in its work group, balancing the iteration's cost
        (:func:`newton_schulz_flops`, with the products' forms on the parameters' device). The
        iteration's dtype is the group's ``ns_dtype`` or the parameter's, the same on every rank of
        the work group, so every rank computes the same owners."""
        if self.owner_runtime.tasks:
            return self.owner_runtime.tasks
        groups = {p: g for g in self.param_groups for p in g["params"]}
        specs = []
        params = self._muon_params()
        self._view_heads = {}
        works: list[WorkGroup | None] = []
        for p in params:
            group, layout = groups[p], self.layout(p)
            m, n = _matrix_shape(layout.full_shape, group)
            here = local_heads(layout, _heads(group))
            works.append(None if here is None else self.owner_runtime.slice_work_of(layout))
            if here is not None:
                # Whole heads in this TP slice: the slice is the tensor its tasks see, over the
                # data-parallel ranks that share it (its ZeRO chunks, or DDP's replicas).
                layout = ParamLayout(layout.local_shape, None, layout.zero)
            self._view_heads[p] = _heads(group) if here is None else here
            boxes = _matrix_boxes(layout.full_shape, group, self._view_heads[p])
            dtype = group["ns_dtype"] or p.dtype
            steps, gram_space = len(_schedule(group)), group["ns_gram_space"]
            flops = newton_schulz_flops(m, n, steps, dtype, gram_space, structured.blocked(p))
            specs.append((layout, layout.full_shape, boxes, [flops] * len(boxes)))
        self.owner_runtime.plan(params, specs, works)
        return self.owner_runtime.tasks

    # ---- the step ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self._begin_step(closure)
        if not self._gradients_ok():
            if self.attention_logits is not None:
                self.attention_logits.reset()  # the skipped batch's logits do not count
            return loss
        self._check_matrices()
        matrices: list[tuple[dict[str, Any], torch.Tensor, torch.Tensor]] = []
        for group in self.param_groups:
            params, grads = self._grads(group)
            if not params:
                continue
            if group["use_muon"]:
                matrices += [(group, p, g) for p, g in zip(params, grads)]
            else:
                layouts = [self.layout(p) for p in params]
                adamw_step(self.state, group, params, grads, layouts, self.eight_bit, self.bucket_bytes)
        tasks = self._ensure_tasks()
        # The next bucket's C travels to its owners while this one's owners iterate.
        self.owner_runtime.run(
            matrices,
            [self.layout(p).full_numel * g.element_size() for _, p, g in matrices],
            lambda bucket: self._prepare(bucket, tasks),
            self._compute,
            self._deliver,
            comm_dtype=self.communication_dtype,
            budget=self.bucket_bytes,
        )
        if self.qk_clip_tau is not None and (matrices or self._all_grads()[0]):
            self.clip_qk()  # not on a step without gradients, which moves nothing (torch's contract)
        return loss

    def clip_qk(self) -> None:
        """QK-clip after the update (:func:`~dist_optim.muon.qk_clip.clip_heads`); off at tau None."""
        if self.qk_clip_tau is None:
            return
        if self.attention_logits is None:
            raise RuntimeError(
                "DistributedMuon(qk_clip_tau=...) clips by the attention logits of the step's forwards, which nothing "
                "measures: call dist_optim.watch_attention_logits(model, optimizer) once (the dist_optim booster "
                "plugins do at boost)"
            )
        taken = self.attention_logits.take()
        clip_heads(self, taken, float(self.qk_clip_tau), self.qk_clip_alpha, self.attention_logits.sequence_group)
        self.last_max_logits = taken

    def _prepare(
        self, bucket: Sequence[tuple[dict[str, Any], torch.Tensor, torch.Tensor]], tasks: dict[torch.Tensor, Task]
    ) -> list[OwnedWork[tuple[dict[str, Any], torch.Tensor]]]:
        """A bucket's ``C``, the input of its matrices' tasks (made per bucket: with Nesterov each is
        a new tensor, so all of them at once would hold a second copy of the momenta)."""
        cs = momentum_directions(self.state, [(group, p, g, self.layout(p)) for group, p, g in bucket], self.eight_bit)
        return [OwnedWork((group, p), tasks[p], [c], c.dtype) for (group, p, _), c in zip(bucket, cs)]

    def _compute(self, works: list[OwnedWork[tuple[dict[str, Any], torch.Tensor]]]) -> None:
        """X of the matrices this rank owns: a parameter held by this rank alone at once, whole."""
        jobs: list[tuple[torch.Tensor, dict[str, Any], bool, int]] = []
        into: list[tuple[OwnedWork[Any], int | None]] = []
        for w in works:
            group, p = w.entry
            if w.transport == Transport.HERE:
                jobs.append((w.inputs[0].reshape(w.layout.full_shape), group, False, self._view_heads[p]))
                into.append((w, None))
                continue
            for b, (c_box,) in w.owned.items():
                jobs.append((c_box, group, w.copies, 1))
                into.append((w, b))
        for (w, box), result in zip(into, self._orthogonalize_all(jobs)):
            if box is None:
                w.whole = self._finish_owned(w, None, result)
            else:
                w.results[box] = self._finish_owned(w, box, result)

    def _finish_owned(self, work: OwnedWork[Any], box: int | None, x: torch.Tensor) -> torch.Tensor:
        """The update of an owned box (``box`` None: of the whole tensor, every box) from its
        orthogonalized ``x``: ``x`` itself. A variant that rescales it on the owner overrides this."""
        return x

    def _deliver(self, works: list[OwnedWork[tuple[dict[str, Any], torch.Tensor]]]) -> None:
        _apply_all([(p, w.local().view_as(p), self.layout(p), group) for w in works for group, p in [w.entry]])

    def eight_bit(self, layout: ParamLayout) -> bool:
        """Whether a parameter of this layout keeps its momentum (Muon) or moments (AdamW) in 8 bits
        (``optim_bits``, ``min_8bit_size`` of its full tensor)."""
        return codecs.EightBit.of(self).keeps(layout.full_numel)

    def keeps_saved_dtype(self, key: str, value: torch.Tensor) -> bool:
        """8-bit codes (momentum, AdamW moments) and their fp32 absmax keep their saved dtype on load."""
        return STATE.keeps_saved_dtype(key, value)

    @staticmethod
    def _orthogonalize_all(jobs: Sequence[tuple[torch.Tensor, dict[str, Any], bool, int]]) -> list[torch.Tensor]:
        """X of each job's ``c`` (in ``c``'s shape): a whole parameter's C, or with ``stacked`` a
        slice of one or all its slices (each its own matrix), or its ``row_blocks`` heads (each its
        own matrix; 1 for one head's box); ``overwrite``: ``c`` is scratch (a block received by its
        owner) that the iteration may work in. The matrices of one param
        group go to :func:`~dist_optim.kernels.newton_schulz.newton_schulz_many` together, which on a GPU
        iterates those of one shape as one batch (the step's launches, not its flops, bind a GPU
        on small matrices), and on the CPU in bfloat16 (faster batched products there:
        :data:`~dist_optim.kernels.newton_schulz.CPU_BATCHED_DTYPES`); otherwise each is
        :func:`~dist_optim.kernels.newton_schulz.newton_schulz`, bit for bit."""
        calls: dict[tuple[int, bool], tuple[dict[str, Any], list[tuple[int, int]], list[torch.Tensor]]] = {}
        pieces: list[list[torch.Tensor]] = []
        for j, (c, group, overwrite, row_blocks) in enumerate(jobs):
            shape = tuple(c.shape)
            stacked = is_stacked(shape, group)
            mats = [s.reshape(shape[1], -1) for s in c] if stacked else list(c.reshape(shape[0], -1).chunk(row_blocks))
            _, where, todo = calls.setdefault((id(group), overwrite and not stacked), (group, [], []))
            where += [(j, k) for k in range(len(mats))]
            todo += mats
            pieces.append(mats)
        for (_, overwrite), (group, where, todo) in calls.items():
            options = (_schedule(group), group["eps"], group["eps_form"], group["ns_dtype"], group["ns_gram_space"])
            for (j, k), x in zip(where, newton_schulz_many(todo, *options, overwrite=overwrite)):
                pieces[j][k] = x
        out = []
        for (c, group, _, _), mats in zip(jobs, pieces):
            shape = tuple(c.shape)
            whole = torch.stack(mats) if is_stacked(shape, group) else mats[0] if len(mats) == 1 else torch.cat(mats)
            out.append(whole.reshape(shape))
        return out

    # ---- owners -------------------------------------------------------------------------------
    def owners_of(self, param: torch.Tensor) -> list[int]:
        """The rank (in its work group) that orthogonalizes each of ``param``'s matrices."""
        return list(self._ensure_tasks()[param].owners)

    def work_group_rank(self, param: torch.Tensor) -> int:
        """This rank's rank in ``param``'s work group (0 when it has one rank)."""
        return self._ensure_tasks()[param].work.rank


def _apply_all(items: Sequence[tuple[torch.Tensor, torch.Tensor, ParamLayout, dict[str, Any]]]) -> None:
    """Each ``(param, update, layout, group)``: decoupled weight decay, then ``-adjusted_lr``
    times the update, by ``torch._foreach_*`` over the parameters of one factor and step size (a
    launch per few parameters on a GPU; on the CPU the per-tensor kernels, bit for bit; the decay
    by :func:`dist_optim.kernels.multi_tensor.scale_`, per tensor in bf16/fp16). An update in a
    narrower dtype (a bfloat16 iteration's) is added by type promotion, exactly as converted
    first; a wider one (an fp32 iteration of bfloat16 parameters) is rounded to the parameter's
    dtype first, as before."""
    decays: dict[float, list[torch.Tensor]] = {}
    steps: dict[float, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for p, update, layout, group in items:
        m, n = _matrix_shape(layout.full_shape, group)
        lr = group_lr(group)
        if group["weight_decay"] != 0:
            decays.setdefault(1.0 - lr * group["weight_decay"], []).append(p)
        params, updates = steps.setdefault(-adjusted_lr(lr, group["adjust_lr_fn"], m, n), ([], []))
        params.append(p)
        updates.append(update if promote(update.dtype, p.dtype) == p.dtype else update.to(p.dtype))
    for factor, params in decays.items():
        scale_(params, factor)
    for alpha, (params, updates) in steps.items():
        torch._foreach_add_(params, updates, alpha=alpha)
