"""What a saved or copied optimizer is: :class:`SavedState` (torch.optim's persistence contract,
the class ``DistOptimizer`` is built on), param-group options as plain data, and the checks of a
state dict before it is loaded.

A saved optimizer state must load with ``torch.load(..., weights_only=True)`` (torch's default from
2.6, and what checkpoint tools use): tensors, numbers, strings, dtypes, lists, tuples and dicts
only. Some options are objects (Shampoo's grafting configs, Kron's update schedule) or a user's
callable. :func:`saved_group` writes each option in plain form, and :func:`restored_group` reads it
back against the group the loading optimizer was built with:

* a registered option class (:func:`register_option_class`: a dataclass of plain fields) is saved
  as ``{"dist_optim_option": <class name>, "fields": {...}}`` and rebuilt from them;
* any other callable cannot be saved as data, so its place holds
  ``{"dist_optim_option": "callable", "name": <qualified name>}`` and a load keeps the callable the
  optimizer was built with, as torch's ``LambdaLR`` keeps its lambdas out of its state dict.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import types
from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "STATE_DICT_KEY",
    "TAG",
    "SavedState",
    "class_path",
    "saved_name",
    "same_optimizer",
    "job_handles",
    "register_option_class",
    "saved_group",
    "restored_group",
    "check_state_dict",
]

#: The key of ``DistOptimizer.state_dict()`` under which the class and the extra state are saved.
STATE_DICT_KEY = "dist_optim"

#: The key that marks a dict as an encoded option (no option of ours is a dict with this key).
TAG = "dist_optim_option"
_CALLABLE = "callable"
_CLASSES: dict[str, Any] = {}  # dataclass types by name


def class_path(cls: type) -> str:
    """``module.QualName`` of a class: how the registry and logs name optimizers."""
    return f"{cls.__module__}.{cls.__qualname__}"


def saved_name(cls: type) -> str:
    """How saved states and checkpoints name the optimizer that wrote them: its class name, which
    moving a module does not change. A name saved as a class path (``module.QualName``) still
    matches (:func:`same_optimizer`)."""
    return cls.__qualname__


def same_optimizer(saved: str, cls: type) -> bool:
    """Whether a saved optimizer name (a class name or a class path) is ``cls``'s."""
    return saved.rsplit(".", 1)[-1] == saved_name(cls)


#: Where torch.distributed's objects live (process groups, their backends, stores, works): handles
#: on the job, which neither pickle nor copy.
_C10D = ("torch.distributed", "torch._C._distributed_c10d")
_ATOMS = (torch.Tensor, torch.Generator, torch.dtype, torch.device, str, bytes, int, float, complex, type)


def job_handles(root: Any) -> list[Any]:
    """The torch.distributed objects reachable from ``root`` through containers and object
    attributes (what a bound optimizer's layouts, work plans and caches hold)."""
    found: dict[int, Any] = {}
    seen: set[int] = set()
    stack = [root]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen or isinstance(x, _ATOMS) or isinstance(x, types.FunctionType):
            continue
        seen.add(id(x))
        if type(x).__module__.startswith(_C10D):
            found[id(x)] = x
        elif isinstance(x, Mapping):
            stack += [*x.keys(), *x.values()]
        elif isinstance(x, (list, tuple, set, frozenset, collections.deque)):
            stack += list(x)
        else:
            stack += list(getattr(x, "__dict__", {}).values())
            stack += [getattr(x, n) for n in getattr(type(x), "__slots__", ()) if hasattr(x, n)]
    return list(found.values())


def register_option_class(cls: type) -> type:
    """Let instances of the dataclass ``cls`` be saved by their fields (usable as a decorator).
    Classes are named by their ``__name__``, which must be unique among registered classes."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"register_option_class: {cls.__name__} is not a dataclass")
    known = _CLASSES.get(cls.__name__)
    if known is not None and known is not cls:
        raise ValueError(f"register_option_class: two option classes are named {cls.__name__}")
    _CLASSES[cls.__name__] = cls
    return cls


def _plain(value: Any) -> Any:
    cls = _CLASSES.get(type(value).__name__)
    if cls is not None and cls is type(value):
        fields = {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(cls)}
        return {TAG: type(value).__name__, "fields": fields}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if callable(value) and not isinstance(value, type):
        name = f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__qualname__)}"
        return {TAG: _CALLABLE, "name": name}
    return value


def _restored(key: str, value: Any, built: Any) -> Any:
    if isinstance(value, Mapping) and TAG in value:
        kind = value[TAG]
        if kind == _CALLABLE:
            if not callable(built):
                raise ValueError(
                    f"option {key!r} was saved as the callable {value.get('name')}, which a state dict cannot "
                    f"hold; build the optimizer with that callable as {key} before loading"
                )
            return built
        cls = _CLASSES.get(kind)
        if cls is None:
            raise ValueError(
                f"option {key!r} was saved as an unknown {kind!r}; load it with the dist_optim that saved it"
            )
        return cls(**{k: _restored(key, v, None) for k, v in value["fields"].items()})
    if isinstance(value, (list, tuple)):
        return type(value)(_restored(key, v, None) for v in value)
    if isinstance(value, dict):
        return {k: _restored(key, v, None) for k, v in value.items()}
    return value


def saved_group(group: Mapping[str, Any]) -> dict[str, Any]:
    """``group`` (without ``params``) with every option in plain form (module docstring)."""
    return {k: _plain(v) for k, v in group.items() if k != "params"}


def restored_group(saved: Mapping[str, Any], built: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`saved_group`; ``built`` is the loading optimizer's group, whose callables
    take the place of saved ones. Plain values (and groups saved before this format) pass through."""
    return {k: _restored(k, v, built.get(k)) for k, v in saved.items()}


def check_state_dict(optimizer: Any, state_dict: Mapping[str, Any], mine: str) -> None:
    """Refuse, with one line naming the cause, a state dict that is not ``optimizer``'s (a
    ``DistOptimizer`` named ``mine``; for its ``load_state_dict``): one saved from another class,
    with other groups, or missing options this optimizer declares (torch's loader would replace
    the groups and fail later, deep inside a step)."""
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError(f"{mine}.load_state_dict: expected a dict with 'state' and 'param_groups'")
    meta = state_dict.get(STATE_DICT_KEY)
    saved = meta.get("optimizer") if isinstance(meta, Mapping) else None
    if isinstance(saved, str) and not same_optimizer(saved, type(optimizer)):
        raise ValueError(
            f"{mine}.load_state_dict: this state dict was saved by {saved}; load it into a {saved}, or "
            f"convert the saved optimizer with dist_optim.convert(...) before saving"
        )
    groups = state_dict["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(
            f"{mine}.load_state_dict: the state dict has {len(groups)} param groups, this optimizer "
            f"{len(optimizer.param_groups)}; build the optimizer with the same groups as the saved one"
        )
    for i, (options, group) in enumerate(zip(groups, optimizer.param_groups)):
        missing = sorted(optimizer.option_names - set(options))
        if missing:
            origin = f"saved by {saved}" if saved else "not saved by a dist_optim optimizer"
            raise ValueError(
                f"{mine}.load_state_dict: param group {i} of the state dict lacks {', '.join(missing)} "
                f"({origin}); load a state dict saved by this optimizer"
            )
        optimizer.validate_group({**options, "params": group["params"]})


class SavedState(torch.optim.Optimizer):
    """torch.optim's persistence contract, as every dist_optim optimizer keeps it: copies and
    pickles of the whole optimizer, state dicts of plain data that load more than once and from
    other tools' forms. ``DistOptimizer`` is built on it; it declares ``option_names`` and its
    ``validate_group`` checks a loaded state dict's groups."""

    option_names: frozenset[str]

    def validate_group(self, group: dict[str, Any]) -> None:
        """Check one param group's options (``DistOptimizer`` overrides it)."""

    def extra_state(self) -> dict[str, Any]:
        """Optimizer-level state beyond per-parameter state, saved under :data:`STATE_DICT_KEY`."""
        return {}

    def load_extra_state(self, extra: dict[str, Any]) -> None:
        """Inverse of :meth:`extra_state`."""

    # ---- copies and pickles ---------------------------------------------------------------
    #: torch's hook tables: a copy or an unpickled optimizer starts without hooks, as torch's do.
    _HOOK_TABLES = (
        "_optimizer_step_pre_hooks",
        "_optimizer_step_post_hooks",
        "_optimizer_state_dict_pre_hooks",
        "_optimizer_state_dict_post_hooks",
        "_optimizer_load_state_dict_pre_hooks",
        "_optimizer_load_state_dict_post_hooks",
    )

    def __getstate__(self) -> dict[str, Any]:  # type: ignore[override]
        """Everything the optimizer is (torch's keeps only ``defaults``, ``state`` and
        ``param_groups``; our settings live in attributes too), less torch's hooks. A bound
        optimizer holds process groups, which do not pickle: save its ``state_dict()`` instead."""
        state = self._copyable_state()
        held = job_handles(state)
        if held:
            raise TypeError(
                f"cannot pickle a bound {type(self).__name__}: it holds {len(held)} torch.distributed object(s) "
                "(process groups); pickle its state_dict() and load it into an optimizer bound on the other side "
                "(copy.deepcopy shares the groups)"
            )
        return state

    def _copyable_state(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in self._HOOK_TABLES}

    def __deepcopy__(self, memo: dict[int, Any]) -> SavedState:
        """A copy with its own parameters and state that steps as the original would; the process
        groups of a bound optimizer are shared (a group is a handle on the job, not data)."""
        state = self._copyable_state()
        for handle in job_handles(state):
            memo[id(handle)] = handle
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(state, memo))
        return new

    # ---- torch's state dict -----------------------------------------------------------------
    def keeps_saved_dtype(self, key: str, value: torch.Tensor) -> bool:
        """Whether :meth:`load_state_dict` restores state entry ``key`` in its saved dtype. torch's
        loader casts every floating-point state tensor to its parameter's dtype, which would turn
        8-bit codes into floats or round fp32/fp64 preconditioners to bf16. The one rule per
        optimizer, read from the saved entry; element-wise optimizers keep none."""
        return False

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, plus under ``"dist_optim"`` the optimizer's class and its
        :meth:`extra_state` (the skipped-step counter, generators), so that a
        ``state_dict()`` / :meth:`load_state_dict` round trip resumes the same trajectory. Local
        (this rank's shards); :meth:`~dist_optim.base.DistOptimizer.full_state` is the layout-independent form."""
        out = super().state_dict()
        # Options as plain data (saved_group): the dict loads with weights_only=True.
        out["param_groups"] = [{**saved_group(g), "params": g["params"]} for g in out["param_groups"]]
        out[STATE_DICT_KEY] = {"optimizer": saved_name(type(self)), "extra": self.extra_state()}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader, after checking that ``state_dict`` is this optimizer's (a state dict of
        another optimizer is refused before anything changes), keeping the dtype of the entries
        :meth:`keeps_saved_dtype` names, and restoring :meth:`extra_state`."""
        meta = state_dict.get(STATE_DICT_KEY) if isinstance(state_dict, Mapping) else None
        saved_groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
        saved = meta.get("optimizer") if isinstance(meta, Mapping) else None
        mine = isinstance(saved, str) and same_optimizer(saved, type(self))
        if isinstance(saved_groups, list) and len(saved_groups) == len(self.param_groups):
            groups = [
                restored_group(sg, g) if isinstance(sg, Mapping) else sg
                for sg, g in zip(saved_groups, self.param_groups)
            ]
            if mine:
                # Saved by this optimizer before an option was added: the option keeps the value this
                # optimizer was built with.
                built = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
                groups = [{**b, **sg} for b, sg in zip(built, groups)]
            state_dict = {**state_dict, "param_groups": groups}
        check_state_dict(self, state_dict, saved_name(type(self)))
        kept: dict[Any, dict[str, torch.Tensor]] = {}
        states: dict[Any, Any] = {}
        for pid, st in state_dict["state"].items():
            keep = {k: v for k, v in st.items() if isinstance(v, torch.Tensor) and self.keeps_saved_dtype(k, v)}
            states[pid] = {k: v for k, v in st.items() if k not in keep}
            if keep:
                kept[pid] = keep
        plain = {k: v for k, v in state_dict.items() if k != STATE_DICT_KEY}
        super().load_state_dict({**plain, "state": states})
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        by_id = dict(zip(saved_ids, [p for g in self.param_groups for p in g["params"]]))
        for pid, entries in kept.items():
            p = by_id[pid]
            for key, value in entries.items():
                self.state[p][key] = value.detach().to(device=p.device, copy=True)
        for p, state in self.state.items():
            # State dicts of other tools and older versions may hold counters as numbers; the math
            # takes them as tensors (torch's optimizers convert them on load too).
            for key in self._counters:
                value = state.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    state[key] = self._new_counter(p, float(value))
        if meta is not None:
            self.load_extra_state(meta["extra"])

    #: Per-parameter state entries held as 0-d fp32 tensors (step counters).
    _counters: tuple[str, ...] = ("step",)

    #: Whether the counters live on their parameter's device (Muon's auxiliary AdamW) rather than
    #: on the CPU, where torch keeps the steps of optimizers that are not capturable.
    _counters_on_param_device = False

    def _new_counter(self, param: torch.Tensor, value: float) -> torch.Tensor:
        """A counter of ``param``'s state as the optimizer makes it."""
        return torch.tensor(value, dtype=torch.float32, device=param.device if self._counters_on_param_device else None)
