"""The optimizer class: a coordinator of the package's parts (see :mod:`dist_optim.shampoo`).

A step is one run of the owner runtime (:mod:`dist_optim.sharding.runtime`): each parameter's step counted
and its gradient declared as the input of its blocks' task (:mod:`.owners`); the owners compute
their blocks' directions (:mod:`.work`, :mod:`.preconditioner` on the typed
:class:`~.state.BlockState` views of ``optimizer.state``); each holder applies its part of them
(:mod:`.update`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..base import DistOptimizer
from ..sharding.budget import DEFAULT_BUCKET_BYTES, check_bucket_bytes
from ..sharding.owners import Owner, share_results
from ..sharding.runtime import OwnedWork, OwnerRuntime, Transport
from ..states import bnb, codecs
from .blocking import Block
from .momentum import keeps_8bit_momentum, momentum_buffer, read_momenta
from .options import GROUP_OPTIONS, GraftingConfig, check_communication, group_defaults, validate_options
from .owners import BlockPlan, plan_block_owners, total_failures
from .preconditioner import heavyball
from .state import (
    STATE,
    BlockState,
    Scratch,
    block_prefix,
    carry_over,
    check_loaded_forms,
    checked_block_entries,
    full_block_entries,
    initial_state,
    keeps_saved_dtype,
    mirror_whole_factors,
    non_block_entries,
)
from .update import apply_update, apply_updates, whole_views
from .work import BlockWork
from .work import run as run_work

__all__ = ["DistributedShampoo"]


class DistributedShampoo(DistOptimizer):
    """Shampoo / SOAP with blocking, grafting and amortised roots (see the package docstring).

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        betas: ``(b1, b2)``: first-moment EMA in [0, 1), factor EMA in (0, 1] (1: plain sum).
        epsilon: damping added to the factors (Shampoo) or to ``sqrt`` of the second moment (SOAP).
        momentum: heavy-ball momentum on the search direction (0 = off).
        weight_decay: L2 (``use_decoupled_weight_decay=False``) or AdamW-style decay.
        max_preconditioner_dim: largest block side.
        precondition_frequency: steps between root / basis refreshes.
        start_preconditioning_step: first step that uses the preconditioner (default:
            ``precondition_frequency``; 0 and 1 both mean the first step).
        use_nesterov: Nesterov momentum.
        use_bias_correction: bias-correct the first moment and the factors.
        use_decoupled_weight_decay: AdamW-style decay.
        grafting_config: one of the ``*GraftingConfig`` classes, or None (known to diverge at the
            default ``epsilon`` on a small language model: use ``AdamGraftingConfig(beta2=0.999,
            epsilon=1e-8)`` as the recipe does, or a larger ``epsilon``; docs/convergence.md).
        root_inverse: ``"eigh"``, ``"coupled_newton"``, ``"higher_order"`` or ``"warm"`` (from the
            previous eigenvectors, kept as ``basis<k>``: see the package docstring).
        eigenvalue_correction: SOAP.
        eigenbasis: SOAP basis refresh: ``"eigh"``, ``"eigh-ascending"`` (Meta's ``eigh`` basis),
            ``"qr"`` (Meta's ``DefaultSOAPConfig``), ``"qr-eigh-start"`` (Vyas et al.'s),
            ``"qr-lifted"`` (heavyball's: one power step on the factor lifted by ``epsilon`` times its
            largest estimated eigenvalue, :func:`~dist_optim.kernels.matrix_functions.lifted_qr_step`,
            after ``eigh`` at the first) or ``"warm"``; see the package docstring.
        refresh_tolerance: ``"warm"`` keeps the eigenvectors ``Q`` while ``||B - diag(B)||_F <=
            refresh_tolerance ||B||_F``, ``B = Q^T A Q`` (in [0, 1]; 0: always recompute).
        refresh_iterations: ``"warm"``'s QR-algorithm steps before ``eigh`` (default 0: keep or
            recompute; why: docs/benchmarks.md).
        use_symmetric_packing: keep factors and roots as packed triangles (about half their
            memory; bit for bit the same steps; :mod:`.state`). Meta's option of the same name.
        optim_bits, min_8bit_size: 8: blocks of at least ``min_8bit_size`` elements keep moments and grafting
            state as bitsandbytes' 8-bit codes (Shampoo's first moment only with grafting: :func:`.state.keeps_8bit`).
            Group options, as all of Shampoo's: these are the defaults (``self.optim_bits``), a group
            may set its own; both checked by :func:`dist_optim.states.codecs.check_8bit_options`.
        preconditioner_bits: 8 or 4: eigenvectors (roots: with fp32 eigenvalues; SOAP's bases)
            block-wise quantised, rectified when used (Wang et al. 2024; :mod:`.state`).
        kl_statistics: KL-Shampoo (Lin et al. 2025, arXiv:2509.03378; Meta's
            ``RootInvKLShampooPreconditionerConfig``): each factor's statistics from the gradient
            preconditioned along the other dims by their current roots, ``L_k <- b2 L_k + (1 - b2)
            G~_(k) G~_(k)^T`` with ``G~ = G x_{j != k} R_j`` (the identity before the first refresh);
            Shampoo's direction otherwise. With ``eigenvalue_correction``, KL-SOAP: the other dims
            whitened by their factors' inverses in SOAP's basis, eigenvalues estimated there
            (:func:`.preconditioner.factors.kl_soap_whiteners`); SOAP's direction otherwise. Not
            with quantised roots or bases.
        merge_small_dims: merge small consecutive dims before blocking (True: Anil et al.'s rule;
            ``"trailing"``: heavyball's, the first dim kept and the others merged from the last,
            :func:`~dist_optim.shampoo.blocking.merge_trailing_dims`).
        shampoo_beta: the factors' EMA coefficient (Vyas et al.'s name; None: ``betas[1]``, which
            otherwise serves both the factors and SOAP's second moment).
        soap_step: ``"default"`` or ``"heavyball"``: heavyball's SOAP step (``heavyball.SOAP`` and
            ``KLSOAP``, Vyas et al.'s order, :mod:`~dist_optim.shampoo.preconditioner.heavyball`):
            a parameter's first step only seeds its factors and bases (the parameter is not
            updated); later ones take Adam's direction in the bases of the previous step, then
            update the factors and refresh the bases; moments and factors are bias-corrected
            averages counted in the optimizer's steps (a step without a gradient counts),
            ``epsilon`` floors ``sqrt(S)``, and the bases are refreshed when the running sum of
            ``1 / precondition_frequency`` passes an integer (``start_preconditioning_step`` is
            not read). Needs ``eigenvalue_correction``, no grafting, whole factors and bases.
        precondition_1d: precondition 1-D (merged) tensors with a full-matrix factor (default);
            False: Adam in the identity basis (SOAP) or the grafting direction for them (Vyas et
            al.'s and heavyball's option of the same name, off by default there).
        exponent_override: root ``r`` for every factor (0: ``2 * order``).
        exponent_multiplier: roots are ``A^(-exponent_multiplier / r)`` (eigh only).
        preconditioner_dtype: dtype of factors, roots and bases (float32 or float64).
        communication_dtype: dtype of the gradient gather and direction sharing (float32, bfloat16,
            float16).
        statistics_compute_steps: update the factors every this many steps (Anil et al.).
        skip_preconditioning_dim_size_gt: parameters with a dim above this use grafting only.
        inverse_failure_threshold: an iterative root with error above this counts as failed.
        higher_order_degree: order of the ``"higher_order"`` iteration (>= 3; 2 would be Newton).
        max_gather_bytes: the old name of ``bucket_bytes`` (a value given here is used as
            ``bucket_bytes``, with a ``FutureWarning``).
        bucket_bytes: the step-memory budget (:mod:`dist_optim.sharding.budget`): when bound, move and
            finish the parameters in buckets of at most this many bytes of full gradients (a
            parameter larger than that is its own bucket), one bucket after the other: caps the
            transient memory of gathered full gradients, of the owners' block gradients and of
            the exchange buffers, at the cost of collectives per bucket. An owner's blocks are
            computed in batches of at most this many bytes of gradients (one element-wise call
            per batch, :mod:`.work`; bound or not), which also bounds the reused scratch of a
            batch's directions. Default
            :data:`~dist_optim.sharding.budget.DEFAULT_BUCKET_BYTES`; None: all parameters at once, the
            fewest collectives. The result does not depend on it (bit for bit). Gradients are
            checked for NaN/Inf on the local pieces before any bucket moves (``nonfinite``).
        nonfinite: a step with a NaN/Inf gradient ``"raise"`` (default), ``"skip"`` or
            ``"ignore"`` (see :class:`~dist_optim.base.DistOptimizer`).
    """

    _sharded_state = ("momentum_buffer",)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        betas: tuple[float, float] = (0.9, 0.999),
        epsilon: float = 1e-12,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        max_preconditioner_dim: int = 1024,
        precondition_frequency: int = 1,
        start_preconditioning_step: int | None = None,
        use_nesterov: bool = False,
        use_bias_correction: bool = True,
        use_decoupled_weight_decay: bool = True,
        grafting_config: GraftingConfig | None = None,
        root_inverse: str = "eigh",
        eigenvalue_correction: bool = False,
        eigenbasis: str = "eigh",
        merge_small_dims: bool = False,
        exponent_override: float = 0,
        exponent_multiplier: float = 1.0,
        preconditioner_dtype: torch.dtype = torch.float32,
        communication_dtype: torch.dtype = torch.float32,
        statistics_compute_steps: int = 1,
        skip_preconditioning_dim_size_gt: int | None = None,
        inverse_failure_threshold: float = 0.1,
        higher_order_degree: int = 3,
        max_gather_bytes: int | None = None,
        *,
        refresh_tolerance: float = 0.01,
        refresh_iterations: int = 0,
        use_symmetric_packing: bool = False,
        optim_bits: int = 32,
        min_8bit_size: int = 4096,
        preconditioner_bits: int = 32,
        kl_statistics: bool = False,
        shampoo_beta: float | None = None,
        soap_step: str = "default",
        precondition_1d: bool = True,
        bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
        nonfinite: str = "raise",
    ) -> None:
        defaults = group_defaults(**{k: v for k, v in locals().items() if k in GROUP_OPTIONS})
        #: The constructor's ``optim_bits`` / ``min_8bit_size`` (every group's unless it sets its own).
        self.optim_bits, self.min_8bit_size = optim_bits, min_8bit_size
        self.communication_dtype = communication_dtype
        if max_gather_bytes is not None:
            warnings.warn(
                f"DistributedShampoo: max_gather_bytes={max_gather_bytes!r} is the old name of bucket_bytes; "
                "pass bucket_bytes instead (the value is used as bucket_bytes)",
                FutureWarning,
                stacklevel=2,
            )
            bucket_bytes = max_gather_bytes
        self.bucket_bytes = check_bucket_bytes(bucket_bytes)
        self._plans: dict[torch.Tensor, BlockPlan] = {}
        self.owner_runtime = OwnerRuntime()  # who computes each block, and the step's exchanges
        self._scratch = Scratch()  # one block's direction, reused across blocks applied as soon as computed
        #: Steps taken (every ``step`` call that was not skipped): ``soap_step="heavyball"``'s count.
        self.steps_taken = 0
        self._stepping: set[int] = set()  # this step's groups with a non-seeding parameter (heavyball's step)
        super().__init__(params, defaults, nonfinite=nonfinite)  # validate_group checks every group
        check_communication(communication_dtype)

    def validate_group(self, group: dict[str, Any]) -> None:
        super().validate_group(group)
        validate_options(group)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._plans = {}

    def _on_bind(self) -> None:
        self._plans = {}
        # Under TP the blocks are split over the TP x data-parallel grid, not over each TP
        # rank's data-parallel group alone: every rank of the grid gathers the same full
        # gradients, so a TP rank need not repeat its TP peers' blocks. Collective over the job.
        self.owner_runtime.bind([self.layout(p) for p in self._all_params()], self.dp_group, self.tp_group)
        self._ensure_plans()

    # ---- planning (see owners.py) -----------------------------------------------------------
    def _ensure_plans(self) -> None:
        if self._plans:
            return
        params = self._all_params()
        groups = [g for g in self.param_groups for _ in g["params"]]
        specs = [(self.layout(p), g) for p, g in zip(params, groups)]
        self._plans = dict(zip(params, plan_block_owners(self.owner_runtime, params, specs)))

    # ---- the step ------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self._begin_step(closure)
        if not self._gradients_ok():
            return loss
        self.steps_taken += 1
        self._ensure_plans()
        entries = [(group, p, g) for group in self.param_groups for p, g in zip(*self._grads(group))]
        # heavyball's SOAP step: a parameter's first step seeds; heavyball's stacked kernels give it a
        # zero update (decay only) where another parameter of its group takes a real step.
        self._stepping = {
            id(group)
            for group, p, _ in entries
            if group["soap_step"] == "heavyball" and self.state.get(p, {}).get("step", 0) >= 1
        }
        # No rank sees every full gradient (gradient pieces go to block owners, or full gradients
        # are gathered in buckets of at most bucket_bytes), the next bucket's pieces travelling
        # while this one computes; _gradients_ok checked the local pieces of all of them before
        # the first one moved.
        self.owner_runtime.run(
            entries,
            [self.layout(p).full_numel * g.element_size() for _, p, g in entries],
            self._prepare,
            self._compute,
            self._deliver,
            comm_dtype=self.communication_dtype if self.is_bound else None,
            budget=self.bucket_bytes,
        )
        return loss

    def _prepare(self, bucket: Sequence[tuple[dict[str, Any], torch.Tensor, torch.Tensor]]) -> list[OwnedWork[_Entry]]:
        """A bucket's step counters and its gradients (coupled weight decay added: made per bucket,
        so that the copies stay within the budget) as the inputs of its blocks' tasks."""
        works = []
        for group, p, g in bucket:
            state = self.state[p]
            if not state:
                self._init_state(p, group, g.dtype)
            state["step"] += 1
            wd = group["weight_decay"]
            if wd != 0 and not group["use_decoupled_weight_decay"]:
                g = g + p.detach() * wd  # elementwise: the same bits on a shard as on the full tensor
            plan = self._plans[p]
            t = int(state["step"])
            if group["soap_step"] == "heavyball":
                t = heavyball.step_count(t, self.steps_taken)
            entry = _Entry(group, p, state, t, plan, decays=id(group) in self._stepping)
            works.append(OwnedWork(entry, plan.task, [g.detach()], g.dtype))
        momenta = read_momenta(self.state, [(group, p) for group, p, _ in bucket], self.layout)
        for w in works:
            w.entry.momenta = momenta
        return works

    def _compute(self, works: list[OwnedWork[_Entry]]) -> None:
        """The directions of the blocks this rank owns (:func:`.work.run`, batch by batch): a
        parameter held whole by this rank alone is updated block by block through reused scratch
        memory (fresh block-sized tensors cost page faults on the CPU comparable to the arithmetic
        of the update); every other block's direction is its result."""
        block_works = []
        for w in works:
            e = w.entry
            whole = self._whole_views(e) if w.transport == Transport.HERE else None
            for i, (g,) in w.owned.items():
                block = e.plan.blocks[i]
                if whole is not None:
                    pv, bv = whole
                    buf = None if bv is None else bv[block.slices]
                    block_works.append(BlockWork(e.state, i, block, g, e.group, e.t, param=pv[block.slices], buf=buf))
                    continue
                w.results[i] = torch.empty(block.shape, dtype=g.dtype, device=g.device)
                block_works.append(BlockWork(e.state, i, block, g, e.group, e.t, out=w.results[i]))
        self._run_work(block_works)

    def _deliver(self, works: list[OwnedWork[_Entry]]) -> None:
        """Every rank applies its part of the directions (this step's own tensors, updated in
        place); a parameter held whole takes them block by block, without assembling a
        parameter-sized direction."""
        for w in works:
            e = w.entry
            if e.seeds:  # no direction; heavyball's zero update where its group steps
                if e.decays:
                    apply_update(e.p.detach(), torch.zeros_like(e.p), momentum_buffer(e.momenta, e.state), e.group)
                continue
            if not w.delivered:
                continue
            buf = momentum_buffer(e.momenta, e.state)
            whole = None if w.transport == Transport.ROUTED else self._whole_views(e)
            if whole is not None:
                pv, bv = whole
                bufs = [None if bv is None else bv[b.slices] for b in e.plan.blocks]
                apply_updates([pv[b.slices] for b in e.plan.blocks], w.boxes, bufs, e.group)
            else:
                apply_update(e.p.detach(), w.local().to(e.p.dtype).view_as(e.p), buf, e.group)
        for momenta in {id(w.entry.momenta): w.entry.momenta for w in works}.values():
            momenta.store()

    def _run_work(self, works: list[BlockWork]) -> None:
        """:func:`.work.run` of this step's ``works`` (their directions in their ``out``, or applied)."""
        run_work(works, self._scratch, self.bucket_bytes)

    def _whole_views(self, e: _Entry) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        buf = momentum_buffer(e.momenta, e.state)
        return whole_views(e.p, self.layout(e.p).is_local, buf, e.plan.view_shape)

    def _init_state(self, p: torch.Tensor, group: dict[str, Any], dtype: torch.dtype) -> None:
        """``step``, ``momentum_buffer`` and the state of the blocks this rank owns, in flat form."""
        plan, eight = self._plans[p], keeps_8bit_momentum(group, self.layout(p))
        owned = [plan.owner(i).mine for i in range(len(plan.blocks))]
        self.state[p].update(initial_state(p, group, dtype, plan.blocks, owned, eight))

    def _block_states(self) -> Iterable[tuple[torch.Tensor, Block, BlockState]]:
        """Every parameter's blocks that this rank holds state of, with their typed state."""
        self._ensure_plans()
        for p, state in self.state.items():
            plan = self._plans.get(p)
            for i, block in enumerate(plan.blocks if plan is not None else []):
                yield p, block, BlockState.of(state, block_prefix(i), block.order)

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, with every factor matrix made symmetric first."""
        mirror_whole_factors(self._block_states())
        return super().state_dict()

    def full_state(self) -> list[dict[str, Any]]:
        """Every parameter's state in full form (block state gathered from the owners), in
        ``param_groups`` order; the same on every rank. Collective when bound."""
        mirror_whole_factors(self._block_states())
        params = [(g, p) for g in self.param_groups for p in g["params"]]
        for group, p in params:  # moments loaded with the other optim_bits and no step since
            _carry_over_owned(self.state.get(p), self._plans.get(p), group, p)
        out = super().full_state()
        shares: list[tuple[Owner, list[torch.Tensor]]] = []
        for entry, (group, p) in zip(out, params):
            state = self.state.get(p)
            if not state:
                continue
            plan, dtype = self._plans[p], _moments_dtype(state, p)
            for b, block in enumerate(plan.blocks):
                tensors = full_block_entries(state, b, block, group, dtype, plan.owner(b).mine, p.device)
                entry.update(tensors)
                shares.append((plan.owner(b), list(tensors.values())))
        share_results(shares)  # state: in the widest dtype of each work group's tensors, not rounded
        return out

    def keeps_saved_dtype(self, key: str, value: torch.Tensor) -> bool:
        """Block state kept in ``preconditioner_dtype`` (e.g. float64 factors of fp32 params), the
        failure counters and 8-bit codes and their absmax keep their saved dtype on load
        (:func:`state.keeps_saved_dtype`)."""
        return keeps_saved_dtype(key) or STATE.keeps_saved_dtype(key, value)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The base's loader, after :func:`.state.check_loaded_forms`; block owners are planned again."""
        check_loaded_forms(state_dict, self.param_groups)
        super().load_state_dict(state_dict)
        self._plans = {}

    def _localize_state(self, param: torch.Tensor, state: dict[str, Any]) -> dict[str, Any]:
        """Keep the blocks this rank owns of a full-form state (:meth:`load_full_state`), after
        checking that every owned block has all its entries with the shapes this optimizer's
        blocking gives (a checkpoint saved with other blocking options is refused)."""
        self._ensure_plans()
        plan = self._plans[param]
        group = next(g for g in self.param_groups if any(q is param for q in g["params"]))
        out = non_block_entries(state)
        for b, block in enumerate(plan.blocks):
            if plan.owner(b).mine:
                out.update(checked_block_entries(state, b, block, group, param, plan.full_shape))
        return out

    def state_bytes(self) -> dict[str, int]:
        """Bytes of optimizer state held by this rank: ``preconditioner`` (factors, roots, bases)
        and ``other`` (moments, grafting state, momentum)."""
        total = sum(_nbytes(v) for state in self.state.values() for v in state.values() if isinstance(v, torch.Tensor))
        matrices = sum(_nbytes(m) for _, _, bs in self._block_states() for m in bs.matrices)
        return {"preconditioner": matrices, "other": total - matrices}

    def extra_state(self) -> dict[str, Any]:
        """The base's counters and :attr:`steps_taken` (``soap_step="heavyball"`` counts by it)."""
        return {**super().extra_state(), "steps_taken": self.steps_taken}

    def load_extra_state(self, extra: dict[str, Any]) -> None:
        super().load_extra_state(extra)
        self.steps_taken = int(extra.get("steps_taken", 0))

    def root_failures(self) -> int:
        """Failed root inverses / basis refreshes so far, over all blocks (collective when bound)."""
        self._ensure_plans()
        failures = [(self._plans[p], bs.failures) for p, _, bs in self._block_states() if bs.failures is not None]
        device = next(iter(self._plans)).device if self._plans else torch.device("cpu")
        return total_failures(list(self._plans.values()), failures, device)


@dataclass(eq=False)
class _Entry:
    """A parameter's record in a step: its group, the parameter, its state and step, its plan, and
    the momentum buffers of its bucket (read as fp32 values where 8-bit, stored after the update)."""

    group: dict[str, Any]
    p: torch.Tensor
    state: dict[str, Any]
    t: int
    plan: BlockPlan
    momenta: bnb.Batch8bit = field(default_factory=bnb.Batch8bit)
    decays: bool = False  # a seeding step that applies a zero direction (module heavyball's rule)

    @property
    def seeds(self) -> bool:
        """Whether this step only seeds the parameter's factors and bases (``soap_step="heavyball"``'s
        first step: no direction)."""
        return self.t == 0 and self.group["soap_step"] == "heavyball"


def _moments_dtype(state: dict[str, Any], p: torch.Tensor) -> torch.dtype:
    """The dtype of a parameter's 32-bit moments: its momentum buffer's, else the parameter's."""
    buf = state.get("momentum_buffer")
    return buf.dtype if isinstance(buf, torch.Tensor) and not codecs.quantized(buf) else p.dtype


def _carry_over_owned(
    state: dict[str, Any] | None, plan: BlockPlan | None, group: dict[str, Any], p: torch.Tensor
) -> None:
    """The moments of the blocks this rank owns in the width ``group`` keeps (:func:`.state.carry_over`),
    before they are exported: a state of the other ``optim_bits`` loaded and no step taken since."""
    if not state or plan is None:
        return
    for b, block in enumerate(plan.blocks):
        if plan.owner(b).mine:
            carry_over(state, block_prefix(b), block, group, _moments_dtype(state, p))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
