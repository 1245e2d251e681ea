"""The optimizer class: a coordinator of the package's parts (see :mod:`dist_optim.kron`).

A step takes the update decision and the probes from :mod:`.randomness`, updates every local
piece of the momenta and runs the owner runtime (:mod:`dist_optim.sharding.runtime`): the momenta reach
their owners (tasks: :mod:`.owners`), the owners compute the directions (:mod:`.preconditioner` on
the factors of :mod:`.state`, shaped by :mod:`.structure`), every holder applies its part.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..base import DistOptimizer
from ..checks import group_lr
from ..layout import ParamLayout
from ..sharding.budget import DEFAULT_BUCKET_BYTES, check_bucket_bytes
from ..sharding.owners import Owner, share_results
from ..sharding.runtime import OwnedWork, OwnerRuntime
from ..states import codecs
from .blocks import discard_probe, draw_probe
from .init_scale import shared_initial_scales
from .momentum import momentum_bytes, update_momenta
from .options import check_optimizer_options, group_defaults, precond_dtype, validate_options
from .owners import KronParam, plan_param_owners
from .preconditioner import owner_direction
from .randomness import KronRandomness, param_position
from .schedule import precond_update_prob_schedule
from .state import (
    FactorScratch,
    check_factor_shapes,
    check_loaded_forms,
    factor_form,
    init_param_state,
    keeps_saved_dtype,
    stored_specs,
    without_factors,
)
from .structure import FactorPlan, plan_factors, precond_cost
from .variant import heavy

__all__ = ["DistributedKron"]


class DistributedKron(DistOptimizer):
    """PSGD Kron (Li 2015, 2018; kron_torch's ``Kron``), exact under TP and ZeRO (see the module
    docstring for the algorithm, the distribution and the deviations from kron_torch).

    Args:
        params: parameters or parameter groups.
        lr: learning rate (>= 0); the seed's advice is ~3x smaller than Adam's, hence 3e-4.
        b1: momentum coefficient in [0, 1).
        weight_decay: decoupled weight decay, applied to tensors of >= 2 dims only (>= 0).
        preconditioner_update_probability: a float in (0, 1], a callable ``step -> probability``, or None for
            :func:`precond_update_prob_schedule`. Read from the first group.
        max_size_triangular: dims larger than this get diagonal factors.
        min_ndim_triangular: tensors with fewer dims get only diagonal factors.
        memory_save_mode: None, "smart_one_diag", "one_diag" or "all_diag".
        momentum_into_precond_update: fit the preconditioner to the debiased momentum (True) or to the raw gradient.
        precond_lr: step size of the factor updates (>= 0).
        precond_init_scale: initial scale of the preconditioner (> 0), or None: per parameter from its first
            gradient (its debiased first momentum, the same values up to rounding), ``mean(|G|^4)^(-1/8)`` (Li's
            psgd_torch rule, which heavyball also offers), so that the first preconditioned gradient has about unit
            size whatever the gradients' scale (docs/convergence.md: a lower held-out loss at the best rates).
            Default 1.0, kron_torch's (its conversions keep it).
        merge_dims: precondition tensors of > 2 dims as matrices.
        mu_dtype: dtype of the momentum (default: the parameter's); not of an 8-bit one.
        precond_dtype: dtype of the factors (default fp32).
        clip_update_rms: clip the RMS of the preconditioned direction at 1.1.
        seed: seed of the generators (probes, balancing, rounding). Every rank must use the same.
        communication_dtype: precision of the exchanges with the owners when bound (default: the widest dtype of the
            tensors sent, fp32 = exact; ``torch.bfloat16`` halves the bytes at bf16 rounding of momenta and
            directions).
        probe_rng: where the probe vectors come from. ``"sequential"`` (default, kron_torch's): one generator drawn
            for every parameter with a gradient in ``param_groups`` order, on every rank. ``"per_parameter"``: each
            probe from a generator seeded by ``(seed, parameter key, the parameter's step)``, where the key is the
            parameter's name in ``param_names`` (set by the dist_optim plugins at boost) or else its position in
            ``param_groups``: the same probes whatever subset of the model an optimizer holds, so a pipeline stage
            reproduces the single-device run, and only owners draw.
        optim_bits: 32, or 8 for the momentum kept as bitsandbytes' block-wise 8-bit codes (Dettmers et al. 2022,
            arXiv:2110.02861; :mod:`dist_optim.kron.momentum`: blocks of 256 values of the full flattened tensor,
            one fp32 absmax each, the signed map), dequantised and updated in fp32 each step, the debiasing, fit and
            direction computed from that fp32 value, stored quantised again before it travels to the owner.
        min_8bit_size: with ``optim_bits=8``, momenta of tensors with fewer elements (full tensor) stay in
            ``mu_dtype`` (bitsandbytes' default 4096).
        use_symmetric_packing: keep the upper-triangular factors as packed triangles, ``n (n + 1) / 2`` elements
            instead of ``n^2`` (about half the factors' memory). For Kron the packed matrices are triangular, not
            symmetric (the name is Shampoo's option, Meta's and ours): the upper triangle, unpacked for the owner's
            step into reused scratch with its lower triangle exactly zero (as the unpacked factors keep it), the
            same math, packed back; the steps equal the unpacked ones bit for bit (:mod:`dist_optim.kron.state`).
            The scratch holds one parameter's whole triangular factors at a time: the irreducible working set, since
            each factor acts whole on every block of a large tensor.
        preconditioner_bits: 32, or 8 for the triangular factors kept block-wise quantised (uint8 codes of the
            packed triangle or the whole matrix, blocks of 256, fp32 absmax: :mod:`dist_optim.states.lowbit`, as
            Wang et al. 2024, arXiv:2405.18144, keep Shampoo's), dequantised for each step and quantised anew where
            an update changed them, rounded stochastically (:mod:`dist_optim.kron.state`); diagonal factors stay in
            ``precond_dtype``. 4 bits is refused: it ends too far above full precision's held-out loss
            (``bench/compact_quality.py``; :mod:`dist_optim.kron.options`).
        bucket_bytes: the step-memory budget (:mod:`dist_optim.sharding.budget`): when bound, the parameters go to
            their owners and back in buckets of consecutive parameters of at most this many bytes of full momenta (a
            larger parameter is a bucket of its own), each bucket's directions applied before the next moves, so the
            owners' whole momenta and directions and the exchange buffers are bounded by the budget, not the model.
            Default :data:`~dist_optim.sharding.budget.DEFAULT_BUCKET_BYTES`; None: all at once (the fewest
            collectives). The result does not depend on it (bit for bit: the probes are drawn in parameter order
            either way).
        nonfinite: a step with a NaN/Inf gradient ``"raise"`` (default), ``"skip"`` or ``"ignore"`` (see
            :class:`~dist_optim.base.DistOptimizer`); a skipped step draws no random numbers and leaves the update
            schedule where it was.
        variant: ``"kron_torch"`` (default, the algorithm above) or ``"heavyball"``: heavyball's PSGDKron
            (:mod:`dist_optim.kron.variant`: its momentum, update rule, noise, balancing, lower-bounded factor
            steps, trust-region clip), what ``dist_optim.convert`` makes of it; with it ``dampening``,
            ``lower_bound_beta`` and ``power_iterations`` (heavyball's ``precond_update_power_iterations``) are
            read.
        precond_init_scale_power, precond_init_scale_scale: with ``precond_init_scale=None`` the scale is
            ``(scale_scale * mean(|G|^4)^(-1/8)) ** power`` (default 1, 1: Li's rule; heavyball's 0.5 power).
        precond_init_scale_by_shape: with ``precond_init_scale=None``, the parameters of a param group that start in
            the same step and have one shape (and dtype) share one scale, from their raw gradients together:
            heavyball's ``multi_tensor=True``, which stacks same-shape parameters (default False: each parameter's
            own first gradient).
    """

    _sharded_state = ("momentum_buffer",)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 3e-4,
        b1: float = 0.9,
        weight_decay: float = 0.0,
        preconditioner_update_probability: float | Callable[[int], Any] | None = None,
        max_size_triangular: int = 8192,
        min_ndim_triangular: int = 2,
        memory_save_mode: str | None = None,
        momentum_into_precond_update: bool = True,
        precond_lr: float = 0.1,
        precond_init_scale: float | None = 1.0,
        merge_dims: bool = True,
        mu_dtype: torch.dtype | None = None,
        precond_dtype: torch.dtype | None = None,
        clip_update_rms: bool = True,
        seed: int = 42,
        communication_dtype: torch.dtype | None = None,
        probe_rng: str = "sequential",
        *,
        optim_bits: int = 32,
        min_8bit_size: int = 4096,
        use_symmetric_packing: bool = False,
        preconditioner_bits: int = 32,
        bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
        nonfinite: str = "raise",
        variant: str = "kron_torch",
        dampening: float = 1e-9,
        lower_bound_beta: float = 0.9,
        power_iterations: int = 2,
        precond_init_scale_power: float = 1.0,
        precond_init_scale_scale: float = 1.0,
        precond_init_scale_by_shape: bool = False,
    ) -> None:
        check_optimizer_options(seed, communication_dtype, probe_rng)
        self.optim_bits, self.min_8bit_size = codecs.check_8bit_options(
            optim_bits, min_8bit_size, "8-bit block-wise momentum"
        )
        self.bucket_bytes = check_bucket_bytes(bucket_bytes)
        if preconditioner_update_probability is None:
            preconditioner_update_probability = precond_update_prob_schedule()
        defaults = group_defaults(
            lr=lr,
            b1=b1,
            weight_decay=weight_decay,
            preconditioner_update_probability=preconditioner_update_probability,
            max_size_triangular=max_size_triangular,
            min_ndim_triangular=min_ndim_triangular,
            memory_save_mode=memory_save_mode,
            momentum_into_precond_update=momentum_into_precond_update,
            precond_lr=precond_lr,
            precond_init_scale=precond_init_scale,
            merge_dims=merge_dims,
            mu_dtype=mu_dtype,
            precond_dtype=precond_dtype,
            clip_update_rms=clip_update_rms,
            use_symmetric_packing=use_symmetric_packing,
            preconditioner_bits=preconditioner_bits,
            heavyball=dict(
                variant=variant,
                dampening=dampening,
                lower_bound_beta=lower_bound_beta,
                power_iterations=power_iterations,
                precond_init_scale_power=precond_init_scale_power,
                precond_init_scale_scale=precond_init_scale_scale,
                precond_init_scale_by_shape=precond_init_scale_by_shape,
            ),
        )
        super().__init__(params, defaults, nonfinite=nonfinite)
        self.communication_dtype = communication_dtype
        self._random = KronRandomness(seed, probe_rng)
        self._scratch = FactorScratch()
        self._init_scales: dict[torch.Tensor, float] = {}  # shared by shape this step (init_scale.py)
        self._plans: dict[torch.Tensor, FactorPlan] = {}
        #: Each parameter's owner task (planned at binding, or by the first step: work alone), and the
        #: step's exchanges.
        self.owner_runtime = OwnerRuntime()  # who preconditions each parameter, and the step's exchanges

    def validate_group(self, group: dict[str, Any]) -> None:
        """The options of one param group (see the class docstring for their ranges)."""
        super().validate_group(group)
        codecs.refuse_group_8bit_options(group, type(self).__name__)
        validate_options(group, self.optim_bits)

    @property
    def seed(self) -> int:
        """The seed of the generators (probe vectors and balancing)."""
        return self._random.seed

    @property
    def probe_rng(self) -> str:
        """Where the probe vectors come from: ``"sequential"`` or ``"per_parameter"``."""
        return self._random.probe_rng

    @probe_rng.setter
    def probe_rng(self, value: str) -> None:
        self._random.probe_rng = value

    # ---- plans and owners ---------------------------------------------------------------------
    def _plan(self, param: torch.Tensor, group: dict[str, Any] | None = None) -> FactorPlan:
        plan = self._plans.get(param)
        if plan is None:
            plan = plan_factors(self.layout(param).full_shape, group or self.group_of(param))
            self._plans[param] = plan
        return plan

    def _on_bind(self) -> None:
        """Give every parameter an owner in its work group (:func:`.owners.plan_param_owners`), once per
        binding. Collective over the job under TP (the grids are process groups)."""
        self._plans = {}
        self.owner_runtime.bind([self.layout(p) for p in self._all_params()], self.dp_group, self.tp_group)
        self._plan_owners()

    def _plan_owners(self) -> None:
        params_groups = [(p, g) for g in self.param_groups for p in g["params"]]
        plans = [self._plan(p, group) for p, group in params_groups]
        plan_param_owners(
            self.owner_runtime,
            [p for p, _ in params_groups],
            [self.layout(p) for p, _ in params_groups],
            [precond_cost(plan.shape, plan.diag) for plan in plans],
        )

    def _owner(self, param: torch.Tensor) -> Owner | None:
        return self.owner_runtime.owner(param)

    def _mine(self, param: torch.Tensor) -> bool:
        owner = self._owner(param)
        return owner is None or owner.mine

    def precond_work(self) -> float:
        """Summed :func:`precond_cost` of the parameters this rank owns (all of them when unbound)."""
        plans = [self._plan(p, group) for group in self.param_groups for p in group["params"] if self._mine(p)]
        return float(sum(precond_cost(plan.shape, plan.diag) for plan in plans))

    # ---- randomness ------------------------------------------------------------------------------
    def use_layout_independent_randomness(self) -> str | None:
        """Switch to ``probe_rng="per_parameter"`` (see the class docstring)."""
        if self.probe_rng == "per_parameter":
            return None
        self.probe_rng = "per_parameter"
        return 'probe_rng="per_parameter" (probe vectors seeded by parameter name and step)'

    def _key(self, p: torch.Tensor) -> str:
        """The parameter's key in the seeds of its generators (see ``probe_rng`` above)."""
        return self.param_names.get(p) or param_position(self.param_groups, p)

    def _probe_generator(self, p: torch.Tensor) -> torch.Generator:
        return self._random.probe_generator(p.device, lambda: self._key(p), int(self.state[p]["step"]))

    def _rounding_generator(self, p: torch.Tensor) -> torch.Generator:
        return self._random.rounding_generator(p.device, self._key(p), int(self.state[p]["step"]))

    # ---- the step --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self._begin_step(closure)
        if not self._gradients_ok():
            return loss
        first = self.param_groups[0]
        do_update, balance = self._random.decide(first["preconditioner_update_probability"], heavy(first))

        todo: list[tuple[dict[str, Any], torch.Tensor, torch.Tensor]] = []
        sizes: list[int] = []
        starting = []
        for group in self.param_groups:
            params, grads = self._grads(group)
            inputs = 1 if group["momentum_into_precond_update"] else 2
            for p, g in zip(params, grads):
                state, layout = self.state[p], self.layout(p)
                eight = self.eight_bit(layout)
                if not state:
                    init_param_state(state, p, group["mu_dtype"], eight)
                state["step"] += 1
                if int(state["step"]) == 1:  # every rank that holds a piece of p knows this
                    starting.append((group, p, g, layout))
                todo.append((group, p, g))
                sizes.append(layout.full_numel * momentum_bytes(state, p, group, eight) * inputs)
        if any(p not in self.owner_runtime.tasks for _, p, _ in todo):
            self._plan_owners()  # unbound (every parameter this rank's alone), or a new param group
        self._init_scales = shared_initial_scales(starting)
        # The next bucket's momenta travel while this one's owners compute; directions in
        # parameter order on every rank (the sequential probes stay in step).
        self.owner_runtime.run(
            todo,
            sizes,
            self._prepare,
            lambda works: self._compute(works, do_update, balance),
            self._deliver,
            comm_dtype=self.communication_dtype,
            budget=self.bucket_bytes,
            in_order=True,
        )
        return loss

    def _prepare(self, todo: Sequence[tuple[dict[str, Any], torch.Tensor, torch.Tensor]]) -> list[OwnedWork[KronParam]]:
        """A bucket's momenta updated (element-wise, here: an 8-bit one's fp32 value exists for
        its bucket only): with the gradients where the preconditioner is fitted to them, the
        inputs of their owners' work."""
        layouts = [self.layout(p) for _, p, _ in todo]
        work = [(*t, layout) for t, layout in zip(todo, layouts)]
        momenta = update_momenta(self.state, work, self.eight_bit, self._random.prob_step)
        works = []
        for (group, p, g), m, layout in zip(todo, momenta, layouts):
            # An 8-bit parameter's fp32 momentum is already stored as codes: the owner may work in it.
            item = KronParam(group, p, m, g, layout, scratch=self.eight_bit(layout))
            works.append(OwnedWork(item, self.owner_runtime.tasks[p], item.fit_inputs(), precond_dtype(group)))
        return works

    def _compute(self, works: list[OwnedWork[KronParam]], do_update: bool, balance: bool) -> None:
        for w in works:
            self._direction(w, do_update, balance)

    def _deliver(self, works: list[OwnedWork[KronParam]]) -> None:
        for w in works:
            self._apply(w)

    def _direction(self, w: OwnedWork[KronParam], do_update: bool, balance: bool) -> None:
        """Draw the probe (every rank with ``probe_rng="sequential"``, so that every generator
        stays in step) and, on the owner, compute the direction, the work's result."""
        item = w.entry
        group, p = item.group, item.p
        plan = self._plan(p, group)
        dtype = precond_dtype(group)
        draws = do_update and (self.probe_rng == "sequential" or self._mine(p))
        if self._mine(p):
            inputs = w.owned[0]
            probes = draw_probe(self._probe_generator(p), plan, dtype, item.m.device) if draws else None
            # Assembled or gathered inputs are the owner's scratch; a whole local momentum is the
            # state's buffer (unless it is 8-bit: then a dequantised copy).
            scratch = item.scratch or w.copies
            state = self.state[p]
            rounding = functools.partial(self._rounding_generator, p)
            w.results[0] = owner_direction(
                state,
                group,
                plan,
                inputs[0],
                inputs[-1],
                probes,
                balance,
                scratch,
                self._scratch,
                rounding,
                step=self._random.prob_step,
                init_scale=self._init_scales.get(p),
            )
            w.owned = {}  # the owner's whole inputs, dropped as soon as used
        elif draws:  # the numbers, chunk by chunk, dropped: the sequential generator stays in step
            discard_probe(self._probe_generator(p), plan, dtype, item.m.device)

    def _apply(self, w: OwnedWork[KronParam]) -> None:
        """This rank's elements of the direction, weight decay (tensors of >= 2 dims; every one with
        variant="heavyball"), the step."""
        group, p, layout = w.entry.group, w.entry.p, w.layout
        local = w.local().view_as(p)
        if group["weight_decay"] != 0 and (layout.ndim >= 2 or heavy(group)):  # heavyball: every tensor
            local.add_(p, alpha=group["weight_decay"])
        p.add_(local.to(p.dtype), alpha=-group_lr(group))
        w.piece, w.boxes = None, []  # applied: freed now, not when the whole bucket's are

    # ---- state -------------------------------------------------------------------------------------
    def full_state(self) -> list[dict[str, Any]]:
        """Every parameter's state in full form on every rank: ``step``, ``momentum_buffer``
        (parameter-shaped) and the factors ``Q_0, Q_1, ...`` (shared from their owners).
        Collective when bound."""
        out = super().full_state()
        entries: list[tuple[torch.Tensor, list[str], list[torch.Tensor]]] = []
        where: list[int] = []
        params_groups = [(p, g) for g in self.param_groups for p in g["params"]]
        for i, (p, group) in enumerate(params_groups):
            state = self.state.get(p)
            if not state:
                continue
            specs = stored_specs(self._plan(p, group), factor_form(group))
            if self._mine(p):
                tensors = [state[key].clone() for key, _, _ in specs]
            else:
                tensors = [torch.empty(shape, dtype=dtype, device=p.device) for _, shape, dtype in specs]
            entries.append((p, [key for key, _, _ in specs], tensors))
            where.append(i)
        # Codes travel as the widest dtype (fp32) and come back exact.
        share_results([(owner, tensors) for p, _, tensors in entries if (owner := self._owner(p)) is not None])
        for i, (_, keys, tensors) in zip(where, entries):
            out[i].update(zip(keys, tensors))
        return out

    def eight_bit(self, layout: ParamLayout) -> bool:
        """Whether a parameter of this layout keeps its momentum in 8 bits (``optim_bits``,
        ``min_8bit_size`` of its full tensor)."""
        return codecs.EightBit.of(self).keeps(layout.full_numel)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The base's loader, after :func:`.state.check_loaded_forms`."""
        check_loaded_forms(state_dict, self.param_groups, lambda p, g: plan_factors(self.layout(p).full_shape, g).diag)
        super().load_state_dict(state_dict)

    def keeps_saved_dtype(self, key: str, value: torch.Tensor) -> bool:
        """The factors (``precond_dtype``), the momentum (``mu_dtype`` or 8-bit codes) and its
        absmax keep their saved dtype on load; torch's loader would cast them to the parameter's."""
        return keeps_saved_dtype(key)

    def _localize_state(self, param: torch.Tensor, state: dict[str, Any]) -> dict[str, Any]:
        """For ``load_full_state``: only the owner keeps a parameter's factors (of the stored shapes
        of its group's options, checked on every rank)."""
        group = self.group_of(param)
        check_factor_shapes(state, self._plan(param, group), factor_form(group), self.layout(param).full_shape)
        return state if self._mine(param) else without_factors(state)

    def extra_state(self) -> dict[str, Any]:
        """The skipped-step counter, the step counters of the update decision and the generator
        states (the same on every rank): with :meth:`full_state` they resume the same trajectory
        under any layout."""
        return {**super().extra_state(), **self._random.state()}

    def load_extra_state(self, extra: dict[str, Any]) -> None:
        super().load_extra_state(extra)
        self._random.load_state(extra)
