"""The optimizer base shared by every dist_optim optimizer.

One class is both the single-device algorithm and its distributed version: an optimizer that has
not been bound to layouts treats every parameter as whole and local (it *is* the single-device
algorithm); binding gives each parameter a :class:`~dist_optim.layout.ParamLayout`, and the
optimizer's math then routes its cross-shard reductions through :mod:`dist_optim.comm`.

:meth:`DistOptimizer.bind` takes the layouts; the core knows only ``torch.distributed``. Building
layouts from a framework's view of its tensors is an integration's work: ``dist_optim.plugins``
for ColossalAI (its positional ``setup_distributed`` contract, avoiding the traps listed in
docs/design.md, "The ColossalAI contract").

NaN/Inf gradients: every optimizer checks its gradients before a step changes anything, under one
policy (``nonfinite``, see :meth:`DistOptimizer._gradients_ok`): ``"raise"`` (default) raises
``FloatingPointError`` naming the parameter, ``"skip"`` skips the whole step (counted in
``skipped_steps``), ``"ignore"`` does not look. Bound, the decision is the whole job's: a bad
gradient in one rank's shard stops or skips the step on every rank.

Copies, pickles and state dicts (torch.optim's persistence contract) come from
:class:`dist_optim.states.saved.SavedState`, which the base is built on.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .checks import check_adam_options, check_lr, check_range, group_lr
from .comm import SumBucket, gather_full, group_size
from .layout import ParamLayout, local_layout, read_tp_dim
from .nonfinite import NONFINITE_POLICIES, bad_parameters, check_nonfinite_policy, local_flag, refusal
from .states.saved import STATE_DICT_KEY, SavedState, check_state_dict, class_path

__all__ = [
    "DistOptimizer",
    "NONFINITE_POLICIES",
    "STATE_DICT_KEY",
    "check_range",
    "check_adam_options",
    "check_lr",
    "group_lr",
    "check_nonfinite_policy",
    "class_path",
    "check_state_dict",
]


class DistOptimizer(SavedState):
    """Base of all dist_optim optimizers: param→layout binding, parameter iteration and the NaN/Inf
    gradient policy.

    ``nonfinite`` (every optimizer's keyword, also settable on the instance later): what a step
    does when a gradient holds NaN or Inf, checked before anything changes:

    * ``"raise"`` (default): ``FloatingPointError`` naming the parameter(s), on every rank;
    * ``"skip"``: the step is not taken: parameters, state, step counters and random generators
      are left as they were, and :attr:`skipped_steps` counts it (saved in :meth:`extra_state`);
    * ``"ignore"``: no check, no host read, no collective (NaN/Inf then spread into the state
      and parameters, as in the reference implementations).
    """

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], *, nonfinite: str = "raise") -> None:
        self._nonfinite = check_nonfinite_policy(nonfinite)
        #: Steps skipped because a gradient held NaN or Inf (``nonfinite="skip"``).
        self.skipped_steps = 0
        #: Model name of each parameter this optimizer steps (the dist_optim plugins record them at
        #: boost): checkpoints and error messages name parameters by it.
        self.param_names: dict[torch.Tensor, str] = {}
        #: The options this optimizer declares (torch adds keys of its own to ``defaults``).
        self.option_names = frozenset(defaults)
        super().__init__(params, defaults)
        self._layouts: dict[torch.Tensor, ParamLayout] = {}
        self.dp_group: Any = None
        self.tp_group: Any = None
        self._warned_unbound = False

    # ---- options ------------------------------------------------------------------------
    def validate_group(self, group: dict[str, Any]) -> None:
        """Check one param group's options (defaults already filled in), raising ``ValueError`` or
        ``TypeError`` that names the option and the fix. The one validation hook of every
        optimizer: called for each group, from ``__init__`` and :meth:`add_param_group`; a group
        that fails is not kept. Subclasses override it (and call ``super()``)."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (torch's semantics), then :meth:`validate_group` it: a group with a bad
        option is refused and the optimizer is left as it was."""
        super().add_param_group(param_group)
        try:
            self.validate_group(self.param_groups[-1])
        except (ValueError, TypeError):
            self.param_groups.pop()
            raise

    @property
    def nonfinite(self) -> str:
        """The NaN/Inf gradient policy: ``"raise"``, ``"skip"`` or ``"ignore"`` (class docstring)."""
        return self._nonfinite

    @nonfinite.setter
    def nonfinite(self, value: str) -> None:
        self._nonfinite = check_nonfinite_policy(value)

    # ---- binding ------------------------------------------------------------------------
    @property
    def is_bound(self) -> bool:
        return bool(self._layouts) or self.dp_group is not None

    def layout(self, param: torch.Tensor) -> ParamLayout:
        """The layout of ``param`` (whole and local when unbound)."""
        layout = self._layouts.get(param)
        return layout if layout is not None else local_layout(param)

    def _all_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def bind(self, layouts: Mapping[torch.Tensor, ParamLayout], dp_group: Any = None, tp_group: Any = None) -> None:
        """Give every parameter of this optimizer its layout.

        ``dp_group`` is the data-parallel group over which gradients are averaged; optimizers
        that split per-parameter work (preconditioners, projections) across it use it.
        ``tp_group`` is this process's TP group (default: the one of the TP-split layouts);
        Shampoo splits its work over the grid of the two. Every parameter must have a layout
        whose local form matches the parameter's size.
        """
        checked: dict[torch.Tensor, ParamLayout] = {}
        for i, p in enumerate(self._all_params()):
            layout = layouts.get(p)
            if layout is None:
                raise ValueError(
                    f"bind: parameter #{i} (shape {tuple(p.shape)}) has no layout; pass a layout for every "
                    "parameter of the optimizer (use ParamLayout(tuple(p.shape)) for a whole, local one)"
                )
            if layout.zero is None and tuple(p.shape) != layout.local_shape:
                raise ValueError(
                    f"bind: parameter #{i} has shape {tuple(p.shape)} but its layout expects the local "
                    f"shape {layout.local_shape} (full shape {layout.full_shape})"
                )
            if layout.zero is not None and p.numel() != layout.chunk_numel:
                raise ValueError(
                    f"bind: parameter #{i} is a ZeRO chunk of {p.numel()} elements but its layout expects "
                    f"{layout.chunk_numel}; check the ZeRO group size and padding"
                )
            checked[p] = layout
        self._layouts = checked
        self.dp_group = dp_group
        if tp_group is None:
            tp_group = next((lay.tp.group for lay in checked.values() if lay.tp is not None), None)
        self.tp_group = tp_group
        self._on_bind()

    def _on_bind(self) -> None:
        """Hook for optimizers that precompute per-layout data (e.g. work assignment)."""

    def use_layout_independent_randomness(self) -> str | None:
        """Draw random numbers from sources that do not depend on which parameters this optimizer
        holds (a pipeline stage holds a subset of the model); returns what changed, for the log,
        or None. A no-op for the deterministic optimizers; the plugins call it under pipeline
        parallelism."""
        return None

    # ---- iteration ----------------------------------------------------------------------
    def _begin_step(self, closure: Callable[[], Any] | None) -> Any:
        """Start of every ``step``: evaluate the closure (with grad enabled) and warn once if an
        unbound optimizer steps in a multi-process job. Returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_unbound_in_job()
        return loss

    def _check_unbound_in_job(self) -> None:
        """An unbound optimizer in a multi-process job: refused where a parameter says it is a
        tensor-parallel slice (its math would see the slice alone: a stock plugin that never
        bound it) or an FSDP flat parameter, warned once otherwise (right for replicated parameters)."""
        if self._warned_unbound or self.is_bound:
            return
        world = group_size(None)
        # FSDP's flat parameters (a stock TorchFSDPPlugin re-creates the optimizer on them) mix the
        # tensors of a unit: no per-parameter math is right on them.
        flat = [p for p in self._all_params() if getattr(p, "_is_flat_param", False)] if world > 1 else []
        if flat:
            raise RuntimeError(
                f"{type(self).__name__} is stepping on {len(flat)} FSDP flat parameters, each mixing several "
                "parameters' pieces: use dist_optim.plugins.TorchFSDPPlugin (binds the original parameters), launch "
                "under `python -m dist_optim.plugins.launch`, or build FSDP with use_orig_params=True and bind(...)"
            )
        sliced = [p for p in self._all_params() if read_tp_dim(p) is not None] if world > 1 else []
        if sliced:
            raise RuntimeError(
                f"{type(self).__name__} is stepping without layouts in a {world}-process job, but "
                f"{self.param_label(sliced[0])} and {len(sliced) - 1} more are tensor-parallel slices: boost through "
                "dist_optim.plugins, launch under `python -m dist_optim.plugins.launch` (swaps the stock plugins), "
                "or bind(...) it to the layouts"
            )
        self._warned_unbound = True
        if world > 1:
            warnings.warn(
                f"{type(self).__name__} is stepping without layouts in a {world}-process job. "
                "That is right for plain data parallelism (replicated params); with tensor parallelism or "
                "ZeRO, boost through dist_optim.plugins or bind(...) it to the layouts.",
                stacklevel=3,
            )

    def _gradients_ok(self, summed: torch.Tensor | None = None) -> bool:
        """The NaN/Inf check of :attr:`nonfinite`, made by every ``step`` before it changes anything:
        True to take the step; False to skip it (``"skip"``, counted); raises under ``"raise"``.

        Each rank takes the 2-norm of each gradient it holds (one multi-tensor reduction, at
        least fp32; NaN and Inf propagate through sums: :meth:`_local_nonfinite_flag`) and, when
        bound, one flag is summed over the whole job: one all-reduce over the default process group
        (every process of a job steps its optimizer, as ColossalAI's plugins do), so that every
        rank, pipeline stages and data-parallel replicas included, takes the same decision and none
        is left waiting in a later collective. ``summed``: that job-wide sum already made, the flag
        carried by a collective of the step over every rank of the job (GaLore's first projector
        all-gather), so none is issued here. Then one host read of the flag. Only when the flag is
        set (the step is lost anyway) the exact per-element check runs and every rank learns every
        rank's bad parameters (one ``all_gather_object``); a norm that overflowed on finite values
        (gradients above about 1.8e19) is then seen for what it is and the step goes on.
        """
        if self._nonfinite == "ignore":
            return True
        params, grads = self._all_grads()
        distributed = self.is_bound and group_size(None) > 1
        flag = summed if summed is not None else self._local_nonfinite_flag()
        if distributed and summed is None:
            check = SumBucket()
            check.add(flag, (None,))  # None: the default process group, i.e. the whole job
            check.flush()
        if not bool(flag.item() > 0):
            return True
        bad = bad_parameters(params, grads, self.param_label, distributed)
        if not bad:
            return True  # finite gradients whose fp32 2-norm overflowed
        if self._nonfinite == "skip":
            self.skipped_steps += 1
            return False
        raise refusal(type(self).__name__, bad)

    def _all_grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for group in self.param_groups:
            ps, gs = self._grads(group)
            params += ps
            grads += gs
        return params, grads

    def _local_nonfinite_flag(self) -> torch.Tensor:
        """This rank's part of :meth:`_gradients_ok`'s flag (:func:`dist_optim.nonfinite.local_flag`)."""
        grads = self._all_grads()[1]
        device = grads[0].device if grads else next(iter(self._all_params()), torch.empty(0)).device
        return local_flag(grads, device)

    def named_params(self) -> list[tuple[torch.Tensor, str | None]]:
        """Every parameter in param-group order with its model name: :attr:`param_names`, else the
        ``param_names`` list of its param group; None where neither names it."""
        out: list[tuple[torch.Tensor, str | None]] = []
        for group in self.param_groups:
            names = group.get("param_names")
            for i, p in enumerate(group["params"]):
                listed = names[i] if names is not None and i < len(names) else None
                out.append((p, self.param_names.get(p) or listed))
        return out

    def param_name(self, param: torch.Tensor) -> str | None:
        """The model name of ``param`` (:meth:`named_params`)."""
        name = self.param_names.get(param)
        if name:
            return name
        for p, name in self.named_params():
            if p is param:
                return name
        raise KeyError("the parameter is not in this optimizer")

    def param_label(self, param: torch.Tensor) -> str:
        """How messages name ``param``: its model name (:meth:`param_name`), else its position and
        full shape."""
        name = self.param_name(param)
        if name:
            return f"parameter {name!r}"
        for gi, group in enumerate(self.param_groups):
            for i, q in enumerate(group["params"]):
                if q is param:
                    return f"parameter #{i} of param group {gi} (shape {self.layout(param).full_shape})"
        raise KeyError("the parameter is not in this optimizer")

    def group_of(self, param: torch.Tensor) -> dict[str, Any]:
        """The param group that holds ``param`` (by identity: tensors compare element-wise)."""
        for group in self.param_groups:
            if any(p is param for p in group["params"]):
                return group
        raise KeyError("parameter is not in this optimizer")

    def _grads(self, group: dict[str, Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Parameters of ``group`` that have a gradient, and their gradients."""
        params, grads = [], []
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise TypeError(
                    f"{type(self).__name__} does not support sparse gradients (param #{i} of its group, shape "
                    f"{tuple(p.shape)}); use a dense embedding (sparse=False) or torch.optim.SparseAdam for it"
                )
            params.append(p)
            grads.append(p.grad)
        return params, grads

    # ---- layout-independent state ---------------------------------------------------------
    #: State keys whose tensors have the parameter's local form (sharded like the parameter).
    #: Everything else is already in full-tensor form (replicated) or a scalar.
    _sharded_state: tuple[str, ...] = ()

    def full_state(self) -> list[dict[str, Any]]:
        """Every parameter's state in full-tensor form, in ``param_groups`` order.

        Collective when bound: sharded entries are gathered over TP and ZeRO groups (bucketed).
        The result does not depend on the layout, which is what checkpoints and parity tests
        compare."""
        params = self._all_params()
        items: list[tuple[ParamLayout, torch.Tensor]] = []
        where: list[tuple[int, str]] = []
        out: list[dict[str, Any]] = []
        for i, p in enumerate(params):
            state = self.state.get(p, {})
            entry: dict[str, Any] = {}
            for key, value in state.items():
                if key in self._sharded_state and isinstance(value, torch.Tensor):
                    items.append((self.layout(p), value))
                    where.append((i, key))
                else:
                    entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
            out.append(entry)
        for (i, key), (_, local), full in zip(where, items, gather_full(items)):
            # gather_full hands a whole, local tensor back as it is: copy it, or the returned
            # state would change with the next step.
            out[i][key] = full.clone() if full.data_ptr() == local.data_ptr() else full
        return out

    def load_full_state(self, states: list[dict[str, Any]]) -> None:
        """Inverse of :meth:`full_state`: replace every parameter's state from full-tensor form.

        ``states`` is in ``param_groups`` order. Everything is checked before anything is
        replaced, so a mismatched state leaves the optimizer as it was. Not collective: every
        rank takes its own pieces (its TP slice / ZeRO chunk, the blocks it owns)."""
        params = self._all_params()
        if len(states) != len(params):
            raise ValueError(f"load_full_state: {len(states)} parameter states for {len(params)} parameters")
        new: dict[torch.Tensor, dict[str, Any]] = {}
        for i, (p, full) in enumerate(zip(params, states)):
            layout = self.layout(p)
            entry: dict[str, Any] = {}
            for key, value in full.items():
                if key in self._sharded_state and isinstance(value, torch.Tensor):
                    if tuple(value.shape) != layout.full_shape:
                        raise ValueError(
                            f"load_full_state: parameter #{i} state {key!r} has shape {tuple(value.shape)}, "
                            f"the parameter's full shape is {layout.full_shape}"
                        )
                    local = layout.take_local(value.to(p.device))
                    entry[key] = local.view_as(p) if layout.zero is None else local
                else:
                    entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
            if entry:
                new[p] = self._localize_state(p, entry)
        self.state.clear()
        self.state.update(new)

    def _localize_state(self, param: torch.Tensor, state: dict[str, Any]) -> dict[str, Any]:
        """Hook for :meth:`load_full_state`: keep what this rank holds of a full-form state (e.g.
        only the preconditioner blocks it owns). Element-wise optimizers keep everything."""
        return state

    def extra_state(self) -> dict[str, Any]:
        """Optimizer-level state beyond per-parameter state (the skipped-step counter; subclasses
        add e.g. random generators); saved in checkpoints next to :meth:`full_state`."""
        return {**super().extra_state(), "skipped_steps": self.skipped_steps}

    def load_extra_state(self, extra: dict[str, Any]) -> None:
        """Inverse of :meth:`extra_state` (a checkpoint without the counter restores it as 0)."""
        super().load_extra_state(extra)
        self.skipped_steps = int(extra.get("skipped_steps", 0))
